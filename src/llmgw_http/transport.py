"""The connect seam of the router's engine client (router/upstream.py): what a pool's
connection reads and writes through, and what opens one.

`tcp_connect` is the real one: a TCP connection whose stdlib socket is read and
written directly (sockio), as the router's hot path needs. `StreamTransport` puts
any trio stream in its place (httpcore's mock network backend is the model), so the
pool and its exchanges are tested by feeding bytes through memory streams, without
sockets, and under trio's autojump clock where a test is about time.
"""

from __future__ import annotations

import functools
import select
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from llmgw_http import sockio

Bytes = bytes | bytearray | memoryview


class Transport(Protocol):
    """One connection to an engine. Errors are trio's stream errors (or OSError)."""

    def send_now(self, data: Bytes, /) -> int:
        """What of `data` is sent at once, without waiting (0 when nothing could be)."""
        ...

    def send_all(self, data: Bytes, /) -> Awaitable[None]: ...

    def receive_some(self, max_bytes: int, /, *, wait_first: bool = False) -> Awaitable[bytes]:
        """One read (b"" at the end); `wait_first`: the last read drained the connection."""
        ...

    def receive_now(self, max_bytes: int, /) -> bytes:
        """One read of what is there already; BlockingIOError when nothing is."""
        ...

    def closed_by_peer(self) -> bool:
        """Whether an idle connection was closed by the engine (it has something to read)."""
        ...

    def close(self) -> None:
        """Closed at once, without waiting: a read or write waiting on it wakes."""
        ...


# Opens a connection to (host, port); OSError when it cannot.
Connector = Callable[[str, int], Awaitable[Transport]]


class SocketTransport:
    """A TCP connection, its socket read and written directly (no per-call trio pass).

    The reads and writes are sockio's functions bound to the socket (no method call of
    this class's own on the relay's path)."""

    __slots__ = ("receive_now", "receive_some", "send_all", "send_now", "sock", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        sock = sockio.raw_socket(stream)
        if sock is None:
            raise TypeError("not a plain TCP stream")
        self.stream = stream
        self.sock: socket.socket = sock
        self.send_now = functools.partial(sockio.send_now, sock)
        self.send_all = functools.partial(sockio.send_all, sock)
        self.receive_some = functools.partial(sockio.receive_some, sock)
        self.receive_now = sock.recv

    def closed_by_peer(self) -> bool:
        """An idle connection has nothing to read unless the engine closed it (or broke)."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        self.stream.socket.close()


async def tcp_connect(host: str, port: int) -> Transport:
    return SocketTransport(await trio.open_tcp_stream(host, port))


class StreamTransport:
    """Any trio stream as a Transport: every read and write waits through trio.

    `close` cancels what waits on it and calls `on_close` (a memory stream's own sync
    close, say, so the peer sees the end), since a trio stream closes only by awaiting.
    An idle connection's close by the peer is not seen before a request is sent on it.
    """

    def __init__(self, stream: trio.abc.Stream, on_close: Callable[[], object] = lambda: None):
        self._stream = stream
        self._on_close = on_close
        self._waiting: set[trio.CancelScope] = set()
        self.closed = False

    def send_now(self, data: Bytes, /) -> int:
        return 0  # a trio stream only sends by awaiting: everything goes through send_all

    async def send_all(self, data: Bytes, /) -> None:
        if self.closed:
            raise trio.ClosedResourceError("the connection was closed")
        with trio.CancelScope() as scope:
            self._waiting.add(scope)
            try:
                await self._stream.send_all(data)
                return
            finally:
                self._waiting.discard(scope)
        raise trio.ClosedResourceError("the connection was closed")

    async def receive_some(self, max_bytes: int, /, *, wait_first: bool = False) -> bytes:
        if self.closed:
            raise trio.ClosedResourceError("the connection was closed")
        with trio.CancelScope() as scope:
            self._waiting.add(scope)
            try:
                return bytes(await self._stream.receive_some(max_bytes))
            finally:
                self._waiting.discard(scope)
        raise trio.ClosedResourceError("the connection was closed")

    def receive_now(self, max_bytes: int, /) -> bytes:
        raise BlockingIOError  # nothing is read without waiting

    def closed_by_peer(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for scope in self._waiting:
            scope.cancel()
        self._on_close()



def memory_pair() -> tuple[StreamTransport, trio.abc.HalfCloseableStream]:
    """A Transport over trio's in-memory streams, and the engine's end of it: what the
    engine's end sends is read by the transport, and closing either end is seen by the
    other (for tests: an engine without sockets)."""
    import trio.testing  # here: only tests pay for importing it

    ours, engine = trio.testing.memory_stream_pair()

    def close() -> None:
        ours.send_stream.close()
        ours.receive_stream.close()

    return StreamTransport(ours, on_close=close), engine
