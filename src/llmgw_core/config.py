"""The server's config file: `[server]`, `[router]`, `[auth]`, `[admin]` and the catalog.

Each section is declared once, as the attrs class below: its fields' metadata (`rules`)
say what the file may hold, and `config_schema.structure` reads the file into it.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import attrs

from llmgw_core.api_paths import valid_extra_path
from llmgw_core.catalog import Catalog, read_catalog
from llmgw_core.config_schema import (
    CONVERTER,
    Problem,
    checked_digest,
    digest_hook,
    read_integer,
    read_table,
    read_text,
    read_texts,
    rule_after,
    rule_before,
    rules,
)
from llmgw_core.config_schema import digest_of as digest_of  # imported from here by others
from llmgw_core.control_config import ControlSection
from llmgw_core.tenancy_config import DEFAULT_TENANT, TenantBook, key_tenant, tenant_name
from llmgw_core.tls_config import AgentsTLS, read_agents_tls
from llmgw_core.tomlshape import Table, closest, load_toml


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


def _read_listen(value: object, _: object) -> ListenAddress:
    try:
        return parse_listen(read_text(value))
    except ValueError as exc:
        raise Problem(str(exc)) from None


CONVERTER.register_structure_hook(ListenAddress, _read_listen)


def _access_log_format(text: str) -> str:
    if text not in ("logfmt", "json"):
        raise Problem("must be 'logfmt' or 'json'")
    return text


def _access_log_file(path: Path) -> Path:
    if not path.parent.is_dir():
        raise Problem(f"{str(path)!r}: no directory {str(path.parent)!r}")
    return path


def _workers(value: object) -> int:
    """A number of processes, or "auto": the cores this process may run on."""
    if isinstance(value, str):
        if read_text(value) != "auto":
            raise Problem('must be a number of processes (1 or more) or "auto"')
        return len(os.sched_getaffinity(0))
    return read_integer(value)


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*\.?")


def _extra_paths(value: object) -> tuple[str, ...]:
    """More POST paths relayed by the JSON body's model, as the built-in ones are."""
    paths = []
    for i, text in enumerate(read_texts(value)):
        try:
            paths.append(valid_extra_path(text))
        except ValueError as exc:
            raise Problem(f"{text!r} {exc}", f"[{i}]") from None
    return tuple(paths)


def _control_hosts(value: object) -> tuple[str, ...]:
    """Host names or IP addresses, without a scheme or a port (`[::1]` or `::1`)."""
    hosts = []
    for i, text in enumerate(read_texts(value)):
        name = text.strip().lower()
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        try:
            ipaddress.ip_address(name)
        except ValueError:
            if len(name) > 253 or not _HOST_NAME.fullmatch(name):
                raise Problem(
                    f"{text!r} must be a host name or an IP address, without a scheme or a port",
                    f"[{i}]",
                ) from None
        hosts.append(name.removesuffix("."))
    return tuple(hosts)


