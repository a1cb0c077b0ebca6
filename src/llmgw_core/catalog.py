"""The model catalog: the one place where a model entry is validated.

A model is served either by engines the user runs (`endpoints`, router-only) or
by replicas the control plane places on GPU nodes (`[models.profile]`), never
both. The router reads the endpoints; the control plane reads the profiles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from llmgw_core.autoscaling import Autoscale
from llmgw_core.config_schema import (
    Problem,
    read_item,
    read_path,
    read_table,
    read_text,
    reading_environ,
    rule_after,
    rule_before,
    rules,
)
from llmgw_core.engines import (
    CONTEXT_FLAGS,
    ENGINE_KINDS,
    LORA_RANKS,
    LORA_REFUSED,
    context_flag_in,
    lora_flag_in,
)
from llmgw_core.tomlshape import Table, type_name

# The engines that publish vLLM's KV-cache events (the mock engine as vLLM does).
KV_EVENT_ENGINES = ("vllm", "mock")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The adapters one profile may declare: each is a model name clients see, and vLLM loads
# every one at start (static adapters), so a profile is not an adapter registry.
MAX_LORA_ADAPTERS = 64

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
    # Where the engine publishes its KV-cache events (vLLM's --kv-events-config
    # `endpoint`, ZMQ: tcp://host:port) and answers replays (`replay_endpoint`); empty:
    # none, and `balancing = "precise"` routes it as cache_aware does.
    kv_events: str = ""
    kv_replay: str = ""

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


def _engine(engine: str) -> str:
    if engine not in ENGINE_KINDS:
        raise Problem(f"must be one of {', '.join(ENGINE_KINDS)}, not {engine!r}")
    return engine


def _engine_env(env: dict[str, str]) -> dict[str, str]:
    for key in env:
        if not _ENV_NAME.match(key):
            raise Problem("is not a valid environment variable name", key)
        if key in _AGENT_ENV:
            raise Problem("is set by the agent from the GPUs it assigns to the replica", key)
    return env


def _model_name(name: str) -> str:
    if not _MODEL_NAME.match(name):
        raise Problem(f"{name!r} is not a valid model name (letters, digits, ._:/@+-)")
    return name


def _lora_path(path: str) -> str:
    if "," in path:
        # vLLM reads `--lora-modules name=path` as name=path only without a comma; with
        # one, as JSON (vllm/entrypoints/launchers/cli_args.py:55), which it is not.
        raise Problem(f"{path!r} holds a comma, which vLLM's --lora-modules cannot take")
    return path


@attrs.frozen
class LoraAdapter:
    """A LoRA adapter of a profile's model (`[[models.profile.lora]]`), which clients call
    by its own name: it starts with every replica of the model and is routed to them."""

    name: str = attrs.field(metadata=rules(check=_model_name))
    # The adapter's weights, as the engine loads them: a local path on the nodes or a
    # Hugging Face id (as the profile's `model`).
    path: str = attrs.field(metadata=rules(check=_lora_path))


def _lora_adapters(adapters: tuple[LoraAdapter, ...]) -> tuple[LoraAdapter, ...]:
    if len(adapters) > MAX_LORA_ADAPTERS:
        count, most = len(adapters), MAX_LORA_ADAPTERS
        raise Problem(f"lists {count} adapters: a profile takes {most} at most")
    return adapters


def _lora_rank(rank: int) -> int:
    if rank not in LORA_RANKS:
        raise Problem(f"must be one of {', '.join(map(str, LORA_RANKS))} (vLLM's), not {rank}")
    return rank


@attrs.frozen
class Profile:
    """How the control plane runs a model: engine, weights, parallelism, where it may go."""

    engine: str = attrs.field(metadata=rules(check=_engine))  # one of ENGINE_KINDS
    model: str  # the weights: a Hugging Face id or a local path on the nodes
    tensor_parallel: int = attrs.field(default=1, metadata=rules(min=1))
    pipeline_parallel: int = attrs.field(default=1, metadata=rules(min=1))
    # Free memory each GPU must have; 0 asks for none.
    gpu_memory_gib: float = attrs.field(default=0.0, metadata=rules(min=0))
    # A case-insensitive substring of the GPU name.
    gpu_model: str | None = attrs.field(default=None, metadata=rules(check=str.strip))
    # Dicts are excluded from the hash so that a frozen Profile stays hashable.
    node_selector: dict[str, str] = attrs.field(factory=dict, hash=False)
    # The longest context (prompt and answer, in tokens) the engine serves: vLLM's
    # --max-model-len, llama.cpp's -c, SGLang's --context-length. None: the engine's default.
    max_model_len: int | None = attrs.field(default=None, metadata=rules(min=1))
    args: tuple[str, ...] = ()  # passed to the engine after the arguments llmgw builds
    # The engine's environment.
    env: dict[str, str] = attrs.field(factory=dict, hash=False, metadata=rules(check=_engine_env))
    # LoRA adapters the engine loads at start, each a model name of its own (vLLM's
    # --enable-lora --lora-modules name=path).
    lora: tuple[LoraAdapter, ...] = attrs.field(default=(), metadata=rules(check=_lora_adapters))
    # The highest rank among the adapters: vLLM's --max-lora-rank (None: vLLM's 16).
    max_lora_rank: int | None = attrs.field(default=None, metadata=rules(check=_lora_rank))
    # Publish the engine's KV-cache events (vLLM's --kv-events-config, ZMQ) on two more
    # ports the control plane assigns, for routers with balancing = "precise".
    kv_events: bool = False

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@rule_after(Profile)
def _said_once(profile: Profile) -> None:
    # Two context lengths on one command line: the engine takes the last, silently.
    twice = context_flag_in(profile.engine, profile.args)
    if profile.max_model_len is not None and twice is not None:
        flag = CONTEXT_FLAGS[profile.engine][0]
        raise Problem(
            f"{twice} sets the context length that max_model_len already sets "
            f"({flag} {profile.max_model_len}): give it once, as max_model_len",
            "args",
        )
    _lora_served(profile)
    if profile.kv_events and profile.engine not in KV_EVENT_ENGINES:
        raise Problem(
            f"is for engines that publish KV-cache events ({', '.join(KV_EVENT_ENGINES)}), "
            f"not {profile.engine!r}",
            "kv_events",
        )


def _lora_served(profile: Profile) -> None:
    """Adapters only where the engine serves them under their names, said once."""
    if not profile.lora and profile.max_lora_rank is None:
        return
    refused = LORA_REFUSED.get(profile.engine)
    if refused is not None:
        raise Problem(f"cannot be served by engine {profile.engine!r}: {refused}", "lora")
    if not profile.lora:
        raise Problem(
            "is the rank of the profile's LoRA adapters, and it declares none "
            "([[models.profile.lora]])",
            "max_lora_rank",
        )
    twice = lora_flag_in(
        profile.engine, profile.args, adapters=True, rank=profile.max_lora_rank is not None
    )
    if twice is not None:
        raise Problem(
            f"{twice} says again what lora and max_lora_rank make llmgw pass the engine "
            "(a second --lora-modules would replace the adapters): give them once, there",
            "args",
        )


def _default_replicas(entry: ModelEntry) -> int:
    if entry.autoscale is not None:
        # Where its autoscaler starts (control.scaling): at min. A model at `min = 0` starts
        # at zero: its first request wakes it, not every control plane's start.
        return entry.autoscale.min
    return 1 if entry.profile is not None else 0


# What a header value may carry: visible ASCII (a key with a line break would add headers).
_ENGINE_KEY = re.compile(r"^[\x21-\x7e]+$")


def _engine_key(secret: str, source: str) -> str:
    """The key as read from `source` (a variable, a file), without surrounding blanks. Its
    text is never put in a message."""
    key = secret.strip()
    if not key:
        raise Problem(f"{source} is empty")
    if not _ENGINE_KEY.match(key):
        raise Problem(f"{source} holds characters other than visible ASCII (no spaces)")
    return key


def _key_from_env(name: str) -> str:
    secret = reading_environ().get(name)
    if secret is None:
        raise Problem(f"the environment variable {name} is not set")
    return _engine_key(secret, f"the environment variable {name}")


def _key_from_file(path: Path) -> str:
    try:
        secret = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise Problem(f"{str(path)!r} cannot be read: {why}") from None
    return _engine_key(secret, f"the file {str(path)!r}")


_ZMQ_ADDRESS = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})$")


def _zmq_address(text: str) -> str:
    """`tcp://host:port`, where a subscriber connects (never `*`: that is the engine's
    own side, where it binds)."""
    found = _ZMQ_ADDRESS.match(text)
    if not found or not 0 < int(found.group(2)) < 65536 or found.group(1) == "*":
        raise Problem(f"must be tcp://host:port, the address the engine publishes on, not {text!r}")
    return text


@attrs.frozen
class _KeyedEndpoint:
    """An item of `endpoints` given as a table: `{url = "...", key_env = "VLLM_KEY"}`, or
    `key_file = "..."`: the engine's key (vLLM's --api-key), sent as `Authorization:
    Bearer` to that engine alone, by requests and probes. Never the key's text itself."""

    url: str = attrs.field(metadata=rules(parse=read_text))
    # The key itself, read from the variable named at `key_env` / the file at `key_file`.
    key_from_env: str | None = attrs.field(
        default=None, repr=False, metadata=rules(key="key_env", check=_key_from_env)
    )
    key_from_file: str | None = attrs.field(
        default=None,
        repr=False,
        metadata=rules(key="key_file", parse=read_path, check=_key_from_file),
    )
    # The engine's KV-cache events, for `balancing = "precise"` (router.kv_feed).
    kv_events: str = attrs.field(default="", metadata=rules(parse=read_text, check=_zmq_address))
    kv_replay: str = attrs.field(default="", metadata=rules(parse=read_text, check=_zmq_address))


