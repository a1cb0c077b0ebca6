"""The server daemon: one nursery owns the HTTP front, the health prober and shutdown."""

from __future__ import annotations

import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator

import attrs
import httpx
import trio

from llmgw_core.config import Config
from llmgw_http.server import HTTPServer
from llmgw_server.control_shell.controlplane import HEARTBEAT_INTERVAL_S, ControlPlane
from llmgw_server.control_shell.port import ControlListenFailed, serve_control_port
from llmgw_server.reload import reload_on_sighup, router_reloader, with_control_plane
from llmgw_server.route_feed.follower import Follower, local_pair
from llmgw_server.route_feed.hub import RouteHub
from llmgw_server.router.front import Router, server_limits
from llmgw_server.router.health import probe_forever

log = logging.getLogger("llmgw.server")


@attrs.frozen
class Running:
    """What `main` hands to `task_status.started` once it serves."""

    port: int
    router: Router
    http: HTTPServer
    control_port: int | None = None
    plane: ControlPlane | None = None


async def main(
    config: Config,
    *,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop`), then shut down gracefully."""
    s = config.server
    router = Router(config)
    reloader = router_reloader(router)  # SIGHUP and POST /v1/admin/reload
    http = HTTPServer(
        router.handle,
        server_limits(s),
        on_reject=router.rejected,
        check_head=router.check_head,
    )
    listeners = await trio.open_tcp_listeners(s.listen.port, host=s.listen.host)
    port = listeners[0].socket.getsockname()[1]
    timeout = httpx.Timeout(config.router.health_timeout_s)
    plane: ControlPlane | None = None
    control_port = None
    async with httpx.AsyncClient(timeout=timeout) as client, trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            if config.runs_control_plane:
                interval = min(HEARTBEAT_INTERVAL_S, config.control.unreachable_after_s / 3)
                plane = ControlPlane(config, heartbeat_interval_s=interval)
                reloader.apply = with_control_plane(reloader.apply, plane.set_catalog)
                control_port = await serve_control_port(plane, reloader.reload, nursery)
                nursery.start_soon(_follow_in_process, plane.routes, router)
            if router.access_log is not None:
                await nursery.start(router.access_log.run)
            await nursery.start(reload_on_sighup, reloader)
            await nursery.start(http.serve, listeners)
            await nursery.start(probe_forever, router, client)
            log.info("llmgw router listening on http://%s:%d", s.listen.host, port)
            task_status.started(
                Running(port=port, router=router, http=http, control_port=control_port, plane=plane)
            )
            stop = trio.Event() if stop is None else stop
            async with trio.open_nursery() as waiters:
                waiters.start_soon(_first_signal, signals, stop)
                await stop.wait()
                waiters.cancel_scope.cancel()
        log.info("shutting down: no new connections; waiting up to %s s", s.shutdown_grace_s)
        router.draining = True
        if plane is not None:
            plane.closing = True
        if not await http.shutdown(s.shutdown_grace_s):
            log.warning("requests still in flight after %s s: cancelling them", s.shutdown_grace_s)
        nursery.cancel_scope.cancel()
    for pool in router.pools.values():
        pool.close()
    log.info("stopped")


async def _follow_in_process(routes: RouteHub, router: Router) -> None:
    """This process's router follows the route table like any other, over memory channels."""
    hub_end, router_end = local_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(routes.serve, hub_end, "this process")
        await Follower(router, "in-process").follow(router_end)


async def _first_signal(signals: AsyncIterator[int], stop: trio.Event) -> None:
    async for signum in signals:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()
        return


def _raise_open_file_limit() -> None:
    """Every client stream and every agent holds a descriptor: take all the kernel allows."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


# Start-up's objects (modules, the config, the catalog) never become garbage: frozen,
# no collection scans them again. A young generation of 50,000 objects instead of 700:
# with thousands of agent streams, the collector ran every few messages and took 42-48 %
# of the server's CPU in a registration storm, full collections up to 1.2 s (issue 17).
GC_THRESHOLDS = (50_000, 20, 10)


def _tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(config: Config) -> int:
    _raise_open_file_limit()
    _tune_gc()
    failed: BaseException | None = None
    try:
        try:
            if config.server.workers > 1:
                from llmgw_server.router import workers

                trio.run(workers.main, config)
            else:
                trio.run(main, config)
        except* ControlListenFailed as group:  # opened inside a nursery: in a group
            failed = group
            while isinstance(failed, BaseExceptionGroup):
                failed = failed.exceptions[0]
    except OSError as exc:
        print(f"llmgw-server: cannot listen on {config.server.listen}: {exc}", file=sys.stderr)
        return 1
    if failed is not None:
        print(f"llmgw-server: {failed}", file=sys.stderr)
        return 1
    return 0
