"""Following engines' KV-cache events into the router's KvIndex (`balancing = "precise"`).

One subscription per replica whose endpoint names `kv_events` (vLLM's `--kv-events-config`
endpoint, or the mock engine's), for as long as it is a replica of some model. pyzmq's
sockets are not trio's: a thread owns each SUB socket and hands the messages' frames to
this process's loop through a bounded channel, every message already queued at once
(at most `BATCH_MESSAGES` or about `BATCH_BYTES` a handoff); each handoff wakes the loop,
about 50 us of CPU, so an engine's burst costs one. Decoding (llmgw_core.kv_events,
bounded there) and applying happen on the loop, so the index has one writer.

An engine's feed takes a bounded share of the loop, whatever it sends: decoding and
applying run a slice at a time (a few ms; msgpack's own pass over a 4 MiB message, about
30 ms, is the longest), a checkpoint between slices, and each replica's slices are timed
against its `LoopShare`: at most `FEED_SHARE` of each second, `FEED_BURST_S` at once.
Without it, 3.8 MiB messages at 2-5 a second took most of the loop, and requests for
other models waited 1.3-2.1 s. What the feed has not applied yet waits, at most
`MAX_QUEUED_BYTES` of it; past that, messages are dropped as they come, and the index
marks the replica stale (`KvIndex.stale`: cleared, rebuilt from the next message on,
unused for routing until then), counted (`llmgw_kv_events_dropped_total`) and logged once
per replica and reason.

At start, and whenever the index finds a gap (`ApplyResult.replay_from`), the engine's
replay socket (`kv_replay`) is asked for what it still buffers, from that sequence number
on, by a thread with a DEALER socket, up to what an engine buffers: `REPLAY_MESSAGES`
(vLLM's `buffer_steps`, 10,000), `MAX_REPLAY_BYTES`, `REPLAY_TIMEOUT_S`. A replay past
those is given up on unread (the replica stale, as above): a forced gap answered with 64
messages of 3.8 MiB once held 243 MiB and stalled the loop 5.7 s. Live messages wait
meanwhile. A router that starts after its engines thus knows, within the replay's time,
what they stored in their last steps. Without `kv_replay`, a gap or a late start is given
up on (the index clears the replica and rebuilds from the live stream).

Malformed or oversized messages are dropped and logged once a period per replica; a
message bigger than the decoder takes is refused by zmq itself (`MAXMSGSIZE`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import TypeVar

import trio
import zmq

from llmgw_core.catalog import Endpoint
from llmgw_core.kv_events import (
    END_SEQ,
    MAX_MESSAGE_BYTES,
    KvEventError,
    decode_message_steps,
    decode_replay_steps,
)
from llmgw_core.ratelog import RateLimit
from llmgw_server.router.kv_index import KvIndex
from llmgw_server.router.loop_share import LoopShare

log = logging.getLogger("llmgw.kv_feed")

CHANNEL = 32  # handoffs between a subscriber thread and the loop (MAX_QUEUED_BYTES first)
BATCH_MESSAGES = 64  # messages in one handoff ...
BATCH_BYTES = 4 << 20  # ... and their payloads' bytes, once one message is in
POLL_S = 1.0  # how soon a subscriber thread notices it should stop (it is abandoned)
FOLLOW_INTERVAL_S = 1.0  # how often the replicas to follow are looked at
# A replica's feed: 10% of the loop, 50 ms at once. An engine storing 100k tokens a
# second sends about 0.5 MiB of events, 25 ms of the loop here: within it, 4x over.
FEED_SHARE = 0.1
FEED_BURST_S = 0.05
MAX_QUEUED_BYTES = 8 << 20  # a replica's messages received, not yet applied
LIVE_HWM = 64  # messages zmq itself queues for the subscriber thread (4 MiB at most each)
REPLAY_TIMEOUT_S = 5.0
REPLAY_MESSAGES = 10_000  # vLLM's buffer_steps: an engine replays no more
MAX_REPLAY_BYTES = 32 << 20
REPLAY_HWM = 256
_FRAME_SLACK = 4096  # a message's topic and sequence frames beside its payload

_END = END_SEQ.to_bytes(8, "big")

Frames = list[bytes]
Batch = list[Frames]
Handoff = tuple[int, Batch]  # messages dropped just before the batch, the batch
_T = TypeVar("_T")


class ReplayTooBig(Exception):
    """A replay past REPLAY_MESSAGES or MAX_REPLAY_BYTES: given up on, unread."""

    def __init__(self, messages: int) -> None:
        super().__init__(messages)
        self.messages = messages


async def follow_kv_events(
    index: KvIndex,
    endpoints: Callable[[], set[Endpoint]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Subscribe to each of `endpoints()` that names kv_events while it is there."""
    followed: dict[Endpoint, trio.CancelScope] = {}
    failures = RateLimit(period_s=60.0)
    said: set[tuple[str, str]] = set()  # (replica, why) whose drops were logged
    async with trio.open_nursery() as nursery:
        task_status.started()
        while True:
            wanted = {e for e in endpoints() if e.kv_events}
            for endpoint in wanted - followed.keys():
                log.info("following the KV events of %s", _where(endpoint))
                scope = trio.CancelScope()
                followed[endpoint] = scope
                subscription = Subscription(index, endpoint, failures, said)
                nursery.start_soon(_within, scope, subscription.run)
            kept = {e.url for e in wanted}
            for endpoint in followed.keys() - wanted:
                # The same URL still wanted: its key or events address changed.
                why = "followed anew" if endpoint.url in kept else "no model has that replica now"
                log.info("no longer following the KV events of %s: %s", endpoint, why)
                followed.pop(endpoint).cancel()
                index.forget(endpoint.url)
            await trio.sleep(FOLLOW_INTERVAL_S)


