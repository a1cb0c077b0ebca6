"""The agent's config file, declared once as `AgentConfig` and read by the same
`config_schema.structure` as the server's."""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from urllib.parse import SplitResult, urlsplit

import attrs
import cattrs.errors

from llmgw_core.config import is_loopback
from llmgw_core.config_schema import (
    CONVERTER,
    Problem,
    read_path,
    read_text,
    read_texts,
    reading_base_dir,
    rule_after,
    rule_before,
    rules,
    structure,
)
from llmgw_core.engines import ENGINE_KINDS
from llmgw_core.tls_config import AgentTLS, require_agent_tls
from llmgw_core.tomlshape import load_toml, type_name

DEFAULT_COMMANDS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sglang": ("python3", "-m", "sglang.launch_server"),
    "llamacpp": ("llama-server",),
    "mock": (sys.executable, "-m", "llmgw_mock_engine"),
}


def _command(command: tuple[str, ...]) -> tuple[str, ...]:
    if not command:
        raise Problem("must name the program to run")
    return command


@attrs.frozen
class EngineCommand:
    """`[engines.<kind>]`: how this node runs an engine; () is the kind's default command."""

    command: tuple[str, ...] = attrs.field(default=(), metadata=rules(check=_command))
    env: dict[str, str] = attrs.field(factory=dict)


def _engines(value: object) -> dict[str, EngineCommand]:
    """Every kind, with its default command where the file gives none. A program given
    as a relative path (`bin/llama-server`) is taken from the config file's directory; a
    bare name (`vllm`) is looked up on PATH when the engine starts."""
    if not isinstance(value, dict):
        raise Problem(f"must be a table, not {type_name(value)}")
    engines = {kind: EngineCommand(command) for kind, command in DEFAULT_COMMANDS.items()}
    for kind, table in value.items():
        if kind not in ENGINE_KINDS:
            raise Problem(f"is not an engine llmgw knows (one of {', '.join(ENGINE_KINDS)})", kind)
        try:
            given = CONVERTER.structure(table, EngineCommand)
        except Exception as exc:
            note = cattrs.errors.AttributeValidationNote(f"engine {kind}", kind, EngineCommand)
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]
            raise
        command = given.command or DEFAULT_COMMANDS[kind]
        engines[kind] = EngineCommand(_program(reading_base_dir(), command), given.env)
    return engines


