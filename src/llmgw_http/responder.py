"""What a handler writes its answer through: one protocol, one class per way of framing.

`Responder` is the protocol every handler sees (the router's RecordingResponder wraps
one). `H11Responder` answers on a connection h11 serves (TLS, and anything the plain
parser handed over): h11 frames the answer. `PlainResponder` answers on a plain TCP
socket read by the plain parser: the answer is framed here as h11 would frame it
(llmgw_http.h1) and written straight to the socket.
"""

from __future__ import annotations

import contextlib
import socket
from abc import abstractmethod

import h11
import trio

from llmgw_core.openai_errors import error_body
from llmgw_http import sockio
from llmgw_http.h1 import JSON, has_body_length, response_head

Headers = list[tuple[bytes, bytes]]


class Responder:
    """The protocol: a head then a body (`start`, `send` or `send_chunks`, `end`), or a
    whole answer at once (`whole`, `error`); `abort` cuts it off. (A plain base class,
    not an ABC: no metaclass on the request's path.)"""

    __slots__ = ("chunked", "closing", "head", "started")

    # A response started without a content-length goes to this client in chunked
    # framing (an HTTP/1.1 request that is not HEAD), as h11 would write it.
    chunked: bool
    closing: bool  # ask the client to close after this response
    head: bool  # a HEAD request: the head is sent, never a body
    started: bool

    @abstractmethod
    async def start(self, status: int, headers: Headers) -> None: ...

    @abstractmethod
    async def send(self, data: bytes) -> None: ...

    @abstractmethod
    async def end(self) -> None: ...

    @abstractmethod
    async def whole(self, status: int, body: bytes, headers: Headers = JSON) -> None: ...

    async def error(self, status: int, message: str) -> None:
        await self.whole(status, error_body(status, message))

    @abstractmethod
    async def send_chunks(self, framed: bytes) -> None:
        """Whole chunks already in chunked framing, relayed as they are.

        Only for a response started without a content-length to a client with
        `chunked` set: `end()` still writes the last chunk.
        """

    @abstractmethod
    async def abort(self) -> None:
        """Close the connection mid-answer: the client sees a truncated response."""

    @abstractmethod
    async def send_raw(self, data: bytes) -> None:
        """Bytes outside HTTP framing (the mock engine's garbage mode); then close."""


class H11Responder(Responder):
    """An answer framed by h11, on the connection's stream."""

    __slots__ = ("_conn", "_stream")

    def __init__(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        closing: bool,
        chunked: bool = False,
        head: bool = False,
    ) -> None:
        self._conn = conn
        self._stream = stream
        self.head = head
        self.closing = closing
        self.started = False
        self.chunked = chunked

    async def start(self, status: int, headers: Headers) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        head = self._conn.send(h11.Response(status_code=status, headers=headers))
        await self._stream.send_all(head)

    async def send(self, data: bytes) -> None:
        if not data or self.head:
            return
        await self._stream.send_all(self._conn.send(h11.Data(data=data)))

    async def end(self) -> None:
        await self._stream.send_all(self._conn.send(h11.EndOfMessage()))

    async def whole(self, status: int, body: bytes, headers: Headers = JSON) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        conn = self._conn
        out = conn.send(h11.Response(status_code=status, headers=headers))
        if not self.head:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        await self._stream.send_all(out)

    async def send_chunks(self, framed: bytes) -> None:
        # h11 keeps no count of chunked bodies: the framed bytes go out beside it.
        if self.head:
            return
        await self._stream.send_all(framed)

    async def abort(self) -> None:
        await self._stream.aclose()

    async def send_raw(self, data: bytes) -> None:
        self.started = True
        await self._stream.send_all(data)


class PlainResponder(Responder):
    """An answer framed here as h11 frames it, written straight to the socket."""

    __slots__ = ("_chunking", "_sock", "_stream", "done", "peer_closing")

    def __init__(
        self,
        sock: socket.socket,
        stream: trio.abc.Stream,
        closing: bool,
        chunked: bool = False,
        head: bool = False,
        peer_closing: bool = False,
    ) -> None:
        self._sock = sock  # the socket written to
        self._stream = stream  # for send_raw
        # The client asked to close (h11 says so in the answer's head).
        self.peer_closing = peer_closing
        self.head = head
        self.closing = closing
        self.started = False
        self.done = False  # the whole answer was written (the connection may be kept)
        self._chunking = False  # the answer is in chunked framing
        self.chunked = chunked

    async def start(self, status: int, headers: Headers) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        # As h11 frames it: a body of unknown length goes chunked (a HEAD answer's
        # headers are those of a GET), one with a content-length as it is.
        if not has_body_length(status, headers):
            headers = [*headers, (b"Transfer-Encoding", b"chunked")]
            self._chunking = True
        await sockio.send_all(self._sock, response_head(status, headers, self.peer_closing))

    async def send(self, data: bytes) -> None:
        if not data or self.head:
            return
        if self._chunking:
            await sockio.send_all(self._sock, b"%x\r\n%b\r\n" % (len(data), data))
        else:
            await sockio.send_all(self._sock, data)

    async def end(self) -> None:
        if self._chunking and not self.head:
            await sockio.send_all(self._sock, b"0\r\n\r\n")
        self.done = True

    async def whole(self, status: int, body: bytes, headers: Headers = JSON) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        head = response_head(status, headers, self.peer_closing)
        self.done = True
        await sockio.send_all(self._sock, head if self.head else head + body)

    async def send_chunks(self, framed: bytes) -> None:
        if self.head:
            return
        await sockio.send_all(self._sock, framed)

    async def abort(self) -> None:
        self.done = False
        # Shut down, not closed here: the connection's own task may be waiting on the
        # socket (for the client going away); it sees the end, and closes the socket.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    async def send_raw(self, data: bytes) -> None:
        self.started = True
        await self._stream.send_all(data)