@attrs.frozen
class ServerSection:
    listen: ListenAddress = ListenAddress("127.0.0.1", 8080)
    # The agents' stream and the admin API, apart from the inference API.
    control_listen: ListenAddress = ListenAddress("127.0.0.1", 8081)
    # More names the control port answers to (a proxy's, an alias's), beside its
    # certificate's names, control_listen's host and loopback names on loopback.
    control_hosts: tuple[str, ...] = attrs.field(default=(), metadata=rules(parse=_control_hosts))
    max_body_bytes: int = attrs.field(default=16 * 1024 * 1024, metadata=rules(min=1024))
    # From the first byte of a request to the end of its head.
    header_timeout_s: float = attrs.field(default=10.0, metadata=rules(min=0.1))
    body_timeout_s: float = attrs.field(default=60.0, metadata=rules(min=0.1))  # whole body
    # An idle connection between requests.
    keepalive_timeout_s: float = attrs.field(default=75.0, metadata=rules(min=0.1))
    shutdown_grace_s: float = attrs.field(default=30.0, metadata=rules(min=0))
    # Client connections one router process serves at once (2,000 idle keep-alives fit);
    # past it a new connection is answered 503 and closed.
    max_connections: int = attrs.field(default=4096, metadata=rules(min=1))
    # A request body must average this many bytes/s since its start, from its first 5 s
    # on (408 otherwise); 0: no minimum.
    min_body_rate: int = attrs.field(default=1024, metadata=rules(min=0))
    access_log: bool = True  # one line per request
    access_log_format: str = attrs.field(  # or "json"
        default="logfmt", metadata=rules(check=_access_log_format)
    )
    # None: stderr, with the other log lines.
    access_log_file: Path | None = attrs.field(default=None, metadata=rules(check=_access_log_file))
    # Hex SHA-256 digest of the token that GET /metrics asks for; None: /metrics is open.
    metrics_token_digest: str | None = attrs.field(
        default=None, metadata=rules(parse=digest_hook, secret_env="metrics_token_env")
    )
    # Router processes serving `listen` (one socket, shared): 1 is this process alone.
    # The file's "auto" is resolved when read: the cores this process may run on.
    workers: int = attrs.field(default=1, metadata=rules(parse=_workers, min=1))


@attrs.frozen
class CacheAwareSection:
    """`[router.cache_aware]`: engine load signals, the prefix index and the load bounds."""

    # Each engine's /metrics is read this often (0: never).
    metrics_interval_s: float = attrs.field(default=1.0, metadata=rules(min=0))
    # An older reading is not used: the router's own counts are.
    metrics_max_age_s: float = attrs.field(default=3.0, metadata=rules(min=0.01))
    # Prompt text per hashed block (about 64 tokens of English).
    block_bytes: int = attrs.field(default=256, metadata=rules(min=16))
    # Prefix entries remembered per replica (LRU).
    index_blocks: int = attrs.field(default=16384, metadata=rules(min=1))
    # An entry not sent again for this long is forgotten.
    index_ttl_s: float = attrs.field(default=600.0, metadata=rules(min=0.01))
    # A conversation stays on its replica while its load is
    #   <= max(least * max_load_ratio, least + load_slack).
    max_load_ratio: float = attrs.field(default=1.5, metadata=rules(min=1))
    load_slack: float = attrs.field(default=8.0, metadata=rules(min=0))
    # A new conversation goes where load <= least + this...
    new_load_slack: float = attrs.field(default=1.0, metadata=rules(min=0))
    # ... and conversations held < this x the mean (+ 1).
    max_share: float = attrs.field(default=1.4, metadata=rules(min=1))
    # A prefix held elsewhere this big is shared: by load.
    shared_prefix_ratio: float = attrs.field(default=0.5, metadata=rules(min=0, max=1))
    # precise: a replica whose engine holds the prompt's first N tokens may carry N / this
    # more load than the bound (prefilling them elsewhere costs more than its queue).
    held_tokens_per_load: float = attrs.field(default=256.0, metadata=rules(min=1))
    # A waiting request counts 1 + this (it waits behind all).
    waiting_weight: float = attrs.field(default=4.0, metadata=rules(min=0))
    # A full KV cache counts as this many requests.
    kv_usage_weight: float = attrs.field(default=1.0, metadata=rules(min=0))


@rule_after(CacheAwareSection)
def _cache_aware_rules(section: CacheAwareSection) -> None:
    if section.metrics_max_age_s < section.metrics_interval_s:
        raise Problem(
            f"must be at least metrics_interval_s ({section.metrics_interval_s}): "
            "every reading would be too old before the next one",
            "metrics_max_age_s",
        )


def _queue_cost(value: str) -> str:
    if value not in ("uncached", "prompt"):
        raise Problem(f"must be 'uncached' or 'prompt', not {value!r}")
    return value