def _server_url(server: str) -> str:
    try:
        parts = urlsplit(server)
        hostname = parts.hostname
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        raise Problem(f"{server!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("ws", "wss") or not hostname:
        raise Problem(
            f"{server!r} must be a ws:// or wss:// URL, such as ws://10.0.0.1:8081/v1/agent"
        )
    if not is_host(hostname):
        raise Problem(f"{server!r}: {hostname!r} is not a host name or IP address")
    return server


def _servers(value: object) -> tuple[str, ...]:
    """`server`: one control plane's URL, or a list of them (the control planes of a fleet
    kept in a store, any of which may lead): one scheme for all, as one [tls] (or
    `insecure`) serves them all."""
    if not isinstance(value, list):
        if not isinstance(value, str):
            raise Problem(f"must be a URL or an array of URLs, not {type_name(value)}")
        return (_server_url(read_text(value)),)
    urls = read_texts(value)
    if not urls:
        raise Problem("must name at least one control plane's ws:// or wss:// URL")
    for i, url in enumerate(urls):
        try:
            _server_url(url)
        except Problem as problem:
            raise Problem(problem.message, f"[{i}]") from None
        if url in urls[:i]:
            raise Problem(f"{url!r} is listed twice", f"[{i}]")
        if urlsplit(url).scheme != urlsplit(urls[0]).scheme:
            raise Problem(
                f"{url!r} and {urls[0]!r}: give every control plane the same scheme "
                "(all wss:// with [tls], or all ws:// with insecure = true)",
                f"[{i}]",
            )
    return urls


def _server_parts(server: object) -> SplitResult | None:
    """The (first) server URL's parts, None for a value that is not valid (its field says
    why)."""
    try:
        return urlsplit(_servers(server)[0])
    except Problem:
        return None


def _local_advertise_host(config: AgentConfig) -> str:
    """127.0.0.1 only goes without saying when the control planes (and their routers) are
    on this machine too: on a real node a loopback address would send every request to the
    router's own machine. Empty: the file must say (see `_agent_rules`)."""
    local = all(is_loopback(urlsplit(url).hostname or "") for url in config.servers)
    return "127.0.0.1" if local else ""


def _a_host(host: str) -> str:
    if not is_host(host):
        raise Problem(
            f"{host!r} is not a host name or IP address: give this node's address "
            "that the router reaches its engines at"
        )
    return host


def _a_bind_host(host: str) -> str:
    if not is_host(host):
        raise Problem(
            f"{host!r} is not a host name or IP address: give the address engines listen "
            'on (by default advertise_host; "0.0.0.0" for every interface)'
        )
    return host


def _inventory_file(value: object) -> Path:
    """Checked with the config, not when the node is probed: a missing file is an error of
    this key, said as written and as resolved (a relative path is taken from the config's
    directory, which is easily taken for the working directory). What the file says is
    `read_simulated`'s to check, naming that file."""
    path = read_path(value)
    if not path.is_file():
        resolved = "" if str(value) == str(path) else f" (resolved to {path})"
        problem = "is not a file" if path.exists() else "no such file"
        raise Problem(f"{value}: {problem}{resolved}")
    return path


@attrs.frozen
class AgentConfig:
    """Relative paths (state_dir, inventory_file, [tls] files, an engine program given as
    a path) are taken from the config file's directory, not the working directory."""

    name: str
    # ws:// or wss:// URL of the control plane's agent stream (`server` in the file), or
    # the URLs of every control plane of a fleet kept in a store: the agent registers
    # with whichever leads, and follows only a leader named among these.
    servers: tuple[str, ...] = attrs.field(metadata=rules(key="server", parse=_servers))
    insecure: bool = False  # a plaintext ws:// server, said explicitly
    tls: AgentTLS = attrs.field(factory=AgentTLS)
    inventory_file: Path | None = attrs.field(default=None, metadata=rules(parse=_inventory_file))
    engines: dict[str, EngineCommand] = attrs.field(
        factory=lambda: {kind: EngineCommand(c) for kind, c in DEFAULT_COMMANDS.items()},
        metadata=rules(parse=_engines),
    )
    port_min: int = attrs.field(default=20000, metadata=rules(key="ports.min", min=1024))
    port_max: int = attrs.field(default=20999, metadata=rules(key="ports.max", min=1024))
    # Full jitter between 0 and base * 2^failures (at most cap): a fleet refused by a busy
    # control plane comes back at no more than N / (2 * base) a second, then slower.
    reconnect_base_s: float = attrs.field(
        default=2.0, metadata=rules(key="reconnect.base_s", min=0.01)
    )
    reconnect_cap_s: float = attrs.field(
        default=60.0, metadata=rules(key="reconnect.cap_s", min=0.01)
    )
    state_dir: Path = Path("/var/lib/llmgw-agent")
    # How the router and other nodes reach engines on this node.
    advertise_host: str = attrs.field(
        default=attrs.Factory(_local_advertise_host, takes_self=True),
        metadata=rules(check=_a_host),
    )
    # The address engines listen on: by default the advertised one, which the routers
    # reach them at, so that an engine's unkeyed paths (/health, /metrics, /tokenize) are
    # not open on every interface; "0.0.0.0" (or "::") says so. A host name is passed to
    # the engine as given, which resolves it as the routers do.
    bind_host: str = attrs.field(
        default=attrs.Factory(lambda config: config.advertise_host, takes_self=True),
        metadata=rules(check=_a_bind_host),
    )
    labels: dict[str, str] = attrs.field(factory=dict)
    fabric: dict[str, str] = attrs.field(factory=dict)
    stop_grace_s: float = attrs.field(default=30.0, metadata=rules(min=0))
    start_timeout_s: float = attrs.field(default=1800.0, metadata=rules(min=0.1))
    # The config file, for messages; set by the reader, never by the file.
    file: str = attrs.field(default="", kw_only=True, metadata=rules(in_file=False))

    @property
    def server(self) -> str:
        """The first control plane's URL: the one dialled first."""
        return self.servers[0]


@rule_before(AgentConfig)
def _plaintext_said(data: dict[str, object]) -> None:
    """Checked first, as the server URL is what the rest is read against."""
    parts = _server_parts(data.get("server"))
    insecure = data.get("insecure", False)
    if parts is None or parts.scheme != "ws" or not isinstance(insecure, bool):
        return  # a bad server URL or insecure value is reported by its field
    server = ", ".join(map(repr, _servers(data["server"])))
    if not insecure:
        raise Problem(
            f"{server} is plaintext: use wss:// with [tls], or set insecure = true "
            "where the network is trusted",
            "server",
        )
    if "tls" in data:
        # Refused rather than ignored: a [tls] left in says the operator meant TLS.
        raise Problem(
            f"is for a wss:// server, but {server} is plaintext (insecure = true): "
            "remove [tls], or use wss:// and drop insecure",
            "tls",
        )


@rule_after(AgentConfig)
def _agent_rules(config: AgentConfig) -> None:
    parts = urlsplit(config.server)
    if parts.scheme == "wss":
        try:
            require_agent_tls(config.tls)
        except Problem as problem:
            raise Problem(problem.message, f"tls.{problem.key}") from None
    if config.port_max < config.port_min:
        raise Problem(f"must be at least {config.port_min}, not {config.port_max}", "ports.max")
    if config.reconnect_cap_s < config.reconnect_base_s:
        raise Problem(
            f"must be at least {config.reconnect_base_s}, not {config.reconnect_cap_s}",
            "reconnect.cap_s",
        )
    if not config.advertise_host:
        raise Problem(
            "is required: the address or DNS name of this node that the router and this "
            "agent reach its engines at (the control plane is on another machine)",
            "advertise_host",
        )
    remote = [urlsplit(url).hostname or "" for url in config.servers]
    remote = [host for host in remote if not is_loopback(host)]
    if is_loopback(config.advertise_host) and remote:
        raise Problem(
            f"{config.advertise_host!r} is a loopback address, but the control plane is at "
            f"{remote[0]}: its router could not reach this node's engines there; "
            "give this node's address",
            "advertise_host",
        )


def load_agent_config(path: str | Path) -> AgentConfig:
    file = str(path)
    data = load_toml(path)
    return parse_agent_config(data, file)


_HOST_NAME = re.compile(
    r"^(?=.{1,253}\.?$)[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
    r"(?:\.[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?)*\.?$",
    re.IGNORECASE,
)


def is_host(text: str) -> bool:
    """A DNS name or an IP address (what a URL's host may be, brackets aside)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return bool(_HOST_NAME.match(text))
    return True


def _program(base_dir: Path, command: tuple[str, ...]) -> tuple[str, ...]:
    program = os.path.expanduser(command[0])
    if "/" in program and not program.startswith("/"):
        program = str(base_dir / program)
    return (program, *command[1:])


def parse_agent_config(data: dict[str, object], file: str) -> AgentConfig:
    """Read an agent's config data; raises ConfigError naming file, key path and problem."""
    return attrs.evolve(structure(data, AgentConfig, file=file), file=file)
