"""One worker process of `[server] workers = N`: a whole router on the inherited port
(wired by llmgw_server.wiring, `serve_worker`); here, its line to the parent.

The supervising parent (router.workers) binds the listening socket once and starts each
worker with it (`--listen-fd`) and with one end of a Unix socketpair (`--channel-fd`),
the worker's only line to the parent. Over it, in frames (`frame`, `FrameReader`):

down (parent -> worker)                    up (worker -> parent)
  CONFIG  the config to serve (pickled):     READY    serving
          first, and again on each reload    APPLIED  a reload applied (its generation)
  FEED    a route feed frame (route_feed)    FEED     a route feed frame (Hello, InFlight)
  RENDER  send your /metrics page (id)       PAGE     this worker's page (id, page)
  MERGED  the merged page you asked for      SCRAPE   a scrape came: merge every worker's

The worker owns its Router: health probes, ejection, outstanding counts and prefix
indexes are its own. It follows the control plane's replica set through the parent
(route_feed.follower over FEED frames). It stops on SIGTERM/SIGINT, or when the parent is
gone (the socketpair closes): it stops accepting and lets requests in flight finish
within `shutdown_grace_s`.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import struct

import trio

from llmgw_core.config import Config
from llmgw_server.router.front import Router
from llmgw_server.router.metrics_merge import merge_pages

log = logging.getLogger("llmgw.worker")

# Frame kinds, one byte each.
CONFIG, FEED, RENDER, MERGED = b"c", b"f", b"r", b"m"  # down
READY, APPLIED, PAGE, SCRAPE = b"y", b"a", b"p", b"s"  # up (and FEED)
KINDS = frozenset({CONFIG, FEED, RENDER, MERGED, READY, APPLIED, PAGE, SCRAPE})
_HEADER = struct.Struct(">IB")  # payload length, kind
MAX_FRAME_BYTES = 64 * 1024 * 1024
SCRAPE_TIMEOUT_S = 5.0  # then the worker answers with its own page alone
WORKER_HEADER = b"x-llmgw-worker"


class ChannelError(Exception):
    """A frame that breaks the channel's framing: the peer is not who it should be."""


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload), kind[0]) + payload


class FrameReader:
    """Bytes in, whole frames out: (kind, payload)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= _HEADER.size:
            length, kind = _HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ChannelError(f"a frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            if bytes([kind]) not in KINDS:
                raise ChannelError(f"unknown frame kind {bytes([kind])!r}")
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((bytes([kind]), bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return frames


def tagged(tag: int, body: bytes = b"") -> bytes:
    """A payload that starts with a number (a request id, a generation)."""
    return str(tag).encode() + b"\n" + body


def untagged(payload: bytes) -> tuple[int, bytes]:
    tag, _, body = payload.partition(b"\n")
    try:
        return int(tag), body
    except ValueError:
        raise ChannelError(f"a frame without its number: {payload[:40]!r}") from None


class Channel:
    """One end of the parent-worker socketpair: framed sends (one at a time), framed reads."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._send_lock = trio.Lock()
        self._reader = FrameReader()

    async def send(self, kind: bytes, payload: bytes = b"") -> None:
        async with self._send_lock:
            await self.stream.send_all(frame(kind, payload))

    async def receive(self) -> list[tuple[bytes, bytes]]:
        """The next frames (at least one); [] when the peer closed."""
        while True:
            data = await self.stream.receive_some(65536)
            if not data:
                return []
            frames = self._reader.feed(bytes(data))
            if frames:
                return frames


def channel_from_fd(fd: int) -> Channel:
    sock = socket.socket(fileno=fd)
    return Channel(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))


class FeedConnection:
    """The route feed over the channel, a route_feed `Connection`."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.inbox_send, self.inbox = trio.open_memory_channel[str](64)

    async def send(self, text: str) -> None:
        await self.channel.send(FEED, text.encode())

    async def receive(self) -> str:
        return await self.inbox.receive()

    def deliver(self, payload: bytes) -> None:
        """A FEED frame came: queued for `receive` (the feed sends whole tables, a few a
        second at most; a follower that falls 64 behind has stopped)."""
        try:
            self.inbox_send.send_nowait(payload.decode())
        except trio.WouldBlock:
            raise ChannelError("the route feed is not being read") from None

    def close(self) -> None:
        self.inbox_send.close()


def decode_config(payload: bytes) -> tuple[int, Config]:
    generation, body = untagged(payload)
    # The parent pickled it: the channel is a socketpair only this process tree holds.
    config = pickle.loads(body)
    if not isinstance(config, Config):
        raise ChannelError(f"a CONFIG frame holds a {type(config).__name__}")
    return generation, config


def encode_config(generation: int, config: Config) -> bytes:
    return tagged(generation, pickle.dumps(config))


class Worker:
    def __init__(self, index: int, channel: Channel, config: Config, generation: int) -> None:
        self.index = index
        self.channel = channel
        self.generation = generation
        self.feed = FeedConnection(channel)
        self.name = f"{index}; pid={os.getpid()}".encode()
        self.router = Router(
            config, metrics_page=self.scrape, answer_headers=((WORKER_HEADER, self.name),)
        )
        self.stop = trio.Event()
        self._ids = itertools.count(1)
        self._scrapes: dict[int, trio.MemorySendChannel[bytes]] = {}

    async def scrape(self) -> bytes:
        """Every live worker's page, merged by the parent; this one's alone if it cannot."""
        scrape_id = next(self._ids)
        send, receive = trio.open_memory_channel[bytes](1)
        self._scrapes[scrape_id] = send
        try:
            with trio.move_on_after(SCRAPE_TIMEOUT_S):
                await self.channel.send(SCRAPE, tagged(scrape_id))
                return await receive.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            del self._scrapes[scrape_id]
        log.warning("the parent sent no merged /metrics page: answering with this worker's")
        return merge_pages({str(self.index): self.router.render_metrics().decode()})

    async def read_channel(self) -> None:
        """Every frame from the parent, until it closes the channel (then: stop)."""
        try:
            while True:
                frames = await self.channel.receive()
                if not frames:
                    log.info("the parent is gone: stopping")
                    return
                for kind, payload in frames:
                    await self.on_frame(kind, payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            log.info("the channel to the parent broke: stopping")
        except ChannelError as exc:
            log.error("a bad frame from the parent (%s): stopping", exc)
        finally:
            self.feed.close()
            self.stop.set()

    async def on_frame(self, kind: bytes, payload: bytes) -> None:
        if kind == FEED:
            self.feed.deliver(payload)
        elif kind == RENDER:
            request_id, _ = untagged(payload)
            await self.channel.send(PAGE, tagged(request_id, self.router.render_metrics()))
        elif kind == MERGED:
            scrape_id, page = untagged(payload)
            waiting = self._scrapes.get(scrape_id)
            if waiting is not None:
                waiting.send_nowait(page)
        elif kind == CONFIG:
            generation, config = decode_config(payload)
            self.router.reload(config)
            self.generation = generation
            await self.channel.send(APPLIED, tagged(generation))
        else:
            raise ChannelError(f"a {kind!r} frame is not sent to workers")