@attrs.frozen
class RouterSection:
    # A balancing policy's name: which ones there are is the server's business (its
    # llmgw_server.router.policies, checked where it reads the file: `PolicyBook`).
    balancing: str = "cache_aware"
    # Engine load signals (read by every policy that reads engine load) and the prefix
    # index: cache_aware's section, precise's too.
    cache_aware: CacheAwareSection = CacheAwareSection()
    # The other policies' sections, `[router.<key>]` read by `PolicyBook.read`: (key,
    # section) pairs.
    policy_sections: tuple[tuple[str, object], ...] = attrs.field(
        default=(), metadata=rules(in_file=False)
    )
    # Further attempts on other replicas before the first byte.
    retries: int = attrs.field(default=2, metadata=rules(min=0))
    connect_timeout_s: float = attrs.field(default=3.0, metadata=rules(min=0.01))
    first_byte_timeout_s: float = attrs.field(default=600.0, metadata=rules(min=0.1))
    # After the head: an engine silent this long has stalled.
    read_idle_timeout_s: float = attrs.field(default=300.0, metadata=rules(min=0.1))
    # A pooled connection idle longer than this is never reused: engines close idle
    # keep-alives without saying so (uvicorn after 5 s, llama-server after 5 s).
    upstream_idle_s: float = attrs.field(default=4.0, metadata=rules(min=0))
    # Consecutive failures that eject a replica.
    eject_after_failures: int = attrs.field(default=3, metadata=rules(min=1))
    eject_cooldown_s: float = attrs.field(default=10.0, metadata=rules(min=0.01))
    health_interval_s: float = attrs.field(default=5.0, metadata=rules(min=0.01))
    health_timeout_s: float = attrs.field(default=2.0, metadata=rules(min=0.01))
    session_header: str = attrs.field(default="x-session-id", metadata=rules(check=str.lower))
    # More POST paths relayed by the JSON body's model (the built-in ones: api_paths).
    extra_paths: tuple[str, ...] = attrs.field(default=(), metadata=rules(parse=_extra_paths))
    # An autoscaled model that no replica serves (scaled to zero, waking): its requests
    # wait this long for one, at most `hold_max_per_model` of them; past either, 503 with
    # Retry-After. Long enough for an engine to start on a node that has its weights.
    hold_timeout_s: float = attrs.field(default=300.0, metadata=rules(min=0.1, max=3600.0))
    hold_max_per_model: int = attrs.field(default=256, metadata=rules(min=1, max=100_000))
    # The bodies of held requests, in bytes: a model's, and all of this process's (each
    # worker has its own); past either, 503 with Retry-After too. A count alone let a
    # model hold 256 bodies of max_body_bytes (4 GiB at 16 MiB). A model's budget takes
    # at least one body of max_body_bytes: any request can wake its model.
    hold_max_bytes_per_model: int = attrs.field(default=128 * 1024 * 1024, metadata=rules(min=1024))
    hold_max_bytes: int = attrs.field(default=256 * 1024 * 1024, metadata=rules(min=1024))
    # Tenancy ([[tenants]]). A request that names no max_tokens reserves this many output
    # tokens of its tenant's tokens_per_minute, settled with the engine's usage at its end.
    reserve_output_tokens: int = attrs.field(default=512, metadata=rules(min=1))
    # The most requests this router process sends one replica at once (0: no bound). When
    # every replica of a model has as many, its requests wait here in per-tenant fair
    # queues (strict priority, then weighted deficit round robin) rather than in the
    # engines' own first-come queues: set it near the engine's batch (vLLM's
    # --max-num-seqs) divided by the router processes in front of it.
    replica_max_in_flight: int = attrs.field(default=0, metadata=rules(min=0))
    # A tenant's requests waiting in one model's fair queue, and how long each may wait;
    # past either, 429 with Retry-After.
    queue_max_per_tenant: int = attrs.field(default=256, metadata=rules(min=1, max=100_000))
    queue_max_wait_s: float = attrs.field(default=30.0, metadata=rules(min=0.01, max=3600.0))
    # What a request costs its tenant in the fair queues, settled when it ends: its
    # uncached prompt tokens and its output ("uncached"), or every prompt token alike
    # ("prompt"; the engines' cache disregarded, as a plain token limiter counts).
    queue_cost: str = attrs.field(default="uncached", metadata=rules(check=_queue_cost))
    # Streams that outlive their replica (router.continuation): a chat or completions
    # stream whose engine dies after its head goes on from another replica as a
    # continuation, at most this many times a request (0: never; the stream ends with an
    # error event, as a broken one did before).
    migrate_max: int = attrs.field(default=3, metadata=rules(min=0, max=16))
    # The generated tokens one stream keeps for that (a longer one can no longer
    # continue), and all streams of a router process together.
    migrate_keep_tokens: int = attrs.field(default=32_768, metadata=rules(min=1))
    migrate_keep_total_tokens: int = attrs.field(default=4_000_000, metadata=rules(min=1))
    # A `: migrated` SSE comment where the stream goes on (clients skip comments).
    migrate_seam_comment: bool = False


