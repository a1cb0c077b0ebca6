"""The agent's config file, read through the same `Table` as the server's."""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import attrs

from llmgw_core.config import is_loopback
from llmgw_core.tls_config import AgentTLS, read_agent_tls
from llmgw_core.tomlshape import Table, load_toml

ENGINE_KINDS = ("vllm", "sglang", "llamacpp", "mock")

DEFAULT_COMMANDS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sglang": ("python3", "-m", "sglang.launch_server"),
    "llamacpp": ("llama-server",),
    "mock": (sys.executable, "-m", "llmgw_core.mock_engine"),
}


@attrs.frozen
class EngineCommand:
    command: tuple[str, ...]
    env: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class AgentConfig:
    file: str
    name: str
    server: str  # ws:// or wss:// URL of the control plane's agent stream
    state_dir: Path
    advertise_host: str  # how the router and other nodes reach engines on this node
    bind_host: str  # the address engines listen on
    labels: dict[str, str]
    fabric: dict[str, str]
    inventory_file: Path | None
    engines: dict[str, EngineCommand]
    port_min: int = 20000
    port_max: int = 20999
    tls: AgentTLS = attrs.field(factory=AgentTLS)
    insecure: bool = False  # a plaintext ws:// server, said explicitly
    reconnect_base_s: float = 0.5
    reconnect_cap_s: float = 30.0
    stop_grace_s: float = 30.0
    start_timeout_s: float = 1800.0


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


def _advertise_host(t: Table, server_host: str) -> str:
    """Where the router reaches this node's engines. 127.0.0.1 only goes without saying
    when the control plane (and its router) is on this machine too: on a real node a
    loopback address would send every request to the router's own machine."""
    server_is_local = is_loopback(server_host)
    if not t.has("advertise_host"):
        if server_is_local:
            return "127.0.0.1"
        t.fail(
            "advertise_host",
            "is required: the address or DNS name of this node that the router and this "
            "agent reach its engines at (the control plane is on another machine)",
        )
    host: str = t.text("advertise_host")
    if not is_host(host):
        t.fail(
            "advertise_host",
            f"{host!r} is not a host name or IP address: give this node's address "
            "that the router reaches its engines at",
        )
    if is_loopback(host) and not server_is_local:
        t.fail(
            "advertise_host",
            f"{host!r} is a loopback address, but the control plane is at {server_host}: "
            "its router could not reach this node's engines there; give this node's address",
        )
    return host


def _program(base_dir: Path, command: tuple[str, ...]) -> tuple[str, ...]:
    """A program given as a relative path (`bin/llama-server`) is taken from the config
    file's directory; a bare name (`vllm`) is looked up on PATH when the engine starts."""
    program = os.path.expanduser(command[0])
    if "/" in program and not program.startswith("/"):
        program = str(base_dir / program)
    return (program, *command[1:])


def parse_agent_config(data: dict[str, object], file: str) -> AgentConfig:
    """Relative paths (state_dir, inventory_file, [tls] files, an engine program given as
    a path) are taken from the config file's directory, not the working directory."""
    t = Table(data, file)
    name = t.text("name")
    server = t.text("server")
    try:
        parts = urlsplit(server)
        hostname = parts.hostname
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        t.fail("server", f"{server!r} is not a valid URL: {exc}")
    if parts.scheme not in ("ws", "wss") or not hostname:
        t.fail(
            "server",
            f"{server!r} must be a ws:// or wss:// URL, such as ws://10.0.0.1:8081/v1/agent",
        )
    if not is_host(hostname):
        t.fail("server", f"{server!r}: {hostname!r} is not a host name or IP address")
    insecure = t.boolean("insecure", False)
    if parts.scheme == "ws" and not insecure:
        t.fail(
            "server",
            f"{server!r} is plaintext: use wss:// with [tls], or set insecure = true "
            "where the network is trusted",
        )
    if parts.scheme == "ws" and t.has("tls"):
        # Refused rather than ignored: a [tls] left in says the operator meant TLS.
        t.fail(
            "tls",
            f"is for a wss:// server, but {server!r} is plaintext (insecure = true): "
            "remove [tls], or use wss:// and drop insecure",
        )
    tls = read_agent_tls(t.table("tls"), secure=parts.scheme == "wss")
    inventory: Path | None = t.file_path("inventory_file", None)
    engines: dict[str, EngineCommand] = {
        kind: EngineCommand(command) for kind, command in DEFAULT_COMMANDS.items()
    }
    section = t.table("engines")
    for kind in section.key_names():
        if kind not in ENGINE_KINDS:
            section.fail(kind, f"is not an engine llmgw knows (one of {', '.join(ENGINE_KINDS)})")
        table = section.table(kind)
        command = table.texts("command", DEFAULT_COMMANDS[kind])
        if not command:
            table.fail("command", "must name the program to run")
        engines[kind] = EngineCommand(_program(t.base_dir, command), table.labels("env", {}))
        table.finish()
    section.finish()
    ports = t.table("ports")
    port_min = ports.integer("min", 20000, min=1024)
    port_max = ports.integer("max", 20999, min=port_min)
    ports.finish()
    reconnect = t.table("reconnect")
    base_s = reconnect.number("base_s", 0.5, min=0.01)
    cap_s = reconnect.number("cap_s", 30.0, min=base_s)
    reconnect.finish()
    config = AgentConfig(
        file=file,
        name=name,
        server=server,
        state_dir=t.file_path("state_dir", Path("/var/lib/llmgw-agent")),
        advertise_host=_advertise_host(t, hostname),
        bind_host=t.text("bind_host", "0.0.0.0"),
        labels=t.labels("labels", {}),
        fabric=t.labels("fabric", {}),
        inventory_file=inventory,
        engines=engines,
        port_min=port_min,
        port_max=port_max,
        tls=tls,
        insecure=insecure,
        reconnect_base_s=base_s,
        reconnect_cap_s=cap_s,
        stop_grace_s=t.number("stop_grace_s", 30.0, min=0),
        start_timeout_s=t.number("start_timeout_s", 1800.0, min=0.1),
    )
    t.finish()
    return config
