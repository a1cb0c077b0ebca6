"""The server's config file: `[server]`, `[router]`, `[auth]`, `[admin]` and the catalog."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path

import attrs

from llmgw_core.catalog import Catalog, read_catalog
from llmgw_core.control_config import ControlSection, read_control
from llmgw_core.tls_config import AgentsTLS, read_agents_tls
from llmgw_core.tomlshape import Table, load_toml

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@attrs.frozen
class ListenAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(text: str) -> ListenAddress:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} must be HOST:PORT, such as 127.0.0.1:8080")
    return ListenAddress(host=host.strip("[]"), port=int(port))


@attrs.frozen
class ServerSection:
    listen: ListenAddress = ListenAddress("127.0.0.1", 8080)
    # The agents' stream and the admin API, apart from the inference API.
    control_listen: ListenAddress = ListenAddress("127.0.0.1", 8081)
    max_body_bytes: int = 16 * 1024 * 1024
    header_timeout_s: float = 10.0  # from the first byte of a request to the end of its head
    body_timeout_s: float = 60.0  # for the whole request body
    keepalive_timeout_s: float = 75.0  # an idle connection between requests
    shutdown_grace_s: float = 30.0
    access_log: bool = True  # one line per request
    access_log_format: str = "logfmt"  # or "json"
    access_log_file: Path | None = None  # None: stderr, with the other log lines
    # Hex SHA-256 digest of the token that GET /metrics asks for; None: /metrics is open.
    metrics_token_digest: str | None = None
    # Router processes serving `listen` (one socket, shared): 1 is this process alone.
    # The file's "auto" is resolved when read: the cores this process may run on.
    workers: int = 1


BALANCING = ("cache_aware", "least_outstanding", "round_robin")


@attrs.frozen
class CacheAwareSection:
    """`[router.cache_aware]`: engine load signals, the prefix index and the load bounds."""

    metrics_interval_s: float = 1.0  # each engine's /metrics is read this often (0: never)
    metrics_max_age_s: float = 3.0  # an older reading is not used: the router's own counts are
    block_bytes: int = 256  # prompt text per hashed block (about 64 tokens of English)
    index_blocks: int = 16384  # prefix entries remembered per replica (LRU)
    index_ttl_s: float = 600.0  # an entry not sent again for this long is forgotten
    max_load_ratio: float = 1.5  # a conversation stays on its replica while its load is
    load_slack: float = 8.0  #   <= max(least * max_load_ratio, least + load_slack)
    new_load_slack: float = 1.0  # a new conversation goes where load <= least + this
    max_share: float = 1.4  # ... and conversations held < this x the mean (+ 1)
    shared_prefix_ratio: float = 0.5  # a prefix held elsewhere this big is shared: by load
    waiting_weight: float = 4.0  # a waiting request counts 1 + this (it waits behind all)
    kv_usage_weight: float = 1.0  # a full KV cache counts as this many requests


@attrs.frozen
class RouterSection:
    balancing: str = "cache_aware"  # one of BALANCING
    cache_aware: CacheAwareSection = CacheAwareSection()
    retries: int = 2  # further attempts on other replicas before the first byte
    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 600.0
    read_idle_timeout_s: float = 300.0  # after the head: an engine silent this long has stalled
    # A pooled connection idle longer than this is never reused: engines close idle
    # keep-alives without saying so (uvicorn after 5 s, llama-server after 5 s).
    upstream_idle_s: float = 4.0
    eject_after_failures: int = 3  # consecutive failures that eject a replica
    eject_cooldown_s: float = 10.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    session_header: str = "x-session-id"


@attrs.frozen
class AuthSection:
    # Hex SHA-256 digest of each API key (without the prefix) -> the models it may use,
    # None for every model. Raw keys are never kept: a key from an environment variable
    # is hashed when the config is read.
    keys: Mapping[str, frozenset[str] | None] = attrs.field(factory=dict)

    @property
    def required(self) -> bool:
        """Whether clients must send a key (any key is configured)."""
        return bool(self.keys)

    @property
    def api_key_digests(self) -> frozenset[str]:
        return frozenset(self.keys)


@attrs.frozen
class AdminSection:
    """Who may use the admin API on the control port."""

    token_digest: str | None = None  # hex SHA-256 digest of the admin token, None: no token
    open_status: bool = False  # GET status and explain without a token
    open_writes: bool = False  # cordon/drain without a token (only the no-[admin] default)
    # False when the file has no [admin] section: then the admin API is open (status and
    # actions) when control_listen is a loopback address, and refuses everything otherwise.
    declared: bool = True
    # Hex SHA-256 digest of the router token: it may only follow the replica sets
    # (`llmgw-server router --control URL`), never read status or act. None: no router may.
    router_token_digest: str | None = None


@attrs.frozen
class Config:
    file: str
    server: ServerSection
    router: RouterSection
    auth: AuthSection
    catalog: Catalog
    control: ControlSection = attrs.field(factory=ControlSection)
    admin: AdminSection = attrs.field(factory=AdminSection)
    agents: AgentsTLS = attrs.field(factory=AgentsTLS)  # TLS for the agent stream

    @property
    def runs_control_plane(self) -> bool:
        """A control plane runs whenever any model declares a profile."""
        return bool(self.catalog.profiled)


def load_config(path: str | Path, *, environ: Mapping[str, str] | None = None) -> Config:
    """Read and validate a config file; raises ConfigError naming file, key path and problem."""
    file = str(path)
    data = load_toml(path)
    return parse_config(data, file, environ=environ)


def parse_config(
    data: dict[str, object], file: str, *, environ: Mapping[str, str] | None = None
) -> Config:
    """Validate config data; keys named by `env` are read from `environ` (os.environ)."""
    root = Table(data, file)
    environ = os.environ if environ is None else environ
    server = _read_server(root.table("server"), environ)
    catalog = read_catalog(root)
    config = Config(
        file=file,
        server=server,
        router=_read_router(root.table("router")),
        auth=_read_auth(root.table("auth"), catalog, environ),
        catalog=catalog,
        control=read_control(root.table("control")),
        admin=_read_admin(root.table("admin"), root.has("admin"), server, environ),
        # Read whenever a control plane runs (it then must say how agents connect),
        # and whenever present, so that a typo never waits for that day.
        agents=read_agents_tls(root.table("agents"))
        if catalog.profiled or root.has("agents")
        else AgentsTLS(),
    )
    root.finish()
    if not config.catalog.models:
        root.fail("models", "no model is declared: add at least one [[models]] table")
    return config


def _read_server(t: Table, environ: Mapping[str, str]) -> ServerSection:
    d = ServerSection()

    def address(key: str, default: ListenAddress) -> ListenAddress:
        if not t.has(key):
            return default
        try:
            return parse_listen(t.text(key))
        except ValueError as exc:
            t.fail(key, str(exc))

    section = ServerSection(
        listen=address("listen", d.listen),
        control_listen=address("control_listen", d.control_listen),
        max_body_bytes=t.integer("max_body_bytes", d.max_body_bytes, min=1024),
        header_timeout_s=t.number("header_timeout_s", d.header_timeout_s, min=0.1),
        body_timeout_s=t.number("body_timeout_s", d.body_timeout_s, min=0.1),
        keepalive_timeout_s=t.number("keepalive_timeout_s", d.keepalive_timeout_s, min=0.1),
        shutdown_grace_s=t.number("shutdown_grace_s", d.shutdown_grace_s, min=0),
        access_log=t.boolean("access_log", d.access_log),
        access_log_format=_access_log_format(t),
        access_log_file=_access_log_file(t),
        metrics_token_digest=_optional_secret(t, "metrics_token", environ),
        workers=_workers(t),
    )
    t.finish()
    return section


def _workers(t: Table) -> int:
    if t.has("workers") and isinstance(t.raw("workers"), str):
        if t.text("workers") != "auto":
            t.fail("workers", "must be a number of processes (1 or more) or \"auto\"")
        return len(os.sched_getaffinity(0))
    workers: int = t.integer("workers", 1, min=1)
    return workers


def _access_log_format(t: Table) -> str:
    text: str = t.text("access_log_format", "logfmt")
    if text not in ("logfmt", "json"):
        t.fail("access_log_format", "must be 'logfmt' or 'json'")
    return text


def _access_log_file(t: Table) -> Path | None:
    path: Path | None = t.file_path("access_log_file", None)
    if path is not None and not path.parent.is_dir():
        t.fail("access_log_file", f"{str(path)!r}: no directory {str(path.parent)!r}")
    return path


def _optional_secret(t: Table, name: str, environ: Mapping[str, str]) -> str | None:
    """The digest at `name`_digest or of the variable named at `name`_env; None if neither."""
    if t.has(f"{name}_digest") and t.has(f"{name}_env"):
        t.fail(f"{name}_env", f"give {name}_digest or {name}_env, not both")
    if t.has(f"{name}_digest"):
        return _digest(t, f"{name}_digest")
    if t.has(f"{name}_env"):
        return _secret_from_env(t, f"{name}_env", environ)
    return None


def _read_router(t: Table) -> RouterSection:
    d = RouterSection()
    balancing = t.text("balancing", d.balancing)
    if balancing not in BALANCING:
        import difflib

        close = difflib.get_close_matches(balancing, BALANCING, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        t.fail("balancing", f"must be one of {', '.join(BALANCING)}, not {balancing!r}{hint}")
    section = RouterSection(
        balancing=balancing,
        cache_aware=_read_cache_aware(t.table("cache_aware")),
        retries=t.integer("retries", d.retries, min=0),
        connect_timeout_s=t.number("connect_timeout_s", d.connect_timeout_s, min=0.01),
        first_byte_timeout_s=t.number("first_byte_timeout_s", d.first_byte_timeout_s, min=0.1),
        read_idle_timeout_s=t.number("read_idle_timeout_s", d.read_idle_timeout_s, min=0.1),
        upstream_idle_s=t.number("upstream_idle_s", d.upstream_idle_s, min=0),
        eject_after_failures=t.integer("eject_after_failures", d.eject_after_failures, min=1),
        eject_cooldown_s=t.number("eject_cooldown_s", d.eject_cooldown_s, min=0.01),
        health_interval_s=t.number("health_interval_s", d.health_interval_s, min=0.01),
        health_timeout_s=t.number("health_timeout_s", d.health_timeout_s, min=0.01),
        session_header=t.text("session_header", d.session_header).lower(),
    )
    t.finish()
    return section


def _read_cache_aware(t: Table) -> CacheAwareSection:
    d = CacheAwareSection()
    section = CacheAwareSection(
        metrics_interval_s=t.number("metrics_interval_s", d.metrics_interval_s, min=0),
        metrics_max_age_s=t.number("metrics_max_age_s", d.metrics_max_age_s, min=0.01),
        block_bytes=t.integer("block_bytes", d.block_bytes, min=16),
        index_blocks=t.integer("index_blocks", d.index_blocks, min=1),
        index_ttl_s=t.number("index_ttl_s", d.index_ttl_s, min=0.01),
        max_load_ratio=t.number("max_load_ratio", d.max_load_ratio, min=1),
        load_slack=t.number("load_slack", d.load_slack, min=0),
        new_load_slack=t.number("new_load_slack", d.new_load_slack, min=0),
        max_share=t.number("max_share", d.max_share, min=1),
        shared_prefix_ratio=t.number("shared_prefix_ratio", d.shared_prefix_ratio, min=0),
        waiting_weight=t.number("waiting_weight", d.waiting_weight, min=0),
        kv_usage_weight=t.number("kv_usage_weight", d.kv_usage_weight, min=0),
    )
    if section.shared_prefix_ratio > 1:
        t.fail("shared_prefix_ratio", f"must be at most 1, not {section.shared_prefix_ratio}")
    if section.metrics_max_age_s < section.metrics_interval_s:
        t.fail(
            "metrics_max_age_s",
            f"must be at least metrics_interval_s ({section.metrics_interval_s}): "
            "every reading would be too old before the next one",
        )
    t.finish()
    return section


_HASH_HINT = "make one with: python -m llmgw_server hash-key"


def digest_of(secret: str | bytes) -> str:
    """The hex SHA-256 digest under which a key or token is kept."""
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()


def _checked_digest(t: Table, key: str, text: str) -> str:
    if not _DIGEST.match(text):
        t.fail(key, f"must be 'sha256:' and 64 lowercase hex digits ({_HASH_HINT})")
    return text.removeprefix("sha256:")


def _digest(t: Table, key: str) -> str:
    return _checked_digest(t, key, t.text(key))


def _secret_from_env(t: Table, key: str, environ: Mapping[str, str]) -> str:
    """The digest of the secret held by the environment variable named at `key`."""
    name: str = t.text(key)
    value = environ.get(name)
    if value is None:
        t.fail(key, f"the environment variable {name} is not set")
    if not value.strip():
        t.fail(key, f"the environment variable {name} is empty")
    return digest_of(value.strip())


def _read_auth(t: Table, catalog: Catalog, environ: Mapping[str, str]) -> AuthSection:
    keys: dict[str, frozenset[str] | None] = {}
    where: dict[str, str] = {}

    def add(digest: str, models: frozenset[str] | None, path: str) -> None:
        if digest in where:
            t.fail(path, f"is the same key as {where[digest]}: give each key once")
        where[digest] = f"{t.path}.{path}"
        keys[digest] = models

    for i, text in enumerate(t.texts("api_keys", ())):
        add(_checked_digest(t, f"api_keys[{i}]", text), None, f"api_keys[{i}]")
    known = {m.name for m in catalog.models}
    for i, k in enumerate(t.tables("keys")):
        if k.has("digest") == k.has("env"):
            k.fail(None, "give either digest (a stored digest) or env (a variable holding the key)")
        digest = _digest(k, "digest") if k.has("digest") else _secret_from_env(k, "env", environ)
        models: frozenset[str] | None = None
        names: tuple[str, ...] | None = k.texts("models", None)  # None: every model
        if names is not None:
            if not names:
                k.fail("models", "must name at least one model (leave it out for every model)")
            for j, name in enumerate(names):
                if name not in known:
                    k.fail(f"models[{j}]", f"{name!r} is not a model of this config")
            models = frozenset(names)
        k.finish()
        add(digest, models, f"keys[{i}]")
    t.finish()
    return AuthSection(keys=keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_admin(
    t: Table, declared: bool, server: ServerSection, environ: Mapping[str, str]
) -> AdminSection:
    if not declared:
        local = is_loopback(server.control_listen.host)
        return AdminSection(open_status=local, open_writes=local, declared=False)
    if t.has("token_digest") and t.has("token_env"):
        t.fail("token_env", "give token_digest or token_env, not both")
    token: str | None = None
    if t.has("token_digest"):
        token = _digest(t, "token_digest")
    elif t.has("token_env"):
        token = _secret_from_env(t, "token_env", environ)
    section = AdminSection(
        token_digest=token,
        open_status=t.boolean("open_status", False),
        router_token_digest=_optional_secret(t, "router_token", environ),
    )
    t.finish()
    return section