@rule_after(RouterSection)
def _hold_budgets(section: RouterSection) -> None:
    if section.hold_max_bytes < section.hold_max_bytes_per_model:
        raise Problem(
            f"must be at least hold_max_bytes_per_model ({section.hold_max_bytes_per_model}): "
            "one model could never use its own budget",
            "hold_max_bytes",
        )


def _digests(value: object) -> tuple[str, ...]:
    digests = []
    for i, text in enumerate(read_texts(value)):
        try:
            digests.append(checked_digest(text))
        except Problem as problem:
            raise Problem(problem.message, f"[{i}]") from None
    return tuple(digests)


def _some_models(names: tuple[str, ...]) -> tuple[str, ...]:
    if not names:
        raise Problem("must name at least one model (leave it out for every model)")
    return names


@attrs.frozen
class KeyEntry:
    """`[[auth.keys]]`: one API key, by its digest, and the models it may use."""

    # Hex SHA-256 digest of the key: given as `digest`, or made from the variable `env` names.
    digest: str = attrs.field(metadata=rules(parse=digest_hook, secret_env="env"))
    # None: every model. The names as the file lists them, for the key paths of errors.
    model_names: tuple[str, ...] | None = attrs.field(
        default=None, metadata=rules(key="models", check=_some_models)
    )
    # The `[[tenants]]` entry whose limits it shares; None: a tenant of its own.
    tenant: str | None = attrs.field(default=None, metadata=rules(parse=tenant_name))

    @property
    def models(self) -> frozenset[str] | None:
        return None if self.model_names is None else frozenset(self.model_names)


@rule_before(KeyEntry)
def _digest_or_env(data: Mapping[str, object]) -> None:
    if ("digest" in data) == ("env" in data):
        raise Problem("give either digest (a stored digest) or env (a variable holding the key)")


def _tenants_by_digest(section: AuthSection) -> dict[str, str]:
    tenants = dict.fromkeys(section.api_keys, DEFAULT_TENANT)
    for entry in section.entries:
        tenants[entry.digest] = entry.tenant or key_tenant(entry.digest[:8])
    return tenants


def _keys_by_digest(section: AuthSection) -> dict[str, frozenset[str] | None]:
    keys: dict[str, frozenset[str] | None] = {}
    for digest in section.api_keys:
        keys[digest] = None
    for entry in section.entries:
        keys[entry.digest] = entry.models
    return keys


@attrs.frozen
class AuthSection:
    # Hex SHA-256 digests of API keys (without the prefix) that may use every model.
    api_keys: tuple[str, ...] = attrs.field(default=(), metadata=rules(parse=_digests))
    entries: tuple[KeyEntry, ...] = attrs.field(default=(), metadata=rules(key="keys"))
    # Digest -> the models it may use, None for every model. Raw keys are never kept: a
    # key from an environment variable is hashed when the config is read.
    keys: Mapping[str, frozenset[str] | None] = attrs.field(
        init=False, default=attrs.Factory(_keys_by_digest, takes_self=True)
    )
    # Digest -> its tenant (tenancy_config): requests without a key are DEFAULT_TENANT's.
    tenant_of: Mapping[str, str] = attrs.field(
        init=False, default=attrs.Factory(_tenants_by_digest, takes_self=True)
    )

    @property
    def required(self) -> bool:
        """Whether clients must send a key (any key is configured)."""
        return bool(self.keys)

    @property
    def api_key_digests(self) -> frozenset[str]:
        return frozenset(self.keys)


