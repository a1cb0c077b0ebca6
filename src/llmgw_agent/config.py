"""The agent's config file, read through the same `Table` as the server's."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlsplit

import attrs

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


def parse_agent_config(data: dict[str, object], file: str) -> AgentConfig:
    """Relative paths are taken from the working directory, as in `conf/` examples."""
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
    insecure = t.boolean("insecure", False)
    if parts.scheme == "ws" and not insecure:
        t.fail(
            "server",
            f"{server!r} is plaintext: use wss:// with [tls], or set insecure = true "
            "where the network is trusted",
        )
    tls = read_agent_tls(t.table("tls"), secure=parts.scheme == "wss")
    inventory = t.text("inventory_file", None)
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
        engines[kind] = EngineCommand(tuple(command), table.labels("env", {}))
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
        state_dir=Path(t.text("state_dir", "/var/lib/llmgw-agent")),
        advertise_host=t.text("advertise_host", "127.0.0.1"),
        bind_host=t.text("bind_host", "0.0.0.0"),
        labels=t.labels("labels", {}),
        fabric=t.labels("fabric", {}),
        inventory_file=Path(inventory) if inventory else None,
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