_KEY_IN_TEXT = ("api_key", "key", "token", "bearer")


@rule_before(_KeyedEndpoint)
def _one_key_source(data: Mapping[str, object]) -> None:
    for name in _KEY_IN_TEXT:
        if name in data:
            raise Problem(
                "is not a known key: an engine key is never written in the config; name "
                "the environment variable that holds it (key_env) or a file (key_file)",
                name,
            )
    if "key_env" in data and "key_file" in data:
        raise Problem("give key_env or key_file, not both", "key_file")


def _endpoint_item(item: object, index: int) -> Endpoint:
    if isinstance(item, dict):
        keyed = read_item(item, _KeyedEndpoint, index)
        url, key = keyed.url, keyed.key_from_env or keyed.key_from_file or ""
        if keyed.kv_replay and not keyed.kv_events:
            what = "needs kv_events: a replay answers for the events missed"
            raise Problem(what, f"[{index}].kv_replay")
        events, replay = keyed.kv_events, keyed.kv_replay
        where = f"[{index}].url"
    elif isinstance(item, str):
        url, key, where, events, replay = item, "", f"[{index}]", "", ""
    else:
        raise Problem(
            f"must be an engine URL or a table {{url = ..., key_env = ...}}, not {type_name(item)}",
            f"[{index}]",
        )
    try:
        endpoint = parse_endpoint(url)
        return attrs.evolve(endpoint, api_key=key, kv_events=events, kv_replay=replay)
    except ValueError as exc:
        raise Problem(str(exc), where) from None


