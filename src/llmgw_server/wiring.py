"""How each llmgw server process is wired: the one place that starts, owns and stops
what a process runs.

Four layouts, over one router service (`serve_router`: the HTTP front, the access log,
health probes, SIGHUP, the signal waiter and the graceful shutdown, written once):

- **single process** (`main`): a router whose route table comes from this process's
  own control plane (when the config has one) over memory channels; this process
  reloads on SIGHUP and owns the control plane and its port.
- **a router apart** (`router_apart_main`): a router whose table comes from a control
  plane across the network (route_feed.remote); it reloads on SIGHUP; it is ready once
  a complete table came and its replicas were probed.
- **a worker** (`serve_worker`, `python -m llmgw_server.wiring`): a router whose config
  and table come from its parent over a socketpair (router.worker); SIGHUP is the
  parent's business.
- **the workers' parent** (`workers_main`): serves no request; it starts and feeds the
  workers (router.workers), reloads on SIGHUP, and owns the control plane (a single
  process's, with workers) or follows one across the network for them (a router apart
  with workers, through route_feed.relay).

Nothing below this module builds a control plane: the router never imports it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import httpx
import trio

from llmgw_core.config import Config
from llmgw_http.server import HTTPServer
from llmgw_http.socket_activation import open_listeners
from llmgw_server.reload import Apply, Reloader, reload_on_sighup, with_control_plane
from llmgw_server.route_feed.follower import Follower
from llmgw_server.router.front import Router, server_limits
from llmgw_server.router.health import probe_forever, probe_once_followed
from llmgw_server.router.large_buffers import return_large_buffers
from llmgw_server.router.worker import CONFIG, READY, Worker, channel_from_fd, decode_config
from llmgw_server.router.workers import Workers

if TYPE_CHECKING:
    from llmgw_core.dial import Target
    from llmgw_server.control_shell.controlplane import ControlPlane
    from llmgw_server.control_shell.seat import Seat
    from llmgw_server.route_feed.hub import RouteHub
    from llmgw_server.route_feed.relay import TableRelay

log = logging.getLogger("llmgw.server")

# -- what every process does the same way -------------------------------------------------

# Start-up's objects (modules, the config, the catalog) never become garbage: frozen,
# no collection scans them again. A young generation of 50,000 objects instead of 700:
# with thousands of agent streams, the collector ran every few messages and took 42-48 %
# of the server's CPU in a registration storm, full collections up to 1.2 s (issue 17).
GC_THRESHOLDS = (50_000, 20, 10)


def _tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _raise_open_file_limit() -> None:
    """Every client stream and every agent holds a descriptor: take all the kernel allows."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


async def _until_stopped(signals: AsyncIterator[int], stop: trio.Event) -> None:
    """Until the first SIGINT/SIGTERM (received on `signals`), or `stop` is set."""

    async def first_signal() -> None:
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            stop.set()
            return

    async with trio.open_nursery() as waiters:
        waiters.start_soon(first_signal)
        await stop.wait()
        waiters.cancel_scope.cancel()


async def _listeners(config: Config) -> list[trio.SocketListener]:
    """The router's listening sockets: systemd's, kept open across a restart (socket
    activation: conf/systemd/llmgw-server.socket), else `[server] listen` bound here."""
    listen = config.server.listen
    listeners, inherited = await open_listeners(listen.host, listen.port)
    if inherited:
        where = ", ".join(str(listener.socket.getsockname()[:2]) for listener in listeners)
        log.info(
            "serving on %d sockets from systemd (socket activation): %s", len(listeners), where
        )
    return listeners


