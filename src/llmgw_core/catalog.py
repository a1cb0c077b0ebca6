"""The model catalog: the one place where a model entry is validated.

A model is served either by engines the user runs (`endpoints`, router-only) or
by replicas the control plane places on GPU nodes (`[models.profile]`), never
both. The router reads the endpoints; the control plane reads the profiles.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import attrs

from llmgw_core.tomlshape import Table

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

ENGINES = ("vllm", "sglang", "llamacpp", "mock")
# The agent sets these from the GPUs it assigns; a profile that set them would
# let two replicas share a GPU.
_AGENT_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"})


@attrs.frozen
class Endpoint:
    """An engine's root URL, such as http://10.0.0.5:8000."""

    host: str
    port: int
    prefix: str = ""  # a path prefix when the engine sits behind a path-routing proxy
    # Sent as `Authorization: Bearer` on every request and health probe (empty: none).
    # Part of equality: a new key is a new engine, so no pooled connection carries over.
    api_key: str = attrs.field(default="", repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.prefix}"

    def __str__(self) -> str:
        return self.url


def parse_endpoint(text: str) -> Endpoint:
    """Parse an engine URL; raises ValueError with what is wrong."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid URL: {exc}") from None
    if parts.scheme != "http":
        raise ValueError(f"{text!r} must start with http:// (engines are reached over plain HTTP)")
    if not parts.hostname:
        raise ValueError(f"{text!r} has no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{text!r} must not have a query, fragment or user")
    prefix = parts.path.rstrip("/")
    if prefix.endswith("/v1"):
        raise ValueError(f"{text!r}: give the engine's root URL, without /v1")
    return Endpoint(host=parts.hostname, port=port or 80, prefix=prefix)


@attrs.frozen
class Profile:
    """How the control plane runs a model: engine, weights, parallelism, where it may go."""

    engine: str  # one of ENGINES
    model: str  # the weights: a Hugging Face id or a local path on the nodes
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    gpu_memory_gib: float = 0.0  # free memory each GPU must have; 0 asks for none
    gpu_model: str | None = None  # a case-insensitive substring of the GPU name
    # Dicts are excluded from the hash so that a frozen Profile stays hashable.
    node_selector: dict[str, str] = attrs.field(factory=dict, hash=False)
    args: tuple[str, ...] = ()  # passed to the engine after the arguments llmgw builds
    env: dict[str, str] = attrs.field(factory=dict, hash=False)  # the engine's environment

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


def _default_replicas(entry: ModelEntry) -> int:
    return 1 if entry.profile is not None else 0


@attrs.frozen
class ModelEntry:
    name: str
    endpoints: tuple[Endpoint, ...] = ()  # empty for a model with a profile
    profile: Profile | None = None
    # Replicas the control plane keeps running: 1 by default with a profile,
    # 0 for a router-only model.
    replicas: int = attrs.field(default=attrs.Factory(_default_replicas, takes_self=True))


@attrs.frozen
class Catalog:
    models: tuple[ModelEntry, ...]

    @property
    def profiled(self) -> tuple[ModelEntry, ...]:
        """The models the control plane places; when there are none, it does not run."""
        return tuple(m for m in self.models if m.profile is not None)

    def get(self, name: str) -> ModelEntry | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def read_catalog(root: Table) -> Catalog:
    """Read and validate every `[[models]]` entry of a config file."""
    models: list[ModelEntry] = []
    seen: dict[str, str] = {}
    for table in root.tables("models"):
        entry = _read_model(table)
        if entry.name in seen:
            table.fail("name", f"duplicates the model name {entry.name!r} of {seen[entry.name]}")
        seen[entry.name] = table.path
        models.append(entry)
    return Catalog(models=tuple(models))


def _read_model(table: Table) -> ModelEntry:
    name = table.text("name")
    if not _MODEL_NAME.match(name):
        table.fail("name", f"{name!r} is not a valid model name (letters, digits, ._:/@+-)")
    has_endpoints, has_profile = table.has("endpoints"), table.has("profile")
    if has_endpoints and has_profile:
        table.fail(
            "profile",
            "cannot be combined with endpoints: a model is served either by engines "
            "you run (endpoints) or by replicas the control plane places (profile)",
        )
    if not has_endpoints and not has_profile:
        # A misspelt key ('endpionts') is the likely cause: report it as such.
        table.texts("endpoints", ())
        table.table("profile")
        table.integer("replicas", 1)
        table.finish()
        table.fail(
            None,
            f"model {name!r} needs either endpoints (the URLs of engines you run) "
            "or a [models.profile] (engines the control plane places on GPU nodes)",
        )
    if has_endpoints:
        if table.has("replicas"):
            table.fail(
                "replicas", "only applies to a model with a profile; endpoints list every engine"
            )
        entry = ModelEntry(name=name, endpoints=_read_endpoints(table))
    else:
        replicas = table.integer("replicas", 1, min=0)
        profile = _read_profile(table.table("profile"))
        entry = ModelEntry(name=name, profile=profile, replicas=replicas)
    table.finish()
    return entry


def _read_endpoints(table: Table) -> tuple[Endpoint, ...]:
    raw = table.texts("endpoints")
    if not raw:
        table.fail("endpoints", "must list at least one engine URL")
    endpoints: list[Endpoint] = []
    for i, text in enumerate(raw):
        try:
            endpoint = parse_endpoint(text)
        except ValueError as exc:
            table.fail(f"endpoints[{i}]", str(exc))
        if endpoint in endpoints:
            table.fail(f"endpoints[{i}]", f"{text!r} is listed twice")
        endpoints.append(endpoint)
    return tuple(endpoints)


def _read_profile(t: Table) -> Profile:
    engine = t.text("engine")
    if engine not in ENGINES:
        t.fail("engine", f"must be one of {', '.join(ENGINES)}, not {engine!r}")
    gpu_model = t.text("gpu_model", None)
    env = t.labels("env", {})
    for key in env:
        if not _ENV_NAME.match(key):
            t.fail(f"env.{key}", "is not a valid environment variable name")
        if key in _AGENT_ENV:
            t.fail(f"env.{key}", "is set by the agent from the GPUs it assigns to the replica")
    profile = Profile(
        engine=engine,
        model=t.text("model"),
        tensor_parallel=t.integer("tensor_parallel", 1, min=1),
        pipeline_parallel=t.integer("pipeline_parallel", 1, min=1),
        gpu_memory_gib=t.number("gpu_memory_gib", 0.0, min=0),
        gpu_model=gpu_model.strip() if gpu_model is not None else None,
        node_selector=t.labels("node_selector", {}),
        args=t.texts("args", ()),
        env=env,
    )
    t.finish()
    return profile