def _endpoints(value: object) -> tuple[Endpoint, ...]:
    if not isinstance(value, list):
        raise Problem(f"must be an array of engine URLs, not {type_name(value)}")
    if not value:
        raise Problem("must list at least one engine URL")
    endpoints: list[Endpoint] = []
    for i, item in enumerate(value):
        endpoint = _endpoint_item(item, i)
        if any(e.url == endpoint.url for e in endpoints):
            raise Problem(f"{endpoint.url!r} is listed twice", f"[{i}]")
        endpoints.append(endpoint)
    return tuple(endpoints)


@attrs.frozen
class ModelEntry:
    name: str = attrs.field(metadata=rules(check=_model_name))
    # Empty for a model with a profile.
    endpoints: tuple[Endpoint, ...] = attrs.field(default=(), metadata=rules(parse=_endpoints))
    profile: Profile | None = None
    # Replicas that follow the load (issue 23); None: a fixed `replicas`.
    autoscale: Autoscale | None = None
    # Replicas the control plane keeps running: 1 by default with a profile,
    # 0 for a router-only model; with `autoscale`, where it starts.
    replicas: int = attrs.field(
        default=attrs.Factory(_default_replicas, takes_self=True), metadata=rules(min=0)
    )


@rule_before(ModelEntry)
def _endpoints_or_profile(data: Mapping[str, object]) -> None:
    if "endpoints" in data and "profile" in data:
        raise Problem(
            "cannot be combined with endpoints: a model is served either by engines "
            "you run (endpoints) or by replicas the control plane places (profile)",
            "profile",
        )
    if "endpoints" in data and "replicas" in data:
        raise Problem(
            "only applies to a model with a profile; endpoints list every engine", "replicas"
        )
    if "autoscale" in data and "profile" not in data:
        raise Problem(
            "only applies to a model with a profile: the control plane scales the replicas "
            "it places, not engines you run (endpoints)",
            "autoscale",
        )
    if "autoscale" in data and "replicas" in data:
        raise Problem(
            "cannot be combined with [models.autoscale]: give a fixed replicas count, or "
            "autoscale's min and max",
            "replicas",
        )


