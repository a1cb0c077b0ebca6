"""The mock engine's KV-cache event publisher: vLLM's PUB and ROUTER sockets, under trio.

As vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py, 0.32.0):

- a PUB socket on `endpoint`, bound when the address is a wildcard (`*`, `::`) or
  ipc://, connected otherwise (the subscriber binds); each message is three frames:
  the topic, the sequence number (8 bytes, big-endian, from 0 in each process) and the
  msgpack payload (llmgw_mock_engine.kv_events);
- with `replay_endpoint`, a ROUTER socket bound there that keeps the last
  `buffer_steps` messages; a request `[identity, b"", start]` (start: the first wanted
  sequence number, big-endian) is answered with `[identity, b"", topic, seq, payload]`
  for each buffered message from `start` on, then the end marker `[identity, b"", b"",
  -1 as 8 signed big-endian bytes, b""]`. A request of another shape is logged and
  left unanswered, as vLLM does.

pyzmq's sockets are not trio-aware, so nothing here blocks: `publish` is a plain call
from the trio thread (the engine's, after each scheduler step) that encodes and sends with
NOBLOCK; a PUB socket never blocks, it drops a message for a subscriber whose queue holds
`hwm` messages already, so a slow or stuck subscriber never holds up the engine (vLLM's
thread queues up to max_queue_size batches first; the mock has no queue to fill). The
replay socket is served by one task that waits on the socket's file descriptor
(`trio.lowlevel.wait_readable(sock.FD)`); that descriptor is edge-triggered, so after each
wake-up, and before each wait, the task reads `zmq.EVENTS` and does all the work it
shows. The ROUTER is `ROUTER_MANDATORY`: a reply to a peer whose queue is full waits for
room (at most `REPLAY_STALL_S` at a time, then that replay is abandoned) instead of being
dropped silently, as vLLM's replies are past the default high-water mark of 1,000; a
reply to a peer that has gone ends its replay.

Memory: the replay buffer holds at most `buffer_steps` messages (references to the bytes
sent, no copies), and zmq queues at most `hwm` messages per subscriber and 1,000 per
replaying peer. One message is one scheduler step's events: at most the blocks that step
stored and evicted, each of which the cache held (at most `--mock-kv-blocks`), so about
`kv_blocks * (5 * block_size + 30)` bytes at worst. Replay requests are capped at 64
bytes (`MAXMSGSIZE`: a peer sending more is disconnected by zmq).

The sockets and their context belong to `run`, a task of the engine's nursery: cancelled,
it closes both sockets (linger 0) and terminates the context. A publish after that is
dropped.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

import trio
import zmq

from llmgw_mock_engine.kv_events import BatchEncoder, KvEventsConfig
from llmgw_mock_engine.scheduler import CacheEvent

log = logging.getLogger("llmgw.mock_engine")

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
REPLAY_STALL_S: Final = 5.0  # a replaying peer that takes nothing for this long is dropped
MAX_REQUEST_BYTES: Final = 64


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, encoder: BatchEncoder) -> None:
        self.config = config
        self.encoder = encoder
        self.topic = config.topic.encode("utf-8")
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.endpoint = config.endpoint  # as bound (a port 0 resolved) or connected
        self.replay_endpoint = config.replay_endpoint
        self.dropped = 0  # messages the PUB socket would not take (it never should)
        self.replays = 0  # replay requests answered
        self._pub: zmq.Socket[bytes] | None = None
        self._closed = False
        # What run() opened, kept until it ends (and then, closed, for a look).
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.sockets: list[zmq.Socket[bytes]] = []

    def stats(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "published": self.next_seq,
            "last_seq": self.next_seq - 1 if self.next_seq else None,
            "buffered": len(self.buffer),
            "dropped": self.dropped,
            "replays": self.replays,
        }

    def publish(self, events: Sequence[CacheEvent]) -> int | None:
        """Send one step's events as one message; its sequence number, or None once
        closed. Never blocks."""
        pub = self._pub
        if pub is None or self._closed or not events:
            return None
        payload = self.encoder.encode(events, time.time())
        seq = self.next_seq
        self.next_seq += 1
        try:
            pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        self.buffer.append((seq, payload))
        return seq

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, serve replays until cancelled, then close everything."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.context, sockets = context, self.sockets
        try:
            pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            replay: zmq.Socket[bytes] | None = None
            try:
                if self.config.binds:
                    pub.bind(self.config.endpoint)
                    self.endpoint = _last_endpoint(pub)
                else:
                    pub.connect(self.config.endpoint)
                if self.config.replay_endpoint is not None:
                    replay = context.socket(zmq.ROUTER)
                    sockets.append(replay)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                    replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                    replay.bind(self.config.replay_endpoint)
                    self.replay_endpoint = _last_endpoint(replay)
            except zmq.ZMQError as e:
                raise RuntimeError(f"KV events: cannot open {self.config}: {e}") from None
            self._pub = pub
            log.info(
                "mock engine: publishing KV events on %s (%s), replay on %s, topic %r",
                self.endpoint,
                "bound" if self.config.binds else "connected",
                self.replay_endpoint or "none",
                self.config.topic,
            )
            task_status.started()
            if replay is None:
                await trio.sleep_forever()
            else:
                await self._serve_replays(replay)
        finally:
            self._closed = True
            self._pub = None
            for sock in sockets:
                trio.lowlevel.notify_closing(sock.FD)
                sock.close(linger=0)
            context.term()

    async def _serve_replays(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            await _wait(sock, zmq.POLLIN)
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) != 3:
                log.warning("KV events: a replay request of %d frames, not 3: ignored", len(frames))
                continue
            identity, _, start = frames
            await self._replay(sock, identity, int.from_bytes(start, "big"))

    async def _replay(self, sock: zmq.Socket[bytes], identity: bytes, start: int) -> None:
        # A list of references: the buffer may take new messages while this waits.
        wanted = [(seq, payload) for seq, payload in self.buffer if seq >= start]
        replies = [(identity, b"", self.topic, seq.to_bytes(8, "big"), payload)
                   for seq, payload in wanted]  # fmt: skip
        replies.append((identity, b"", b"", END_SEQ, b""))
        for reply in replies:
            while True:
                try:
                    sock.send_multipart(reply, zmq.NOBLOCK)
                    break
                except zmq.Again:  # the peer's queue is full: wait for room
                    with trio.move_on_after(REPLAY_STALL_S) as waited:
                        await _wait(sock, zmq.POLLOUT)
                    if waited.cancelled_caught:
                        log.warning("KV events: a replaying peer stalled; its replay abandoned")
                        return
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        raise
                    return  # the peer has gone
        self.replays += 1


async def _wait(sock: zmq.Socket[bytes], flag: int) -> None:
    """Until the socket can do `flag` (zmq.POLLIN or zmq.POLLOUT). Its FD only signals a
    change (edge-triggered), and reading EVENTS re-arms it: read it before every wait."""
    while not _events(sock) & flag:
        await trio.lowlevel.wait_readable(sock.FD)


def _events(sock: zmq.Socket[bytes]) -> int:
    events = sock.getsockopt(zmq.EVENTS)
    assert isinstance(events, int)
    return events


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
