"""The control port: the admin API, the agents' streams and the routers' feed, served
for a control plane (by the single process, or by the workers' parent)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from llmgw_core.config import Config
from llmgw_core.tls_config import server_context
from llmgw_http.server import Handler, HTTPServer, ServerLimits, UpgradeHandler
from llmgw_server.control_shell.admin import AdminAPI
from llmgw_server.control_shell.controlplane import ControlPlane
from llmgw_server.control_shell.cross_site import ControlPortGate, port_names
from llmgw_server.reload import ReloadPlan

log = logging.getLogger("llmgw.server")


class ControlListenFailed(Exception):
    """The control port cannot be opened: one line for the operator, no traceback."""


async def serve_control_port(
    plane: ControlPlane,
    reload: Callable[[], Awaitable[ReloadPlan]] | None,
    nursery: trio.Nursery,
) -> int:
    """Start the control plane and its port in `nursery`; the port it listens on."""
    listeners = await open_control_listeners(plane.config)
    await nursery.start(plane.run)
    handlers = AdminAPI(plane, reload=reload).handle, plane.serve_upgrade
    return await serve_control_listeners(plane.config, listeners, *handlers, nursery=nursery)


async def open_control_listeners(config: Config) -> list[trio.SocketListener]:
    """The control port's sockets (`control_listen`). Raises ControlListenFailed."""
    s = config.server
    try:
        return await trio.open_tcp_listeners(s.control_listen.port, host=s.control_listen.host)
    except OSError as exc:
        raise ControlListenFailed(
            f"cannot listen on {s.control_listen} (control_listen): {exc}"
        ) from exc


async def serve_control_listeners(
    config: Config,
    listeners: list[trio.SocketListener],
    handle: Handler,
    upgrade: UpgradeHandler,
    *,
    nursery: trio.Nursery,
    leader_for_agents: Callable[[int | None, str], Awaitable[bytes | None]] | None = None,
) -> int:
    """Serve the control port on `listeners` in `nursery`: every request and upgrade
    passes the gate, then goes to `handle` or `upgrade`; the port it listens on. With
    `leader_for_agents` (a control plane's among several), an agent's hello is answered
    with the line it returns, before any TLS (agent_lane: the leader's URL, or when to
    come back), given the epoch the agent says it lost and the address it came from (the
    gate's source_key); it may wait for an election."""
    s, tls = config.server, config.agents
    if tls.insecure:
        log.warning(
            "[agents] insecure = true: the agent stream is plaintext and anyone who "
            "reaches %s can register as a node or receive its commands",
            s.control_listen,
        )
    # Every request and upgrade on the port passes the gate first (cross_site).
    gate = ControlPortGate(port_names(s, tls), handle, upgrade)
    control = HTTPServer(
        gate.handle,
        ServerLimits(),
        upgrade=gate.upgrade,
        ssl_context=None if tls.insecure else server_context(tls),
    )
    control.tls_admission.redirect = leader_for_agents
    port: int = listeners[0].socket.getsockname()[1]
    await nursery.start(control.serve, listeners)
    host = s.control_listen.host
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    log.info(
        "control plane listening on %s (agents: %s://%s/v1/agent, admin: %s://%s)",
        where,
        "ws" if tls.insecure else "wss",
        where,
        "http" if tls.insecure else "https",
        where,
    )
    names = gate.names
    log.info(
        "the control port answers to Host: %s",
        ", ".join(sorted(names.names | names.aliases) + [f"*{w}" for w in names.wildcards]),
    )
    return port