@rule_after(ModelEntry)
def _served_somehow(entry: ModelEntry) -> None:
    # Checked once every key was read: a misspelt key ('endpionts') is the likely
    # cause, and is reported as such first.
    if not entry.endpoints and entry.profile is None:
        raise Problem(
            f"model {entry.name!r} needs either endpoints (the URLs of engines you run) "
            "or a [models.profile] (engines the control plane places on GPU nodes)"
        )


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

    @property
    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter of a profile -> the name of the model it adapts."""
        return {
            adapter.name: entry.name
            for entry in self.models
            if entry.profile is not None
            for adapter in entry.profile.lora
        }


@rule_after(Catalog)
def _names_once(catalog: Catalog) -> None:
    """A name clients call is one model's or one adapter's, across the whole catalog."""
    models: dict[str, int] = {}
    for i, entry in enumerate(catalog.models):
        if entry.name in models:
            raise Problem(
                f"duplicates the model name {entry.name!r} of models[{models[entry.name]}]",
                f"models[{i}].name",
            )
        models[entry.name] = i
    adapters: dict[str, str] = {}  # name -> where it was declared
    for i, entry in enumerate(catalog.models):
        for j, adapter in enumerate(entry.profile.lora if entry.profile else ()):
            name, where = adapter.name, f"models[{i}].profile.lora[{j}]"
            if name in models:
                taken = f"the model models[{models[name]}]"
            elif name in adapters:
                taken = f"the adapter {adapters[name]}"
            else:
                adapters[name] = where
                continue
            raise Problem(
                f"{name!r} is already the name of {taken}: clients call an adapter by its "
                "name, which must be no other model's or adapter's",
                f"{where}.name",
            )


def read_catalog(root: Table, environ: Mapping[str, str] | None = None) -> Catalog:
    """Read and validate every `[[models]]` entry of a config file; engine keys named by
    `key_env` are read from `environ` (os.environ)."""
    if not root.has("models"):
        root.known("models")
        return Catalog(models=())  # the config says what it needs (at least one model)
    return read_table(root, Catalog, keys=("models",), environ=environ)