@rule_after(AuthSection)
def _each_key_once(section: AuthSection) -> None:
    where: dict[str, str] = {}
    paths = [(d, f"api_keys[{i}]") for i, d in enumerate(section.api_keys)]
    paths += [(e.digest, f"keys[{i}]") for i, e in enumerate(section.entries)]
    for digest, path in paths:
        if digest in where:
            raise Problem(f"is the same key as {where[digest]}: give each key once", path)
        where[digest] = f"auth.{path}"


def _check_tenants(
    auth: AuthSection, book: TenantBook, catalog: Catalog, root: Table, models: bool
) -> None:
    declared = list(book.by_name)
    for i, entry in enumerate(auth.entries):
        if entry.tenant is not None and entry.tenant not in book.by_name:
            hint = closest(entry.tenant, declared)
            root.table("auth").fail(
                f"keys[{i}].tenant",
                f"{entry.tenant!r} is not a [[tenants]] name"
                + (f" (did you mean {hint!r}?)" if hint else ": declare it in [[tenants]]"),
            )
    if not models:
        return
    known = {m.name for m in catalog.models} | catalog.adapters.keys()
    for i, tenant in enumerate(book.tenants):
        for j, limits in enumerate(tenant.models):
            if limits.model not in known:
                where = f"tenants[{i}].models[{j}].model"
                root.fail(where, f"{limits.model!r} is not a model of this config")


def _check_auth_models(auth: AuthSection, catalog: Catalog, t: Table) -> None:
    # A key limited to a LoRA adapter names it as a model: clients call it so.
    known = {m.name for m in catalog.models} | catalog.adapters.keys()
    for i, entry in enumerate(auth.entries):
        for j, name in enumerate(entry.model_names or ()):
            if name not in known:
                t.fail(f"keys[{i}].models[{j}]", f"{name!r} is not a model of this config")


@attrs.frozen
class AdminSection:
    """Who may use the admin API on the control port."""

    # Hex SHA-256 digest of the admin token, None: no token.
    token_digest: str | None = attrs.field(
        default=None, metadata=rules(parse=digest_hook, secret_env="token_env")
    )
    open_status: bool = False  # GET status and explain without a token
    # Cordon/drain without a token (only the no-[admin] default).
    open_writes: bool = attrs.field(default=False, metadata=rules(in_file=False))
    # False when the file has no [admin] section: then the admin API is open (status and
    # actions) when control_listen is a loopback address, and refuses everything otherwise.
    declared: bool = attrs.field(default=True, metadata=rules(in_file=False))
    # Hex SHA-256 digest of the router token: it may only follow the replica sets
    # (`llmgw-server router --control URL`), never read status or act. None: no router may.
    router_token_digest: str | None = attrs.field(
        default=None, metadata=rules(parse=digest_hook, secret_env="router_token_env")
    )


class PolicyBook(Protocol):
    """What reads `[router]`'s balancing policy part: the server's policies, which this
    package never imports (llmgw_server.router.policies.PolicyBook)."""

    def tables(self) -> frozenset[str]:
        """The tables under `[router]` it reads, beside RouterSection's own."""
        ...

    def read(self, table: Table, router: RouterSection) -> RouterSection:
        """`router` with its policy part checked and read from `table` (raises
        ConfigError naming the key)."""
        ...