async def _sighup_reloads_elsewhere(
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """A worker's SIGHUP: the parent reloads every worker; this one says so."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            log.warning("SIGHUP reloads through the parent (pid %d): ignored here", os.getppid())


# The control plane is imported only where one runs: a router apart, a worker and a
# server with static models alone start without its modules (test_router_apart). So is
# the route feed's hub and its websockets (trio_websocket, wsproto: 0.1 s of CPU at each
# start), which only a control plane, a router apart and the workers' parent use.


def _control_plane(config: Config) -> ControlPlane | None:
    """This process's control plane, when the config places models."""
    if not config.runs_control_plane:
        return None
    from llmgw_server.control_shell.controlplane import HEARTBEAT_INTERVAL_S, ControlPlane

    interval = min(HEARTBEAT_INTERVAL_S, config.control.unreachable_after_s / 3)
    return ControlPlane(config, heartbeat_interval_s=interval)


async def _serve_control_port(
    plane: ControlPlane, reloader: Reloader, nursery: trio.Nursery
) -> int:
    """Start the control plane and its port (admin API, agents, route feed) in `nursery`;
    the port it listens on. Raises ControlListenFailed."""
    from llmgw_server.control_shell.port import serve_control_port

    return await serve_control_port(plane, reloader.reload, nursery)


def _router_reloader(router: Router) -> Reloader:
    """A Reloader for the one Router of this process (`Router.reload`)."""

    async def apply(config: Config, plan: object) -> None:
        router.reload(config)

    return Reloader(router.config, apply)


# -- the router service: what differs is a Layout -------------------------------------------


class Layout(Protocol):
    """What one kind of router process adds to the router service."""

    def listening(self) -> str | None:
        """How the log's "listening" line ends (what the table follows); None: no line."""
        ...

    async def start(self, nursery: trio.Nursery, router: Router) -> Follower | None:
        """Start where the route table comes from (and what else this process owns) in
        `nursery`; the follower whose first complete table readiness waits for, or None
        (then readiness is the first health round)."""
        ...

    def closing(self) -> None:
        """Shutdown began."""
        ...

    async def drained(self) -> None:
        """Requests in flight have ended (or the grace passed): the process exits next."""
        ...


async def serve_router(
    router: Router,
    listeners: Sequence[trio.SocketListener],
    layout: Layout,
    *,
    sighup: Reloader | None,
    stop: trio.Event,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `router` on `listeners` until SIGINT/SIGTERM or `stop`, then shut down
    gracefully; `started()` with the HTTP server once it serves. `sighup`: the reloader
    SIGHUP runs, or None where another process reloads."""
    s = router.config.server
    http = HTTPServer(
        router.handle,
        server_limits(s),
        on_reject=router.rejected,
        check_head=router.check_head,
    )
    timeout = httpx.Timeout(router.config.router.health_timeout_s)
    # Engines are reached over plain HTTP alone (the catalog refuses any other scheme):
    # the probes' client has no certificate to verify, and loads no CA bundle (0.05 to
    # 0.2 s of CPU at each start).
    probes = httpx.AsyncClient(timeout=timeout, verify=False)
    try:
        async with probes as client, trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                followed = await layout.start(nursery, router)
                if sighup is None:
                    await nursery.start(_sighup_reloads_elsewhere)
                else:
                    await nursery.start(reload_on_sighup, sighup)
                if router.access_log is not None:
                    await nursery.start(router.access_log.run)
                router.served.hold_at_start()
                nursery.start_soon(_end_start_hold, router)
                await nursery.start(http.serve, listeners)
                feed = router.needs.feed()
                if feed is not None:
                    # The policy's own, as its module declares it (precise: what the
                    # engines hold, from their KV-cache events; pyzmq is imported by
                    # such a router alone).
                    await nursery.start(feed, router.needs.shared, router.served.endpoints)
                if followed is None:
                    await nursery.start(probe_forever, router, client)
                else:
                    nursery.start_soon(probe_once_followed, followed, router, client)
                listening = layout.listening()
                if listening is not None:
                    log.info("llmgw router listening on %s", listening)
                task_status.started(http)
                await _until_stopped(signals, stop)
            await _shut_down(router, http, layout)
            nursery.cancel_scope.cancel()
    finally:
        # The HTTP server closes them once its connections end, unless cancelled first:
        # they are this service's, closed whatever happened.
        for listener in listeners:
            listener.socket.close()
    for pool in router.served.pools.values():
        pool.close()
    log.info("stopped")


# How long a started router holds the requests of a model the control plane places while
# none of its replicas is known (Router.hold_at_start), rather than answer 503: across a
# restart the agents are back within a second of the control port's start (their redial
# jitter, RESTART_JITTER_S, and a registration), so this is ample; on a fleet's first
# start, a request for a model whose engines are still loading waits this long before
# its 503.
STARTUP_HOLD_S = 10.0


async def _end_start_hold(router: Router) -> None:
    await trio.sleep(STARTUP_HOLD_S)
    router.served.end_start_hold()


async def _shut_down(router: Router, http: HTTPServer, layout: Layout) -> None:
    """No new connections; requests in flight finish within the grace (then the caller
    cancels what is left)."""
    grace_s = router.config.server.shutdown_grace_s
    log.info("shutting down: no new connections; waiting up to %s s", grace_s)
    router.start_draining()
    layout.closing()
    if not await http.shutdown(grace_s):
        log.warning("requests still in flight after %s s: cancelling them", grace_s)
    await layout.drained()


# How long a stopping control plane waits for its agent streams' close frames to go out.
STREAMS_CLOSE_S = 1.0


async def _stop_agent_streams(plane: ControlPlane) -> None:
    """Tell every agent that this control plane stops (a restart), so that each dials
    the next one after a small jitter, not after its backoff (AgentService.stop_streams)."""
    plane.agents.stop_streams()
    with trio.move_on_after(STREAMS_CLOSE_S):
        await plane.agents.streams_closed.wait()


def _http_address(config: Config, port: int) -> str:
    return f"http://{config.server.listen.host}:{port}"


# -- single process -------------------------------------------------------------------------


@attrs.frozen
class Running:
    """What `main` hands to `task_status.started` once it serves."""

    port: int
    router: Router
    http: HTTPServer
    control_port: int | None = None
    plane: ControlPlane | None = None
    seat: Seat | None = None  # control planes that share a store: this one's seat


@attrs.define
class _SingleProcess:
    """The table comes from this process's own control plane, when there is one."""

    config: Config
    port: int
    reloader: Reloader
    plane: ControlPlane | None = None
    control_port: int | None = None
    seat: Seat | None = None

    def listening(self) -> str:
        return _http_address(self.config, self.port)

    async def start(self, nursery: trio.Nursery, router: Router) -> Follower | None:
        if self.config.runs_control_plane and self.config.control.store is not None:
            await self._take_seat(nursery, router)
            return None
        self.plane = _control_plane(self.config)
        if self.plane is not None:
            plane = self.plane
            self.reloader.apply = with_control_plane(self.reloader.apply, plane.set_catalog)
            self.control_port = await _serve_control_port(plane, self.reloader, nursery)
            nursery.start_soon(_follow_in_process, plane.routes, router)
        return None

    async def _take_seat(self, nursery: trio.Nursery, router: Router) -> None:
        """Control planes share a store: this one leads or stands by, as elected."""
        from llmgw_server.control_shell.seat import Seat

        seat = self.seat = Seat(self.config, self.reloader.reload)
        self.reloader.apply = with_control_plane(self.reloader.apply, seat.set_catalog)
        self.control_port = await nursery.start(seat.run)
        nursery.start_soon(_follow_leader, seat, router)

    def closing(self) -> None:
        if self.seat is not None:
            self.seat.resign_soon()  # the next leader takes over now, not at the lease's end
        if self.plane is not None:
            self.plane.closing = True

    async def drained(self) -> None:
        if self.plane is not None:
            await _stop_agent_streams(self.plane)


async def _follow_in_process(
    routes: RouteHub, router: Router, follower: Follower | None = None
) -> None:
    """This process's router follows the route table like any other, over memory channels."""
    from llmgw_server.route_feed.connection import local_pair

    hub_end, router_end = local_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(routes.serve, hub_end, "this process")
        await (follower or Follower(router.served, "in-process", shares=router)).follow(router_end)


# How soon this process's router dials the leader's feed again after it ended.
_LEADER_REDIAL_S = 0.25


async def _follow_leader(seat: Seat, router: Router) -> None:
    """Where control planes share a store, this process's router follows whichever leads:
    its own plane over memory channels, or the leader's route feed across the network
    with the token that leader put in the store; with none, it serves its last table."""
    follower = Follower(router.served, "in-process", shares=router)
    while True:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_on_change() -> None:
                    await seat.changed()
                    scope.cancel()

                nursery.start_soon(cancel_on_change)
                plane, leadership = seat.plane, seat.leadership()
                if plane is not None:
                    await _follow_in_process(plane.routes, router, follower)
                elif leadership.leader_url is not None:
                    await _follow_remote_leader(seat, follower, leadership.leader_url)
                await trio.sleep_forever()  # until the leadership changes


async def _follow_remote_leader(seat: Seat, follower: Follower, url: str) -> None:
    from llmgw_server.route_feed.remote import client_context, feed_target, follow_once
    from llmgw_server.store.etcd import StoreError

    where = feed_target(url)
    ca = seat.config.agents.ca
    ssl_context = client_context(ca) if where.secure else None
    while True:
        why = "the leader has put no token in the store yet"
        try:
            token = await seat.peer_token()
        except StoreError as exc:
            token, why = None, f"the store: {exc}"
        if token is not None:
            _, why = await follow_once(follower, where, token, ssl_context, ca)
        log.info("the leader's route feed at %s: %s; dialing again", url, why)
        await trio.sleep(_LEADER_REDIAL_S)


async def main(
    config: Config,
    *,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One process serves (and runs the control plane, when the config has one) until
    SIGINT/SIGTERM or `stop`."""
    router = Router(config)
    reloader = _router_reloader(router)  # SIGHUP and POST /v1/admin/reload
    listeners = await _listeners(config)
    port = listeners[0].socket.getsockname()[1]
    layout = _SingleProcess(config, port, reloader)
    async with trio.open_nursery() as nursery:
        serve = partial(serve_router, router, listeners, layout, sighup=reloader)
        http = await nursery.start(partial(serve, stop=trio.Event() if stop is None else stop))
        task_status.started(
            Running(port, router, http, layout.control_port, layout.plane, layout.seat)
        )


# -- a router apart ---------------------------------------------------------------------------


@attrs.define
class _Apart:
    """The table comes from a control plane across the network."""

    config: Config
    port: int
    where: list[Target]  # the control planes: the one that leads is followed
    token: str
    ca: Path | None
    ssl_context: ssl.SSLContext | None

    def listening(self) -> str:
        feeds = [f"{'wss' if t.secure else 'ws'}://{t.where}{t.resource}" for t in self.where]
        return f"{_http_address(self.config, self.port)}, following {' or '.join(feeds)}"

    async def start(self, nursery: trio.Nursery, router: Router) -> Follower | None:
        from llmgw_server.route_feed.remote import follow_forever

        follower = Follower(router.served, f"{socket.gethostname()}:{self.port}", shares=router)
        nursery.start_soon(
            follow_forever, follower, self.where, self.token, self.ssl_context, self.ca
        )
        return follower

    def closing(self) -> None:
        pass

    async def drained(self) -> None:
        pass


async def router_apart_main(
    config: Config,
    control: str | Sequence[str],
    token: str,
    ca: Path | None,
    *,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A router that follows the control plane at `control` (or the one that leads of
    several: URLs given apart or comma-separated) serves until SIGINT/SIGTERM (or
    `stop`); `started()` with the port it serves. /readyz answers 503 until the first
    complete route table is applied and its replicas were probed once."""
    from llmgw_server.route_feed.remote import client_context, feed_targets

    where = feed_targets(control)
    router = Router(config)
    listeners = await _listeners(config)
    port: int = listeners[0].socket.getsockname()[1]
    ssl_context = client_context(ca) if any(t.secure for t in where) else None
    layout = _Apart(config, port, where, token, ca, ssl_context)
    async with trio.open_nursery() as nursery:
        serve = partial(serve_router, router, listeners, layout, sighup=_router_reloader(router))
        await nursery.start(partial(serve, stop=trio.Event() if stop is None else stop))
        task_status.started(port)


# -- a worker -----------------------------------------------------------------------------------


@attrs.define
class _Worker:
    """The config and the table come from the parent, over the worker's channel."""

    worker: Worker
    follow: bool
    ready_after_table: bool

    def listening(self) -> str | None:
        return None  # the parent says where the workers listen

    async def start(self, nursery: trio.Nursery, router: Router) -> Follower | None:
        worker = self.worker
        nursery.start_soon(worker.read_channel)
        if not self.follow:
            return None
        name = f"worker {worker.index} (pid {os.getpid()})"
        # What serves is logged once, by worker 0: every worker serves the same.
        follower = Follower(router.served, name, log_changes=worker.index == 0, shares=router)
        nursery.start_soon(_follow_parent, worker, follower)
        return follower if self.ready_after_table else None

    def closing(self) -> None:
        pass

    async def drained(self) -> None:
        pass


async def _follow_parent(worker: Worker, follower: Follower) -> None:
    try:
        await follower.follow(worker.feed)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the parent is gone: read_channel stops the worker


async def serve_worker(
    index: int,
    channel_fd: int,
    listen_fds: Sequence[int],
    follow: bool,
    ready_after_table: bool = False,
) -> int:
    """Serve until stopped; `follow`: the replica set comes from the parent's route feed;
    `ready_after_table` (a router apart): probes, and /readyz 200, wait for a complete one."""
    channel = channel_from_fd(channel_fd)
    frames = await channel.receive()
    if not frames or frames[0][0] != CONFIG:
        log.error("the parent sent no config first: stopping")
        return 1
    generation, config = decode_config(frames[0][1])
    worker = Worker(index, channel, config, generation)
    for kind, payload in frames[1:]:
        await worker.on_frame(kind, payload)
    listeners = [
        trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
        for fd in listen_fds
    ]
    layout = _Worker(worker, follow, ready_after_table)
    async with trio.open_nursery() as nursery:
        serve = partial(serve_router, worker.router, listeners, layout, sighup=None)
        await nursery.start(partial(serve, stop=worker.stop))
        await channel.send(READY)
    return 0


def worker_cli(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw-server worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, action="append", required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--follow", action="store_true", help="follow the parent's route feed")
    parser.add_argument(
        "--ready-after-table",
        action="store_true",
        help="probe, and turn ready, once a complete route table came (a router apart)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [worker {args.index}] %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return_large_buffers()
    sys.exit(
        trio.run(
            serve_worker,
            args.index,
            args.channel_fd,
            args.listen_fd,
            args.follow,
            args.ready_after_table,
        )
    )


# How the parent starts a worker: this module, run as a program.
WORKER_COMMAND = (sys.executable, "-m", "llmgw_server.wiring")


# -- the workers' parent -------------------------------------------------------------------------


@attrs.frozen
class WorkersRunning:
    """What `workers_main` hands to `task_status.started` once every worker serves."""

    port: int
    workers: Workers
    control_port: int | None = None


async def workers_main(
    config: Config,
    *,
    follow: Callable[[TableRelay], Awaitable[None]] | None = None,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[WorkersRunning] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve with `config.server.workers` processes until SIGINT/SIGTERM (or `stop`).

    The workers follow this process's control plane when the config has one; with
    `follow` (a router apart), the control plane that `follow` follows through the
    relay it is given, such as `partial(follow_forever, where=..., ...)`.
    """
    from llmgw_server.route_feed.hub import RouteHub
    from llmgw_server.route_feed.relay import TableRelay

    s = config.server
    listeners = await _listeners(config)
    port = listeners[0].socket.getsockname()[1]
    plane = None if follow is not None else _control_plane(config)
    relay_hub = RouteHub(relays=True) if follow is not None else None
    # Without a control plane to follow, the workers still follow this process's hub:
    # it hands out their shares of the tenants' limits (and no table).
    hub = relay_hub or (plane.routes if plane is not None else RouteHub(relays=True))
    workers = Workers(
        config,
        [listener.socket.fileno() for listener in listeners],
        command=WORKER_COMMAND,
        feed=None if hub is None else hub.serve,
        ready_after_table=follow is not None,
    )
    apply: Apply = workers.apply
    if plane is not None:
        apply = with_control_plane(apply, plane.set_catalog)
    reloader = Reloader(config, apply)
    control_port = None
    try:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                if plane is not None:
                    control_port = await _serve_control_port(plane, reloader, nursery)
                await nursery.start(reload_on_sighup, reloader)
                await nursery.start(workers.run)
                if follow is not None:
                    assert hub is not None
                    nursery.start_soon(follow, TableRelay(hub, f"{socket.gethostname()}:{port}"))
                log.info(
                    "llmgw router listening on %s with %d workers",
                    _http_address(config, port),
                    workers.count,
                )
                task_status.started(WorkersRunning(port, workers, control_port))
                await _until_stopped(signals, trio.Event() if stop is None else stop)
            log.info("shutting down: every worker drains for up to %s s", s.shutdown_grace_s)
            if plane is not None:
                plane.closing = True
            await workers.stop(s.shutdown_grace_s)
            if plane is not None:
                await _stop_agent_streams(plane)
            nursery.cancel_scope.cancel()
    finally:
        for listener in listeners:
            listener.socket.close()
    log.info("stopped")


# -- the commands --------------------------------------------------------------------------------


def _control_listen_failed() -> type[Exception]:
    from llmgw_server.control_shell.port import ControlListenFailed

    return ControlListenFailed


def run(config: Config) -> int:
    """`llmgw-server [serve]`: serve until a signal; 1 when a port cannot be had."""
    _raise_open_file_limit()
    _tune_gc()
    return_large_buffers()  # held and answered bodies leave RSS when freed
    failed: BaseException | None = None
    try:
        try:
            trio.run(workers_main if config.server.workers > 1 else main, config)
        # Opened inside a nursery: in a group. (The class is looked up only when something
        # was raised: a server without a control plane never imports it.)
        except* _control_listen_failed() as group:
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


def run_router_apart(
    config: Config, control: str | Sequence[str], token: str, ca: Path | None
) -> int:
    """The `router` command: serve until a signal; 1 when the port cannot be had."""
    from llmgw_server.route_feed.remote import client_context, feed_targets, follow_forever

    return_large_buffers()
    try:
        if config.server.workers > 1:
            where = feed_targets(control)
            ssl_context = client_context(ca) if any(t.secure for t in where) else None
            follow = partial(
                follow_forever, where=where, token=token, ssl_context=ssl_context, ca=ca
            )
            trio.run(partial(workers_main, config, follow=follow))
        else:
            trio.run(router_apart_main, config, control, token, ca)
    except OSError as exc:
        print(
            f"llmgw-server router: cannot listen on {config.server.listen}: {exc}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    worker_cli()
