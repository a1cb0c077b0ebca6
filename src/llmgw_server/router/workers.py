"""`[server] workers = N`: a supervising parent and N router processes on one port.

The parent binds the listening socket once; every worker inherits it and accepts on it
(not SO_REUSEPORT: there each worker has its own accept queue, and a killed worker's
queued connections die with it; here they wait in the one queue for the others). The
parent serves no request itself. It

- starts the workers (router.worker) and starts again one that exits, at once the first
  time and with a growing pause while it keeps exiting soon after starting
  (`restart_delay_s`), so a worker that cannot run does not spin;
- owns the control plane when there is one, and feeds each worker the replica set over
  its socketpair (router.follower on the worker's side);
- answers the workers' /metrics scrapes with every live worker's page, merged
  (router.metrics_merge);
- reloads the config on SIGHUP (and the admin API's reload) and hands it to every worker;
- on SIGTERM/SIGINT has every worker drain (each stops accepting and lets its requests
  in flight finish within shutdown_grace_s), then exits. A worker whose parent is gone
  (even killed with SIGKILL) sees its socketpair close and drains the same way.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import attrs
import trio

from llmgw_core.config import Config
from llmgw_server.control_shell.controlplane import HEARTBEAT_INTERVAL_S, ControlPlane
from llmgw_server.control_shell.port import serve_control_port
from llmgw_server.reload import Reloader, ReloadPlan, reload_on_sighup, with_control_plane
from llmgw_server.route_feed.follower import Connection
from llmgw_server.route_feed.hub import RouteHub
from llmgw_server.route_feed.messages import (
    PROTOCOL,
    Hello,
    InFlight,
    RouteTable,
    decode_down,
    encode,
)
from llmgw_server.router.metrics_merge import merge_pages
from llmgw_server.router.worker import (
    APPLIED,
    CONFIG,
    FEED,
    MERGED,
    PAGE,
    READY,
    RENDER,
    SCRAPE,
    Channel,
    ChannelError,
    FeedConnection,
    encode_config,
    tagged,
    untagged,
)

log = logging.getLogger("llmgw.workers")

GATHER_TIMEOUT_S = 2.0  # a worker that sends no page by then is left out of the scrape
APPLY_TIMEOUT_S = 10.0  # a reload waits this long for every worker to apply it
KILL_AFTER_S = 5.0  # past shutdown_grace_s, a worker still running is killed


# -- pure decisions ---------------------------------------------------------------------


@attrs.frozen
class RestartPolicy:
    stable_after_s: float = 10.0  # a worker that ran this long exited for a reason of its own
    base_s: float = 0.5
    cap_s: float = 30.0


def quick_exits_after(previous: int, ran_s: float, policy: RestartPolicy) -> int:
    """Exits in a row, each soon after its start, counting the one that just happened."""
    return previous + 1 if ran_s < policy.stable_after_s else 1


def restart_delay_s(quick_exits: int, policy: RestartPolicy) -> float:
    """A worker that ran a while is replaced at once; one that keeps exiting soon after
    its start waits base_s, then twice that each time, up to cap_s."""
    if quick_exits <= 1:
        return 0.0
    return float(min(policy.cap_s, policy.base_s * 2 ** (quick_exits - 2)))


def own_page(live: int, restarts: Counter[int], count: int) -> str:
    """The parent's own metrics, merged into every scrape's page."""
    lines = [
        "# HELP llmgw_workers Worker processes serving now.",
        "# TYPE llmgw_workers gauge",
        f"llmgw_workers {live}",
        "# HELP llmgw_worker_restarts_total Workers started again after theirs exited.",
        "# TYPE llmgw_worker_restarts_total counter",
        *(f'llmgw_worker_restarts_total{{worker="{i}"}} {restarts[i]}' for i in range(count)),
    ]
    return "\n".join(lines) + "\n"


# -- the shell -------------------------------------------------------------------------


@attrs.define(eq=False)
class Link:
    """One running worker, as its parent holds it."""

    index: int
    process: trio.Process
    channel: Channel
    feed: FeedConnection
    generation: int = -1  # of the last config it applied
    applied: trio.Event = attrs.field(factory=trio.Event)  # set at each APPLIED


@attrs.define(eq=False)
class _Gathering:
    expected: set[int]
    pages: dict[int, bytes] = attrs.field(factory=dict)
    done: trio.Event = attrs.field(factory=trio.Event)

    def settle(self) -> None:
        if self.expected <= self.pages.keys():
            self.done.set()


FeedServer = Callable[[FeedConnection, str], Awaitable[None]]


class Workers:
    """The workers of one parent: started, fed, restarted, reloaded, stopped."""

    def __init__(
        self,
        config: Config,
        listen_fds: list[int],
        *,
        feed: FeedServer | None = None,
        policy: RestartPolicy = RestartPolicy(),
        log_level: str | None = None,
        ready_after_table: bool = False,
    ) -> None:
        self.config = config
        self.count = config.server.workers
        self.listen_fds = listen_fds
        self.feed = feed  # serves one worker's route feed (the control plane's hub)
        # A router apart: each worker's /readyz waits for its first complete table.
        self.ready_after_table = ready_after_table
        self.policy = policy
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.generation = 0
        self.links: dict[int, Link] = {}
        self.restarts: Counter[int] = Counter()
        self.closing = False
        self._ids = itertools.count(1)
        self._gatherings: dict[int, _Gathering] = {}
        self.ready = trio.Event()
        self._ready_count = 0

    def argv(self, index: int, channel_fd: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "llmgw_server.router.worker",
            "--index",
            str(index),
            "--channel-fd",
            str(channel_fd),
            *(f"--listen-fd={fd}" for fd in self.listen_fds),
            "--log-level",
            self.log_level.lower(),
            *(["--follow"] if self.feed is not None else []),
            *(["--ready-after-table"] if self.ready_after_table else []),
        ]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep every worker running until `stop`; `ready` is set once each has served."""
        async with trio.open_nursery() as nursery:
            for index in range(self.count):
                nursery.start_soon(self._keep_running, index)
            task_status.started()

    async def _keep_running(self, index: int) -> None:
        quick_exits = 0
        while not self.closing:
            started = trio.current_time()
            status = await self._run_once(index)
            if self.closing:
                return
            ran = trio.current_time() - started
            quick_exits = quick_exits_after(quick_exits, ran, self.policy)
            delay = restart_delay_s(quick_exits, self.policy)
            self.restarts[index] += 1
            log.warning(
                "worker %d exited (%s) after %.1f s: starting it again%s",
                index,
                _exit_text(status),
                ran,
                f" in {delay:g} s" if delay else "",
            )
            await trio.sleep(delay)

    async def _run_once(self, index: int) -> int:
        ours, theirs = socket.socketpair()
        try:
            process = await trio.lowlevel.open_process(
                self.argv(index, theirs.fileno()),
                pass_fds=(*self.listen_fds, theirs.fileno()),
                start_new_session=True,
            )
        finally:
            theirs.close()
        channel = Channel(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        link = Link(index, process, channel, FeedConnection(channel))
        self.links[index] = link
        log.info("worker %d started (pid %d)", index, process.pid)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, link, nursery)
                try:
                    await channel.send(CONFIG, encode_config(self.generation, self.config))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it is gone already: its exit status says why
                if self.feed is not None:
                    nursery.start_soon(self._follow, link)
                await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            del self.links[index]
            link.applied.set()  # a reload waiting on it waits no more
            for gathering in self._gatherings.values():
                gathering.expected.discard(index)
                gathering.settle()
            link.feed.close()
            with trio.CancelScope(shield=True):
                if process.returncode is None:  # cancelled: the worker goes with us
                    _signal(process, signal.SIGKILL)
                    await process.wait()
                await channel.stream.aclose()
        assert process.returncode is not None
        return process.returncode

    async def _follow(self, link: Link) -> None:
        assert self.feed is not None
        try:
            # The peer is how it is reached (its name says which worker): "router worker 1
            # (pid 8210) (pipe) follows the route table".
            await self.feed(link.feed, "pipe")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the worker went: _run_once sees it exit

    async def _read(self, link: Link, nursery: trio.Nursery) -> None:
        try:
            while True:
                frames = await link.channel.receive()
                if not frames:
                    return
                for kind, payload in frames:
                    self._frame(link, kind, payload, nursery)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except ChannelError as exc:
            log.error("worker %d sent a bad frame (%s): stopping it", link.index, exc)
            _signal(link.process, signal.SIGKILL)
        finally:
            link.feed.close()

    def _frame(self, link: Link, kind: bytes, payload: bytes, nursery: trio.Nursery) -> None:
        if kind == FEED:
            link.feed.deliver(payload)
        elif kind == PAGE:
            request_id, page = untagged(payload)
            gathering = self._gatherings.get(request_id)
            if gathering is not None:
                gathering.pages[link.index] = page
                gathering.settle()
        elif kind == SCRAPE:
            scrape_id, _ = untagged(payload)
            nursery.start_soon(self._answer_scrape, link, scrape_id)
        elif kind == APPLIED:
            link.generation, _ = untagged(payload)
            link.applied.set()
            link.applied = trio.Event()
        elif kind == READY:
            log.info("worker %d (pid %d) serving", link.index, link.process.pid)
            self._ready_count += 1
            if self._ready_count >= self.count:
                self.ready.set()
        else:
            raise ChannelError(f"a {kind!r} frame is not sent by workers")

    async def _answer_scrape(self, link: Link, scrape_id: int) -> None:
        page = await self.merged_page()
        try:
            await link.channel.send(MERGED, tagged(scrape_id, page))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def merged_page(self) -> bytes:
        """Every live worker's /metrics page under its `worker` label, and the parent's."""
        request_id = next(self._ids)
        links = list(self.links.values())
        gathering = _Gathering(expected={link.index for link in links})
        self._gatherings[request_id] = gathering
        try:
            with trio.move_on_after(GATHER_TIMEOUT_S):
                for link in links:
                    try:
                        await link.channel.send(RENDER, tagged(request_id))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        gathering.expected.discard(link.index)
                gathering.settle()
                await gathering.done.wait()
        finally:
            del self._gatherings[request_id]
        pages = {str(i): gathering.pages[i].decode() for i in sorted(gathering.pages)}
        return merge_pages(pages, own=own_page(len(self.links), self.restarts, self.count))

    async def apply(self, config: Config, plan: ReloadPlan) -> None:
        """A reloaded config to every worker (and to the ones started later); returns once
        each live worker has applied it, or after APPLY_TIMEOUT_S."""
        self.generation += 1
        self.config = config
        generation = self.generation
        payload = encode_config(generation, config)
        links = list(self.links.values())
        with trio.move_on_after(APPLY_TIMEOUT_S) as scope:
            for link in links:
                try:
                    await link.channel.send(CONFIG, payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # it restarts with the new config
            for link in links:
                while link.generation < generation and self.links.get(link.index) is link:
                    await link.applied.wait()
        if scope.cancelled_caught:
            late = [link.index for link in links if link.generation < generation]
            log.warning("workers %s did not confirm the reload in time", late)

    async def stop(self, grace_s: float) -> None:
        """Every worker drains (SIGTERM); the ones still running after the grace are killed."""
        self.closing = True
        for link in list(self.links.values()):
            _signal(link.process, signal.SIGTERM)
        with trio.move_on_after(grace_s + KILL_AFTER_S):
            for link in list(self.links.values()):
                await link.process.wait()
        for link in list(self.links.values()):
            if link.process.returncode is None:
                log.warning("worker %d still running: killing it", link.index)
                _signal(link.process, signal.SIGKILL)


def _signal(process: trio.Process, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_text(status: int) -> str:
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"status {status}"


# -- a router apart, with workers ----------------------------------------------------------


class TableRelay:
    """A parent's follower of a control plane on behalf of its workers.

    It follows one connection as router.follower.Follower does (`follow`, `table`), but
    instead of serving each table it publishes it to `hub`, which the workers follow;
    back up go their in-flight counts, summed by the hub, under the control plane's
    version of the latest table every worker has applied. The hub numbers its tables
    itself: `_versions` maps its versions to the control plane's.
    """

    def __init__(self, hub: RouteHub, name: str) -> None:
        self.hub = hub
        self.name = name
        self.table: RouteTable | None = None  # the last table received
        self._versions: dict[int, int] = {}  # hub version -> the control plane's
        self._wake = trio.Event()

    async def follow(self, connection: Connection) -> None:
        """Follow until the peer closes the connection (see router.follower)."""
        self._versions = {}
        await connection.send(encode(Hello(PROTOCOL, self.name)))
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_forever, connection, nursery.cancel_scope)
            nursery.start_soon(self._wake_on_reports)
            try:
                while True:
                    table = decode_down(await connection.receive()).table
                    self.table = table
                    local = self.hub.publish(table.models, table.draining, complete=table.complete)
                    self._versions[local] = table.version
                    self._wake.set()
            except trio.EndOfChannel:
                pass
            except Exception as exc:  # handed to the caller whole, not in a group
                failure = exc
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _wake_on_reports(self) -> None:
        while True:
            await self.hub.wait_reported()
            self._wake.set()

    def report(self) -> InFlight | None:
        """What to tell the control plane now; None before every worker has a table."""
        hub = self.hub
        done = [local for local in self._versions if hub.caught_up(local)]
        if not done or self.table is None:
            return None
        latest = max(done)
        for local in [v for v in self._versions if v < latest]:
            del self._versions[local]
        counts = {e.url: n for e in self.table.draining if (n := hub.in_flight(e))}
        return InFlight(self._versions[latest], counts)

    async def _report_forever(self, connection: Connection, scope: trio.CancelScope) -> None:
        sent: InFlight | None = None
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                report = self.report()
                if report is not None and report != sent:
                    await connection.send(encode(report))
                    sent = report
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()  # the peer went: the receiving side says how


# -- the parent process ------------------------------------------------------------------


@attrs.frozen
class Running:
    """What `main` hands to `task_status.started` once every worker serves."""

    port: int
    workers: Workers
    control_port: int | None = None


async def main(
    config: Config,
    *,
    follow: Callable[[TableRelay], Awaitable[None]] | None = None,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve with `config.server.workers` processes until SIGINT/SIGTERM (or `stop`).

    The workers follow this process's control plane when the config has one; with
    `follow` (a router apart), the control plane that `follow` follows through the
    relay it is given, such as `lambda relay: standalone.follow_forever(relay, ...)`.
    """
    s = config.server
    listeners = await trio.open_tcp_listeners(s.listen.port, host=s.listen.host)
    port = listeners[0].socket.getsockname()[1]
    plane: ControlPlane | None = None
    hub: RouteHub | None = None
    if follow is not None:
        hub = RouteHub()
    elif config.runs_control_plane:
        interval = min(HEARTBEAT_INTERVAL_S, config.control.unreachable_after_s / 3)
        plane = ControlPlane(config, heartbeat_interval_s=interval)
        hub = plane.routes
    workers = Workers(
        config,
        [listener.socket.fileno() for listener in listeners],
        feed=None if hub is None else hub.serve,
        ready_after_table=follow is not None,
    )
    apply = workers.apply if plane is None else with_control_plane(workers.apply, plane.set_catalog)
    reloader = Reloader(config, apply)
    control_port = None
    try:
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                if plane is not None:
                    control_port = await serve_control_port(plane, reloader.reload, nursery)
                await nursery.start(reload_on_sighup, reloader)
                await nursery.start(workers.run)
                if follow is not None:
                    assert hub is not None
                    nursery.start_soon(follow, TableRelay(hub, f"{socket.gethostname()}:{port}"))
                log.info(
                    "llmgw router listening on http://%s:%d with %d workers",
                    s.listen.host,
                    port,
                    workers.count,
                )
                task_status.started(Running(port, workers, control_port))
                stop = trio.Event() if stop is None else stop
                async with trio.open_nursery() as waiters:
                    waiters.start_soon(_first_signal, signals, stop)
                    await stop.wait()
                    waiters.cancel_scope.cancel()
            log.info("shutting down: every worker drains for up to %s s", s.shutdown_grace_s)
            if plane is not None:
                plane.closing = True
            await workers.stop(s.shutdown_grace_s)
            nursery.cancel_scope.cancel()
    finally:
        for listener in listeners:
            listener.socket.close()
    log.info("stopped")


async def _first_signal(signals: AsyncIterator[int], stop: trio.Event) -> None:
    async for signum in signals:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()
        return