@attrs.frozen
class Config:
    file: str
    server: ServerSection
    router: RouterSection
    auth: AuthSection
    catalog: Catalog
    control: ControlSection = attrs.field(factory=ControlSection)
    tenants: TenantBook = attrs.field(factory=TenantBook)
    admin: AdminSection = attrs.field(factory=AdminSection)
    agents: AgentsTLS = attrs.field(factory=AgentsTLS)  # TLS for the agent stream
    # False for a router apart, whose models come from the control plane it follows:
    # its file may declare none. Kept so that a reload reads the file by the same rule.
    models_required: bool = True
    # The policies `[router]` was read with (None: its balancing name unchecked, no
    # policy table known). Kept so that a reload reads the file by the same rule.
    policies: PolicyBook | None = None

    @property
    def runs_control_plane(self) -> bool:
        """A control plane runs whenever any model declares a profile."""
        return bool(self.catalog.profiled)


def load_config(
    path: str | Path,
    *,
    environ: Mapping[str, str] | None = None,
    models_required: bool = True,
    policies: PolicyBook | None = None,
) -> Config:
    """Read and validate a config file; raises ConfigError naming file, key path and problem."""
    file = str(path)
    data = load_toml(path)
    return parse_config(
        data, file, environ=environ, models_required=models_required, policies=policies
    )


def parse_config(
    data: dict[str, object],
    file: str,
    *,
    environ: Mapping[str, str] | None = None,
    models_required: bool = True,
    policies: PolicyBook | None = None,
) -> Config:
    """Validate config data; keys named by `env` are read from `environ` (os.environ).

    `policies` reads `[router] balancing` and the policies' own tables (the server's);
    without it the name is any text and no such table is known.

    `models_required=False` is a router apart's file (`llmgw-server router`): its models
    come from the control plane it follows, so it may declare none, and a key's `models`
    may name models the file does not declare.
    """
    root = Table(data, file)
    environ = os.environ if environ is None else environ
    server = read_table(root.table("server"), ServerSection, environ=environ)
    catalog = read_catalog(root, environ)
    router_table = root.table("router")
    if policies is None:
        router = read_table(router_table, RouterSection)
    else:
        theirs = policies.tables()
        mine = [k for k in router_table.data if k not in theirs]
        router = policies.read(router_table, read_table(router_table, RouterSection, keys=mine))
        router_table.finish()
    if router.hold_max_bytes_per_model < server.max_body_bytes:
        router_table.fail(
            "hold_max_bytes_per_model",
            f"must be at least [server] max_body_bytes ({server.max_body_bytes}): a request "
            "the server reads must fit, or it could never wake its model",
        )
    auth_table = root.table("auth")
    auth = read_table(auth_table, AuthSection, environ=environ)
    if models_required:
        _check_auth_models(auth, catalog, auth_table)
    tenants = read_table(root, TenantBook, keys=("tenants",))
    _check_tenants(auth, tenants, catalog, root, models_required)
    control_table = root.table("control")
    control = read_table(control_table, ControlSection)
    if control.store is not None and server.workers > 1:
        # The workers' parent runs its control plane without an election: it would lead
        # beside the elected one.
        control_table.fail(
            "store",
            f"control planes that share a store run with [server] workers = 1 (not "
            f"{server.workers}) for now: put routers apart with workers beside them",
        )
    if root.has("admin"):
        admin = read_table(root.table("admin"), AdminSection, environ=environ)
    else:
        local = is_loopback(server.control_listen.host)
        admin = AdminSection(open_status=local, open_writes=local, declared=False)
    config = Config(
        file=file,
        server=server,
        router=router,
        auth=auth,
        catalog=catalog,
        control=control,
        tenants=tenants,
        admin=admin,
        # Read whenever a control plane runs (it then must say how agents connect; a
        # router apart runs none, whatever its profiles), and whenever present, so that
        # a typo never waits for that day.
        agents=read_agents_tls(root.table("agents"))
        if (catalog.profiled and models_required) or root.has("agents")
        else AgentsTLS(),
        models_required=models_required,
        policies=policies,
    )
    root.known("admin", "agents")  # absent or not, for the "did you mean" of a typo
    root.finish()
    if models_required and not config.catalog.models:
        root.fail("models", "no model is declared: add at least one [[models]] table")
    return config


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
