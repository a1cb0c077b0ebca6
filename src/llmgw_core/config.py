"""The server's config file: `[server]`, `[router]`, `[auth]` and the catalog."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from llmgw_core.catalog import Catalog, read_catalog
from llmgw_core.control_config import ControlSection, read_control
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


@attrs.frozen
class RouterSection:
    retries: int = 2  # further attempts on other replicas before the first byte
    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 600.0
    eject_after_failures: int = 3  # consecutive failures that eject a replica
    eject_cooldown_s: float = 10.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    session_header: str = "x-session-id"


@attrs.frozen
class AuthSection:
    api_key_digests: frozenset[str] = frozenset()  # hex SHA-256 digests, without the prefix


@attrs.frozen
class Config:
    file: str
    server: ServerSection
    router: RouterSection
    auth: AuthSection
    catalog: Catalog
    control: ControlSection = attrs.field(factory=ControlSection)

    @property
    def runs_control_plane(self) -> bool:
        """A control plane runs whenever any model declares a profile."""
        return bool(self.catalog.profiled)


def load_config(path: str | Path) -> Config:
    """Read and validate a config file; raises ConfigError naming file, key path and problem."""
    file = str(path)
    data = load_toml(path)
    return parse_config(data, file)


def parse_config(data: dict[str, object], file: str) -> Config:
    root = Table(data, file)
    config = Config(
        file=file,
        server=_read_server(root.table("server")),
        router=_read_router(root.table("router")),
        auth=_read_auth(root.table("auth")),
        catalog=read_catalog(root),
        control=read_control(root.table("control")),
    )
    root.finish()
    if not config.catalog.models:
        root.fail("models", "no model is declared: add at least one [[models]] table")
    return config


def _read_server(t: Table) -> ServerSection:
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
    )
    t.finish()
    return section


def _read_router(t: Table) -> RouterSection:
    d = RouterSection()
    section = RouterSection(
        retries=t.integer("retries", d.retries, min=0),
        connect_timeout_s=t.number("connect_timeout_s", d.connect_timeout_s, min=0.01),
        first_byte_timeout_s=t.number("first_byte_timeout_s", d.first_byte_timeout_s, min=0.1),
        eject_after_failures=t.integer("eject_after_failures", d.eject_after_failures, min=1),
        eject_cooldown_s=t.number("eject_cooldown_s", d.eject_cooldown_s, min=0.01),
        health_interval_s=t.number("health_interval_s", d.health_interval_s, min=0.01),
        health_timeout_s=t.number("health_timeout_s", d.health_timeout_s, min=0.01),
        session_header=t.text("session_header", d.session_header).lower(),
    )
    t.finish()
    return section


def _read_auth(t: Table) -> AuthSection:
    digests: set[str] = set()
    for i, text in enumerate(t.texts("api_keys", ())):
        if not _DIGEST.match(text):
            t.fail(
                f"api_keys[{i}]",
                "must be 'sha256:' and 64 lowercase hex digits "
                "(make one with: python -m llmgw_server hash-key)",
            )
        digests.add(text.removeprefix("sha256:"))
    t.finish()
    return AuthSection(api_key_digests=frozenset(digests))
