"""`[server] workers = N`: a supervising parent and N router processes on one port.

How the parent process is wired (its control plane, SIGHUP, shutdown): llmgw_server.wiring,
`workers_main`. The parent binds the listening socket once; every worker inherits it and
accepts on it (not SO_REUSEPORT: there each worker has its own accept queue, and a killed
worker's queued connections die with it; here they wait in the one queue for the
others). The parent serves no request itself. It

- starts the workers (router.worker) and starts again one that exits, at once the first
  time and with a growing pause while it keeps exiting soon after starting
  (`restart_delay_s`), so a worker that cannot run does not spin;
- feeds each worker the replica set over its socketpair from a route hub (the control
  plane's, or a relay's for a router apart: llmgw_server.wiring gives it; the worker's
  side is route_feed.follower);
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
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from llmgw_core.config import Config
from llmgw_core.prometheus import family, labels
from llmgw_server.reload import ReloadPlan
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
        *family("llmgw_workers", "gauge", "Worker processes serving now."),
        f"llmgw_workers {live}",
        *family(
            "llmgw_worker_restarts_total",
            "counter",
            "Workers started again after theirs exited.",
        ),
        *(
            f"llmgw_worker_restarts_total{labels(worker=str(i))} {restarts[i]}"
            for i in range(count)
        ),
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
        command: Sequence[str],
        feed: FeedServer | None = None,
        policy: RestartPolicy = RestartPolicy(),
        log_level: str | None = None,
        ready_after_table: bool = False,
    ) -> None:
        self.config = config
        self.count = config.server.workers
        self.listen_fds = listen_fds
        self.command = command  # runs one worker (llmgw_server.wiring's)
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
            *self.command,
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