def _where(endpoint: Endpoint) -> str:
    """Which engine, and the addresses its events are read at, as the operator set them."""
    replay = endpoint.kv_replay or "none: a gap is rebuilt from the live events"
    return f"{endpoint} at {endpoint.kv_events} (replay {replay})"


async def _within(scope: trio.CancelScope, run: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await run()


class Subscription:
    def __init__(
        self,
        index: KvIndex,
        endpoint: Endpoint,
        failures: RateLimit,
        said: set[tuple[str, str]] | None = None,
        *,
        share: LoopShare | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.index = index
        self.endpoint = endpoint
        self.name = endpoint.url
        self._failures = failures
        self._said = said if said is not None else set()
        self.share = share or LoopShare(FEED_SHARE, FEED_BURST_S)
        self._clock = clock  # what times a slice of work (the tests' costs are made up)
        self.received = 0
        self.dropped = 0  # dropped as they came: MAX_QUEUED_BYTES (or CHANNEL) were waiting
        self.queued = 0  # payload bytes handed to the loop, not yet applied
        self._lost = 0  # dropped since the last handoff

    async def run(self) -> None:
        send, receive = trio.open_memory_channel[Handoff](CHANNEL)
        stop = threading.Event()
        token = trio.lowlevel.current_trio_token()
        live = functools.partial(self._live_thread, send, stop, token)
        async with trio.open_nursery() as nursery:
            thread = functools.partial(trio.to_thread.run_sync, live, abandon_on_cancel=True)
            nursery.start_soon(thread)
            try:
                stale = 0
                if self.endpoint.kv_replay:
                    await self._replay(0)
                    # What came live while the replay ran may repeat it: not a restart.
                    stale = receive.statistics().current_buffer_used
                async for lost, batch in receive:
                    await self._take(lost, batch, skip_old=stale > 0)
                    stale = max(stale - 1, 0)
            finally:
                stop.set()
                nursery.cancel_scope.cancel()

    async def _take(self, lost: int, batch: Batch, *, skip_old: bool) -> None:
        """Apply one handoff, messages dropped just before it first said."""
        try:
            if lost:
                self._dropped("backlog", lost)
            for frames in batch:
                await self._apply_live(frames, skip_old=skip_old)
        finally:
            self.queued -= _size(batch)

    def _offer(self, send: trio.MemorySendChannel[Handoff], batch: Batch) -> None:
        """On the loop, from the subscriber thread: queue a batch, or drop it when
        MAX_QUEUED_BYTES wait already (the next batch queued says so)."""
        size = _size(batch)
        if self.queued + size > MAX_QUEUED_BYTES:
            self._lost += len(batch)
            self.dropped += len(batch)
            return
        try:
            send.send_nowait((self._lost, batch))
        except trio.WouldBlock:
            self._lost += len(batch)
            self.dropped += len(batch)
            return
        self._lost = 0
        self.queued += size
        self.received += len(batch)

    def _dropped(self, why: str, messages: int) -> None:
        """Messages of this replica dropped unapplied: its index entries go (stale)."""
        self.index.stale(self.name, why, messages)
        if (self.name, why) not in self._said:
            self._said.add((self.name, why))
            log.warning(
                "KV events of %s: %d messages dropped (%s); its index entries are cleared "
                "and rebuilt from the next message (said once; llmgw_kv_events_dropped_total "
                "counts them)",
                self.endpoint,
                messages,
                _WHY[why],
            )

    async def _paced(self, steps: Generator[None, None, _T]) -> _T:
        """Run sliced work within the replica's share of the loop: a checkpoint (or the
        wait the share asks) before each slice, each slice timed."""
        share, clock = self.share, self._clock
        while True:
            wait = share.wait(trio.current_time())
            if wait > 0:
                await trio.sleep(wait)
            else:
                await trio.lowlevel.checkpoint()
            started = clock()
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            finally:
                share.spent(clock() - started, trio.current_time())

    async def _apply_live(self, frames: Frames, *, skip_old: bool) -> None:
        try:
            batch = await self._paced(decode_message_steps(frames))
        except KvEventError as exc:
            self._failed(f"a malformed message dropped: {exc}")
            return
        index, name = self.index, self.name
        last = index.last_seq(name)
        if skip_old and last is not None and batch.seq <= last:
            return
        now = trio.current_time()
        result = await self._paced(index.apply_steps(name, batch, now))
        if result.replay_from is None:
            return
        if self.endpoint.kv_replay:
            await self._replay(result.replay_from)
        else:  # nothing can fill it: rebuilt live
            await self._paced(index.replay_done_steps(name, now))

    async def _replay(self, start: int) -> None:
        """Ask the replay socket from `start`; apply what it answers, in order."""
        index, now = self.index, trio.current_time()
        try:
            answers = await trio.to_thread.run_sync(
                self._replay_thread, start, abandon_on_cancel=True
            )
        except ReplayTooBig as exc:
            self._dropped("replay", exc.messages)
            return
        except (zmq.ZMQError, OSError) as exc:
            self._failed(f"the replay from {start} failed: {exc}")
            answers = []
        for frames in answers:
            try:
                batch = await self._paced(decode_replay_steps(frames))
            except KvEventError as exc:
                self._failed(f"a malformed replay message dropped: {exc}")
                continue
            if batch is not None:
                await self._paced(index.apply_steps(self.name, batch, now, replayed=True))
        await self._paced(index.replay_done_steps(self.name, trio.current_time()))

    # -- threads: each owns its socket ------------------------------------------------

    def _live_thread(
        self,
        send: trio.MemorySendChannel[Handoff],
        stop: threading.Event,
        token: trio.lowlevel.TrioToken,
    ) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + _FRAME_SLACK)
            sock.setsockopt(zmq.RCVHWM, LIVE_HWM)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint.kv_events)
            while not stop.is_set():
                if not sock.poll(int(POLL_S * 1000)):
                    continue
                batch = _queued(sock)
                try:
                    trio.from_thread.run_sync(self._offer, send, batch, trio_token=token)
                except (trio.RunFinishedError, trio.BrokenResourceError, trio.ClosedResourceError):
                    return
        finally:
            sock.close(0)

    def _replay_thread(self, start: int) -> list[Frames]:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        answers: list[Frames] = []
        size = 0
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + _FRAME_SLACK)
            # A replay is up to buffer_steps messages (vLLM: 10,000) at once, read as they
            # come (zmq holds REPLAY_HWM at most meanwhile). vLLM's own side drops past
            # 1,000 queued replies, end marker included: the poll's timeout ends such a
            # replay.
            sock.setsockopt(zmq.RCVHWM, REPLAY_HWM)
            sock.connect(self.endpoint.kv_replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = sock.recv_multipart(zmq.NOBLOCK)
                body = frames[1:] if frames and frames[0] == b"" else frames
                if len(body) >= 2 and body[-2] == _END and not body[-1]:
                    break  # the end marker (decoded on the loop: a malformed one is logged)
                size += sum(map(len, body))
                if size > MAX_REPLAY_BYTES or len(answers) >= REPLAY_MESSAGES:
                    raise ReplayTooBig(len(answers) + 1)
                answers.append(body)
        finally:
            sock.close(0)
        return answers

    def _failed(self, why: str) -> None:
        suppressed = self._failures.allow(self.name, trio.current_time())
        if suppressed is not None:
            more = f" ({suppressed} more since)" if suppressed else ""
            log.warning("KV events of %s: %s%s", self.endpoint, why[:300], more)


_WHY = {
    "backlog": f"{MAX_QUEUED_BYTES >> 20} MiB waited already: its engine sends more than "
    f"the {FEED_SHARE:.0%} of this router's loop that may apply it",
    "replay": f"a replay past {REPLAY_MESSAGES} messages or {MAX_REPLAY_BYTES >> 20} MiB",
}


def _size(batch: Batch) -> int:
    return sum(len(frames[-1]) for frames in batch if frames)


def _queued(sock: zmq.Socket[bytes]) -> Batch:
    """The messages the socket holds now (at least one: it polled ready), up to a batch."""
    batch = [sock.recv_multipart(zmq.NOBLOCK)]
    size = len(batch[0][-1])
    while len(batch) < BATCH_MESSAGES and size < BATCH_BYTES:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        batch.append(frames)
        size += len(frames[-1])
    return batch
