"""Following engines' KV-cache events into the router's KvIndex (`balancing = "precise"`).

One subscription per replica whose endpoint names `kv_events` (vLLM's `--kv-events-config`
endpoint, or the mock engine's), for as long as it is a replica of some model. pyzmq's
sockets are not trio's: a thread owns each SUB socket and hands the messages' frames to
this process's loop through a bounded channel, every message already queued at once
(at most `BATCH_MESSAGES` or about `BATCH_BYTES` a handoff, `CHANNEL` handoffs waiting:
a full channel drops them, and the index sees the gap); each handoff wakes the loop, about
50 us of CPU, so an engine's burst costs one. Decoding (llmgw_core.kv_events, bounded
there) and applying happen on the loop, so the index has one writer.

At start, and whenever the index finds a gap (`ApplyResult.replay_from`), the engine's
replay socket (`kv_replay`) is asked for what it still buffers, from that sequence number
on, by a thread with a DEALER socket (at most `MAX_REPLAY_BYTES` of answers and
`REPLAY_TIMEOUT_S`); live messages wait in the channel meanwhile. A router that starts
after its engines thus knows, within the replay's time, what they stored in their last
`buffer_steps` steps (vLLM's default: 10,000). Without `kv_replay`, a gap or a late start
is given up on (the index clears the replica and rebuilds from the live stream).

Malformed or oversized messages are dropped and logged once a period per replica; a
message bigger than the decoder takes is refused by zmq itself (`MAXMSGSIZE`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable

import trio
import zmq

from llmgw_core.catalog import Endpoint
from llmgw_core.kv_events import (
    END_SEQ,
    MAX_MESSAGE_BYTES,
    KvEventError,
    decode_message,
    decode_replay,
)
from llmgw_core.ratelog import RateLimit
from llmgw_server.router.kv_index import KvIndex

log = logging.getLogger("llmgw.kv_feed")

CHANNEL = 32  # handoffs between a subscriber thread and the loop: at most 256 MiB
BATCH_MESSAGES = 64  # messages in one handoff ...
BATCH_BYTES = 4 << 20  # ... and their payloads' bytes, once one message is in
POLL_S = 1.0  # how soon a subscriber thread notices it should stop (it is abandoned)
FOLLOW_INTERVAL_S = 1.0  # how often the replicas to follow are looked at
REPLAY_TIMEOUT_S = 5.0
MAX_REPLAY_BYTES = 256 << 20
REPLAY_MESSAGES = 20_000
_FRAME_SLACK = 4096  # a message's topic and sequence frames beside its payload

_END = END_SEQ.to_bytes(8, "big")

Frames = list[bytes]
Batch = list[Frames]


async def follow_kv_events(
    index: KvIndex,
    endpoints: Callable[[], set[Endpoint]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Subscribe to each of `endpoints()` that names kv_events while it is there."""
    followed: dict[Endpoint, trio.CancelScope] = {}
    failures = RateLimit(period_s=60.0)
    async with trio.open_nursery() as nursery:
        task_status.started()
        while True:
            wanted = {e for e in endpoints() if e.kv_events}
            for endpoint in wanted - followed.keys():
                scope = trio.CancelScope()
                followed[endpoint] = scope
                subscription = Subscription(index, endpoint, failures)
                nursery.start_soon(_within, scope, subscription.run)
            for endpoint in followed.keys() - wanted:
                followed.pop(endpoint).cancel()
                index.forget(endpoint.url)
            await trio.sleep(FOLLOW_INTERVAL_S)


async def _within(scope: trio.CancelScope, run: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await run()


class Subscription:
    def __init__(self, index: KvIndex, endpoint: Endpoint, failures: RateLimit) -> None:
        self.index = index
        self.endpoint = endpoint
        self.name = endpoint.url
        self._failures = failures
        self.received = 0
        self.dropped = 0  # the channel was full

    async def run(self) -> None:
        send, receive = trio.open_memory_channel[Batch](CHANNEL)
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
                async for batch in receive:
                    for frames in batch:
                        await self._apply_live(frames, skip_old=stale > 0)
                    stale = max(stale - 1, 0)
            finally:
                stop.set()
                nursery.cancel_scope.cancel()

    async def _apply_live(self, frames: Frames, *, skip_old: bool) -> None:
        try:
            batch = decode_message(frames)
        except KvEventError as exc:
            self._failed(f"a malformed message dropped: {exc}")
            return
        last = self.index.last_seq(self.name)
        if skip_old and last is not None and batch.seq <= last:
            return
        now = trio.current_time()
        result = self.index.apply(self.name, batch, now)
        if result.replay_from is None:
            return
        if self.endpoint.kv_replay:
            await self._replay(result.replay_from)
        else:
            self.index.replay_done(self.name, now)  # nothing can fill it: rebuilt live

    async def _replay(self, start: int) -> None:
        """Ask the replay socket from `start`; apply what it answers, in order."""
        index, now = self.index, trio.current_time()
        try:
            answers = await trio.to_thread.run_sync(
                self._replay_thread, start, abandon_on_cancel=True
            )
        except (zmq.ZMQError, OSError) as exc:
            self._failed(f"the replay from {start} failed: {exc}")
            answers = []
        for frames in answers:
            try:
                batch = decode_replay(frames)
            except KvEventError as exc:
                self._failed(f"a malformed replay message dropped: {exc}")
                continue
            if batch is not None:
                index.apply(self.name, batch, now, replayed=True)
        index.replay_done(self.name, trio.current_time())

    # -- threads: each owns its socket ------------------------------------------------

    def _live_thread(
        self,
        send: trio.MemorySendChannel[Batch],
        stop: threading.Event,
        token: trio.lowlevel.TrioToken,
    ) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + _FRAME_SLACK)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint.kv_events)
            while not stop.is_set():
                if not sock.poll(int(POLL_S * 1000)):
                    continue
                batch = _queued(sock)
                try:
                    trio.from_thread.run_sync(send.send_nowait, batch, trio_token=token)
                    self.received += len(batch)
                except trio.WouldBlock:
                    self.dropped += len(batch)
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
            # A replay is up to buffer_steps messages (vLLM: 10,000) at once; the bytes
            # are bounded below. vLLM's own side drops past 1,000 queued replies, end
            # marker included: the poll's timeout ends such a replay.
            sock.setsockopt(zmq.RCVHWM, REPLAY_MESSAGES)
            sock.connect(self.endpoint.kv_replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = sock.recv_multipart(zmq.NOBLOCK)
                body = frames[1:] if frames and frames[0] == b"" else frames
                size += sum(map(len, body))
                if size > MAX_REPLAY_BYTES:
                    break  # the index gives up on the hole: cleared, rebuilt live
                if len(body) >= 2 and body[-2] == _END and not body[-1]:
                    break  # the end marker (decoded on the loop: a malformed one is logged)
                answers.append(body)
        finally:
            sock.close(0)
        return answers

    def _failed(self, why: str) -> None:
        suppressed = self._failures.allow(self.name, trio.current_time())
        if suppressed is not None:
            more = f" ({suppressed} more since)" if suppressed else ""
            log.warning("KV events of %s: %s%s", self.endpoint, why[:300], more)


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
