"""HTTP/1.1 served with h11 directly on trio streams.

Both the router and the mock engine serve through this: it reads a request
head and body within their time limits, runs the handler while watching the
client socket (a client that goes away cancels the handler at once), and
writes whatever the handler sends, streamed or whole.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import h11
import trio

from llmgw_core.openai_errors import error_body
from llmgw_core.ratelog import RateLimit
from llmgw_http import coarse_timeouts, sockio
from llmgw_http.tls_admission import Gate, Ticket

log = logging.getLogger(__name__)

_RECV = 65536
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
JSON = [(b"content-type", b"application/json")]
# A request body's first seconds are not held to `min_body_rate` (a client's first write
# may wait on its own start); from then on it is checked this often.
BODY_RATE_GRACE_S = 5.0
BODY_RATE_CHECK_S = 1.0
# Past its first pieces, a request body (its chunks, or what each read brings) must
# average this many bytes a piece: h11's cost is per piece, and 1-byte chunks would
# spend most of a core on a body that meets any byte rate.
BODY_FREE_PIECES = 1024
BODY_PIECE_MIN_AVERAGE = 64
# Where h11 ends a request head (it also takes bare LF line ends).
_HEAD_END = re.compile(rb"\n\r?\n")


@attrs.frozen
class ServerLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    # Connections on plain listeners served at once; past it a new one is answered 503
    # and closed. None: no limit.
    max_connections: int | None = None
    # A request body must average at least this many bytes/s since its start, from
    # BODY_RATE_GRACE_S on (408 otherwise); 0: no minimum.
    min_body_rate: int = 1024


@attrs.define(slots=True)
class Request:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased by h11
    body: bytes = b""
    http_version: bytes = b"1.1"
    # Set by the server's head check (HTTPServer's check_head), for the handler: the
    # digest of the client's credential (the router's: its API key), None if it sent none.
    credential: str | None = None
    head_checked: bool = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def path(self) -> bytes:
        return self.target.partition(b"?")[0]


class RequestRejected(Exception):
    """Raised by the server itself for a request it will not hand to the handler."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Upgrade(Exception):
    def __init__(self, request: Request) -> None:
        self.request = request


class Responder:
    """What a handler writes its answer through.

    On a connection served by h11 (`conn`), h11 frames the answer; on one served by
    the plain parser (`conn` None, a plain TCP socket), the answer is framed here as
    h11 would frame it and written straight to the socket.
    """

    __slots__ = (
        "_chunking",
        "_conn",
        "_sock",
        "_stream",
        "chunked",
        "closing",
        "done",
        "head",
        "peer_closing",
        "started",
    )

    def __init__(
        self,
        conn: h11.Connection | None,
        stream: trio.abc.Stream,
        closing: bool,
        chunked: bool = False,
        head: bool = False,
        sock: socket.socket | None = None,
        peer_closing: bool = False,
    ) -> None:
        self._conn = conn
        self._stream = stream
        self._sock = sock  # with conn None: the socket written to
        # With conn None: the client asked to close (h11 says so in the answer's head).
        self.peer_closing = peer_closing
        self.head = head  # a HEAD request: the head is sent, never a body
        self.closing = closing  # ask the client to close after this response
        self.started = False
        self.done = False  # the whole answer was written (the plain parser's keep-alive)
        self._chunking = False  # the plain parser's answer is in chunked framing
        # A response started without a content-length goes to this client in
        # chunked framing (an HTTP/1.1 request that is not HEAD), as h11 would write it.
        self.chunked = chunked

    async def _write(self, data: bytes) -> None:
        if self._sock is not None:
            await sockio.send_all(self._sock, data)
        else:
            await self._stream.send_all(data)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        if self._conn is not None:
            await self._stream.send_all(
                self._conn.send(h11.Response(status_code=status, headers=headers))
            )
            return
        # As h11 frames it: a body of unknown length goes chunked (a HEAD answer's
        # headers are those of a GET), one with a content-length as it is.
        if not _has_body_length(status, headers):
            headers = [*headers, (b"Transfer-Encoding", b"chunked")]
            self._chunking = True
        await self._write(_response_head(status, headers, self.peer_closing))

    async def send(self, data: bytes) -> None:
        if not data or self.head:
            return
        if self._conn is not None:
            await self._stream.send_all(self._conn.send(h11.Data(data=data)))
        elif self._chunking:
            await self._write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            await self._write(data)

    async def end(self) -> None:
        if self._conn is not None:
            await self._stream.send_all(self._conn.send(h11.EndOfMessage()))
            return
        if self._chunking and not self.head:
            await self._write(b"0\r\n\r\n")
        self.done = True

    async def whole(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON
    ) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        conn = self._conn
        if conn is None:
            head = _response_head(status, headers, self.peer_closing)
            self.done = True
            await self._write(head if self.head else head + body)
            return
        out = conn.send(h11.Response(status_code=status, headers=headers))
        if not self.head:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        await self._stream.send_all(out)

    async def error(self, status: int, message: str) -> None:
        await self.whole(status, error_body(status, message))

    async def send_chunks(self, framed: bytes) -> None:
        """Whole chunks already in chunked framing, relayed as they are.

        Only for a response started without a content-length to a client with
        `chunked` set: h11 keeps no count of chunked bodies, so `end()` still
        writes the last chunk.
        """
        if self.head:
            return
        if self._sock is not None:  # _write, inlined: this runs once per relayed read
            await sockio.send_all(self._sock, framed)
        else:
            await self._stream.send_all(framed)

    async def abort(self) -> None:
        """Close the connection mid-answer: the client sees a truncated response."""
        self.done = False
        if self._sock is not None:
            # Shut down, not closed here: the connection's own task may be waiting on the
            # socket (for the client going away); it sees the end, and closes the socket.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            return
        await self._stream.aclose()

    async def send_raw(self, data: bytes) -> None:
        """Bytes outside HTTP framing (the mock engine's garbage mode); then close."""
        self.started = True
        await self._stream.send_all(data)


def _has_body_length(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer's end is known without chunked framing (h11's _body_framing)."""
    if status < 200 or status in (204, 304):
        return True
    return any(name == b"content-length" for name, _ in headers)


def _response_head(
    status: int, headers: list[tuple[bytes, bytes]], peer_closing: bool = False
) -> bytes:
    """The status line and headers, written as h11 writes them (no reason phrase; to a
    client that asked to close, its Connection header values, close among them, last)."""
    if peer_closing:
        tokens = {b"close"}
        kept = []
        for name, value in headers:
            if name.lower() == b"connection":
                tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
            else:
                kept.append((name, value))
        tokens.discard(b"keep-alive")
        headers = [*kept, *((b"Connection", t) for t in sorted(tokens))]
    lines = [b"HTTP/1.1 %d \r\n" % status]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _refusal(status: int, message: str, headers: list[tuple[bytes, bytes]] = JSON) -> bytes:
    """A whole answer that closes the connection, as the server writes its own refusals."""
    body = error_body(status, message)
    length = (b"content-length", str(len(body)).encode())
    return _response_head(status, [*headers, length, (b"connection", b"close")]) + body


_TOO_MANY_MESSAGE = "the server has as many connections as it may serve (max_connections)"
_TOO_MANY = _refusal(503, _TOO_MANY_MESSAGE, [*JSON, (b"retry-after", b"1")])

Handler = Callable[[Request, Responder], Awaitable[None]]
# Called with a request's head before its body is read: True to read the body; False
# to run the handler on the head alone (its body empty), which answers it (a refusal),
# and then close the connection with the body unread.
HeadCheck = Callable[[Request], bool]
UpgradeHandler = Callable[[Request, trio.abc.Stream], Awaitable[None]]


class ReplayStream(trio.abc.Stream):
    """A socket stream that first gives back bytes already read from it.

    An upgraded connection (a websocket) is handed over with the request head
    replayed, so the websocket library performs its own handshake.
    """

    def __init__(self, replay: bytes, stream: trio.abc.Stream) -> None:
        self._replay = replay
        transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        self.socket = getattr(transport, "socket", None)  # lets the peer be named
        self._stream = stream

    def peer_certificate(self) -> dict[str, Any] | None:
        """The client's verified certificate on a TLS connection, else None."""
        if isinstance(self._stream, trio.SSLStream):
            cert: dict[str, Any] | None = self._stream.getpeercert()
            return cert
        return None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._replay:
            data, self._replay = self._replay, b""
            await trio.lowlevel.checkpoint()
            return data
        return bytes(await self._stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


class HTTPServer:
    """Serves one handler on any number of listeners; `draining` closes idle keep-alives."""

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits,
        upgrade: UpgradeHandler | None = None,
        ssl_context: ssl.SSLContext | None = None,
        on_reject: Callable[[int, str], None] | None = None,
        check_head: HeadCheck | None = None,
    ) -> None:
        self.handler = handler
        self.check_head = check_head
        # Told of each request refused before the handler (413, 408, malformed).
        self.on_reject = on_reject
        self.limits = limits
        self.ssl_context = ssl_context  # TLS on every accepted connection
        self.upgrade = upgrade  # takes over connections that ask for `Upgrade: websocket`
        self.draining = False
        self.busy = 0  # connections inside a request, for graceful shutdown
        self.idle_done = trio.Event()
        self._idle_scopes: set[trio.CancelScope] = set()
        self._accepting = trio.CancelScope()
        self.tls_failures = 0  # failed TLS handshakes, for metrics
        self.tls_abandoned = 0  # closed before a handshake: the client left, or it waited too long
        self.plain_connections = 0  # served now on plain listeners (limits.max_connections)
        self.tls_admission = Gate()  # who may begin a TLS handshake (tls_admission.py)
        self.tls_failures_log = RateLimit(60.0)

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on every listener until `shutdown`; returns when every connection has ended."""
        async with trio.open_nursery() as connections:
            with self._accepting:
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(self._accept_loop, listener, connections)
                    task_status.started(listeners)
            for listener in listeners:
                await listener.aclose()

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                    log.error("accept failed (%s); retrying in 100 ms", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            if self.ssl_context is None:
                limit = self.limits.max_connections
                if limit is not None and self.plain_connections >= limit:
                    self._turn_away(stream)
                    continue
                self.plain_connections += 1
                connections.start_soon(self._serve_plain, stream)
            else:
                # Refused here (reset, before any SSL object) when it cannot be served.
                ticket = self.tls_admission.admit(stream)
                if ticket is not None:
                    connections.start_soon(self._serve_tls, ticket, self.ssl_context)

    def _turn_away(self, stream: trio.SocketStream) -> None:
        """A connection past max_connections: a fixed 503 written if the socket takes it
        at once, then closed, without reading anything or starting a task."""
        if self.on_reject is not None:
            self.on_reject(503, _TOO_MANY_MESSAGE)
        sock = sockio.raw_socket(stream)
        if sock is not None:
            try:
                sock.send(_TOO_MANY)
            except OSError:
                pass
        stream.socket.close()

    async def _serve_plain(self, stream: trio.SocketStream) -> None:
        try:
            await self.serve_connection(stream)
        finally:
            self.plain_connections -= 1

    async def _serve_tls(self, ticket: Ticket, context: ssl.SSLContext) -> None:
        """The TLS handshake first, within the connection's deadline (3 s from its arrival,
        see tls_admission), so that a failed one is logged with the peer's address
        (rate-limited per peer host and reason: a fleet with the wrong CA must not flood
        the log)."""
        failure: BaseException | None = None
        tls: trio.SSLStream[Any] | None = None
        try:
            with ticket.scope as handshake:
                try:
                    tls = await self.tls_admission.handshake(ticket, context)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    failure = exc.__cause__ or exc
        finally:
            self.tls_admission.leave(ticket)
        if failure is None and not handshake.cancelled_caught:
            if tls is None:  # the client left, or was shed: closed, no handshake spent
                self.tls_abandoned += 1
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.tls_admission.hold_place, tls)
                await self.serve_connection(tls)
                nursery.cancel_scope.cancel()
            return
        host, peer = _peer_address(ticket.stream)
        await trio.aclose_forcefully(ticket.stream)
        if failure is None:
            deadline_s = self.tls_admission.core.limits.deadline_s
            level, why = logging.INFO, f"no handshake within {deadline_s:g} s"
        elif isinstance(failure, ssl.SSLCertVerificationError):
            level = logging.WARNING
            why = f"the client's certificate is not trusted ({failure.verify_message})"
        elif isinstance(failure, ssl.SSLError) and not isinstance(failure, ssl.SSLEOFError):
            level = logging.WARNING
            why = (failure.reason or str(failure)).lower().replace("_", " ")
            if why == "http request":
                why = "plaintext HTTP on a TLS port (http request)"
        else:
            level = logging.INFO  # also what a port probe or a TCP health check does
            why = "the peer closed the connection (as a client that does not trust us does)"
        held = self.tls_failures_log.allow((host, why), trio.current_time())
        self.tls_failures += 1
        if held is not None:
            more = f" ({held} more like it from {host} held back)" if held else ""
            log.log(level, "TLS handshake with %s failed: %s%s", peer, why, more)

    async def shutdown(self, grace_s: float) -> bool:
        """Stop accepting, close idle keep-alives, wait up to `grace_s` for requests in flight.

        Returns True when every request finished in time.
        """
        self._accepting.cancel()
        self.draining = True
        for scope in self._idle_scopes:
            scope.cancel()
        if self.busy == 0:
            self.idle_done.set()
        with trio.move_on_after(grace_s):
            await self.idle_done.wait()
            return True
        return False

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        try:
            sock = sockio.raw_socket(stream)
            if sock is None:  # TLS: h11 on the decrypted stream
                await _Connection(self, stream).run()
            else:
                assert isinstance(stream, trio.SocketStream)  # as raw_socket found it
                await _PlainConnection(self, stream, sock).run()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except Exception:
            log.exception("connection handler failed")
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()


def _peer_address(stream: trio.SocketStream) -> tuple[str, str]:
    """The peer's host, and its host:port for the log."""
    try:
        host, port, *_ = stream.socket.getpeername()
    except (OSError, ValueError):
        return "?", "an unknown peer"
    return str(host), f"{host}:{port}"


def _unparsed(conn: h11.Connection) -> int:
    """The bytes h11 holds unparsed (it has no public count; trailing_data copies them)."""
    return len(conn._receive_buffer)


def _head_too_large(limits: ServerLimits) -> str:
    return f"request head exceeds the limit of {limits.max_header_bytes} bytes"


def _too_slow(limits: ServerLimits) -> str:
    return f"request body arrived slower than the minimum of {limits.min_body_rate} bytes/s"


def pieces_too_small(pieces: int, received: int) -> bool:
    """Whether a request body that came in `pieces` h11 events is cut for its overhead."""
    return pieces > BODY_FREE_PIECES and received < BODY_PIECE_MIN_AVERAGE * pieces


def body_too_slow(received: int, elapsed_s: float, min_rate: int) -> bool:
    """Whether a request body that brought `received` bytes in its first `elapsed_s` is
    cut: past the grace, it must have averaged `min_rate` bytes/s since its start."""
    return elapsed_s >= BODY_RATE_GRACE_S and received < min_rate * elapsed_s


class _BodyPace:
    """A body's pace, checked on the coarse timer wheel (no trio deadline, nothing per
    read but setting `received`): first after the grace, then each BODY_RATE_CHECK_S;
    one too slow has its scope cancelled and `slow` set."""

    __slots__ = ("_min_rate", "_scope", "_started", "received", "slow")

    def __init__(self, scope: trio.CancelScope, min_rate: int, received: int) -> None:
        self._scope = scope
        self._min_rate = min_rate
        self._started = trio.current_time()
        self.received = received  # body bytes read so far
        self.slow = False
        coarse_timeouts.arm(self, self._started + BODY_RATE_GRACE_S)

    def cancel(self) -> None:  # the wheel calls it when due
        now = trio.current_time()
        if body_too_slow(self.received, now - self._started, self._min_rate):
            self.slow = True
            self._scope.cancel()
        else:
            coarse_timeouts.arm(self, now + BODY_RATE_CHECK_S)


class _Connection:
    """One client connection: a reader task owns the socket's receiving side.

    The reader reads only when allowed (the request loop needs bytes, or a
    handler runs and the client's end must be watched), so a client that
    pipelines without reading answers cannot make the server buffer without
    bound. When the client goes away while a handler runs, the reader cancels
    the handler at once; no task is started per request.
    """

    def __init__(
        self,
        server: HTTPServer,
        stream: trio.abc.Stream,
        received: bytes = b"",
        first: bool = True,
    ) -> None:
        self.server = server
        self.stream = stream
        self.first = first  # no request was answered on this connection yet
        self.conn = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.limits.max_header_bytes
        )
        # Bytes read already by the plain parser, which handed the connection over.
        if received:
            self.conn.receive_data(received)
        # Bytes of the first request head, kept only where an upgrade may need them.
        self.raw: bytearray | None = (
            bytearray(received) if server.upgrade and first else None
        )
        self._may_read = trio.Event()
        self._arrived = trio.Event()
        self._eof = False
        self._handler_scope: trio.CancelScope | None = None
        self._fed = 0  # bytes given to h11, to measure a request head
        self._head_only = False  # the head check refused the request: its body is not read

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            reader = trio.CancelScope()
            nursery.start_soon(self._reader, reader)
            try:
                await self._serve(reader)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                pass  # the client went away: nothing to log
            finally:
                nursery.cancel_scope.cancel()

    async def _reader(self, scope: trio.CancelScope) -> None:
        with scope:
            while True:
                await self._may_read.wait()
                self._may_read = trio.Event()
                try:
                    data = bytes(await self.stream.receive_some(_RECV))
                except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                    data = b""
                if self.raw is not None:
                    self.raw += data
                self._fed += len(data)
                self.conn.receive_data(data)  # b"" tells h11 the client closed
                self._arrived.set()
                if not data:
                    self._eof = True
                    if self._handler_scope is not None:
                        self._handler_scope.cancel()
                    return
                if self._handler_scope is not None:
                    await self._watch_unread()

    async def _watch_unread(self) -> None:
        """Bytes came while a handler runs: no more are read until it ends, and the
        client's leaving is seen in its socket's TCP state instead, once a tick."""
        stream = self.stream
        transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        if not isinstance(transport, trio.SocketStream):
            return
        while self._handler_scope is not None and not self._may_read.is_set():
            if sockio.peer_left(transport.socket):
                self._handler_scope.cancel()
                return
            with trio.move_on_after(coarse_timeouts.TICK_S):
                await self._may_read.wait()

    async def _next_event(self) -> Any:
        conn = self.conn
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                self._arrived = trio.Event()
                self._may_read.set()
                await self._arrived.wait()
                continue
            return event

    async def _serve(self, reader: trio.CancelScope) -> None:
        server = self.server
        first = self.first
        while not server.draining:
            try:
                request = await self._read_request(first)
            except _Upgrade as upgrade:
                assert server.upgrade is not None and self.raw is not None
                reader.cancel()  # the upgrade handler reads the socket from here on
                await trio.lowlevel.checkpoint()
                await server.upgrade(upgrade.request, ReplayStream(bytes(self.raw), self.stream))
                return
            except RequestRejected as exc:
                await self._reject(exc.status, exc.message)
                return
            except h11.RemoteProtocolError as exc:
                await self._reject(exc.error_status_hint, f"malformed request: {exc}")
                return
            if request is None:
                return
            first = False
            server.busy += 1
            try:
                await self._respond(request)
            finally:
                server.busy -= 1
                if server.draining and server.busy == 0:
                    server.idle_done.set()
            if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                return
            try:
                self.conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _read_request(self, first: bool) -> Request | None:
        limits = self.server.limits
        if not first:
            # An idle keep-alive connection may be closed by drain() or time out;
            # one inside a request may not.
            idle_scope = trio.CancelScope(deadline=trio.current_time() + limits.keepalive_timeout_s)
            self.server._idle_scopes.add(idle_scope)
            try:
                with idle_scope:
                    while not self.conn.trailing_data[0] and not self._eof:
                        self._arrived = trio.Event()
                        self._may_read.set()
                        await self._arrived.wait()
            finally:
                self.server._idle_scopes.discard(idle_scope)
            if idle_scope.cancelled_caught:
                return None
        unparsed, fed = _unparsed(self.conn), self._fed
        with trio.move_on_after(limits.header_timeout_s) as head_scope:
            event = await self._next_event()
        if head_scope.cancelled_caught:
            raise RequestRejected(408, "request headers did not arrive in time")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise RequestRejected(400, "expected a request")
        # h11 limits only a head it is still waiting for; one that came whole is measured.
        if unparsed + self._fed - fed - _unparsed(self.conn) > limits.max_header_bytes:
            raise RequestRejected(431, _head_too_large(limits))
        request = Request(
            method=event.method,
            target=event.target,
            headers=list(event.headers),
            http_version=event.http_version,
        )
        if self.raw is not None and (request.header(b"upgrade") or b"").lower() == b"websocket":
            raise _Upgrade(request)
        self.raw = None
        framing = request.header(b"transfer-encoding"), request.header(b"content-length")
        if None not in framing:
            # RFC 9112 section 6.1: a server must at least close such a connection.
            raise RequestRejected(
                400, "a request with both Transfer-Encoding and Content-Length is ambiguous"
            )
        check = self.server.check_head
        if check is not None and not check(request):
            self._head_only = True
            return request
        request.body = await self._read_body(request)
        return request

    async def _read_body(self, request: Request) -> bytes:
        limits = self.server.limits
        length = request.header(b"content-length")
        if length is not None and int(length) > limits.max_body_bytes:
            raise RequestRejected(
                413,
                f"request body of {int(length)} bytes exceeds the limit of {limits.max_body_bytes}",
            )
        if self.conn.they_are_waiting_for_100_continue:
            await self.stream.send_all(
                self.conn.send(h11.InformationalResponse(status_code=100, headers=[]))
            )
        chunks: list[bytes] = []
        size = 0
        pieces = 0
        with trio.move_on_after(limits.body_timeout_s) as scope:
            pace = _BodyPace(scope, limits.min_body_rate, 0) if limits.min_body_rate else None
            try:
                while True:
                    event = await self._next_event()
                    if isinstance(event, h11.Data):
                        size += len(event.data)
                        if size > limits.max_body_bytes:
                            raise RequestRejected(
                                413,
                                f"request body exceeds the limit of {limits.max_body_bytes} bytes",
                            )
                        chunks.append(bytes(event.data))
                        pieces += 1
                        if pieces_too_small(pieces, size):
                            raise RequestRejected(
                                400,
                                "request body in pieces too small: past the first "
                                f"{BODY_FREE_PIECES}, they must average "
                                f"{BODY_PIECE_MIN_AVERAGE} bytes",
                            )
                        if pace is not None:
                            pace.received = size
                    elif isinstance(event, h11.EndOfMessage):
                        return b"".join(chunks)
                    elif isinstance(event, h11.ConnectionClosed):
                        raise trio.BrokenResourceError("client closed during the body")
            finally:
                if pace is not None:
                    coarse_timeouts.disarm(pace)
        assert scope.cancelled_caught
        if pace is not None and pace.slow:
            raise RequestRejected(408, _too_slow(limits))
        raise RequestRejected(408, "request body did not arrive in time")

    async def _respond(self, request: Request) -> None:
        responder = Responder(
            self.conn,
            self.stream,
            closing=self.server.draining or self._head_only,
            chunked=request.http_version == b"1.1" and request.method != b"HEAD",
            head=request.method == b"HEAD",
        )
        if self._eof:
            raise trio.BrokenResourceError("the client went away")
        self._may_read.set()  # watch the client's end while the handler runs
        returned = broken = False
        with trio.CancelScope() as scope:
            self._handler_scope = scope
            try:
                await self.server.handler(request, responder)
                returned = True
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                broken = True
            except Exception:
                log.exception("handler failed on %s %s", request.method, request.target)
                returned = True
            finally:
                self._handler_scope = None
        if broken or scope.cancelled_caught:
            raise trio.BrokenResourceError("the client went away")
        if returned and not responder.started:
            await responder.error(500, "internal error: the handler sent no response")

    async def _reject(self, status: int, message: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        if self.server.on_reject is not None:
            self.server.on_reject(status, message)
        body = error_body(status, message)
        try:
            out = self.conn.send(
                h11.Response(
                    status_code=status,
                    headers=[
                        *JSON,
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                )
            )
            out += self.conn.send(h11.Data(data=body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        with trio.move_on_after(2):
            await self.stream.send_all(out)


_REQUEST_LINE = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/1\.1")
_DIGITS = re.compile(rb"[0-9]{1,18}")
# Requests the plain parser leaves to h11: their framing or semantics need its state machine.
_TO_H11 = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# Every field line at once (one match instead of two per line): a name, a colon, a value
# with nothing h11 would refuse. A head it does not match goes to h11 whole.
_FIELDS = re.compile(rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[^\x00\r\n\x0b\x0c]*(?:\r\n|\Z))+")
_SPECIAL = frozenset({b"content-length", b"host", b"connection", *_TO_H11})


def _plain_request(head: bytes) -> tuple[Request, int, bool] | None:
    """(request, content length, whether the client asked to close) of a request head
    that the plain parser serves: HTTP/1.1, one Host, at most one Content-Length, no
    Transfer-Encoding, Expect or Upgrade, nothing h11 would refuse or read otherwise.
    None: h11 reads it (and refuses it with its own words where it is malformed)."""
    line_end = head.find(b"\r\n")
    if line_end < 0:
        return None  # no Host
    match = _REQUEST_LINE.fullmatch(head, 0, line_end)
    if match is None or not _FIELDS.fullmatch(head, line_end + 2):
        return None  # also an obsolete folded line (it starts with a space)
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    hosts = 0
    close = False
    for line in head[line_end + 2 :].split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        if name in _SPECIAL:
            if name in _TO_H11:
                return None
            if name == b"content-length":
                if length >= 0 or not _DIGITS.fullmatch(value):
                    return None
                length = int(value)
            elif name == b"host":
                hosts += 1
            else:
                close = close or any(t.strip().lower() == b"close" for t in value.split(b","))
        headers.append((name, value))
    if hosts != 1:
        return None
    request = Request(method=match.group(1), target=match.group(2), headers=headers)
    return request, max(length, 0), close


class _SetWhenDue:
    """What coarse_timeouts calls when a handler has run for a tick: wake the watcher."""

    __slots__ = ("_conn",)

    def __init__(self, conn: _PlainConnection) -> None:
        self._conn = conn

    def cancel(self) -> None:
        self._conn._watch.set()


class _PlainConnection:
    """One client connection on a plain TCP socket, read without h11 while it can be.

    Requests as clients send them (a whole HTTP/1.1 head in one read, a Content-Length
    body) are parsed here and answered straight onto the socket; the first request that
    is anything else (a head in pieces, chunked, HTTP/1.0, Expect, an upgrade, anything
    malformed) hands the connection with every byte read to `_Connection`, which serves
    it with h11 from then on, as before.

    The serving task reads the socket itself while it waits for a request. A handler
    that runs longer than a tick (coarse_timeouts) wakes a watcher task, which waits
    on the socket for the client going away (then the connection's scope is cancelled,
    the handler with it) until the handler ends. A short answer so costs no second
    task's wake-ups; a long one (any real engine's) is cut off within a tick of the
    client leaving. Bytes that come during a handler are kept and no more are read
    until it ends, so a client that pipelines without reading cannot make the server
    buffer without bound. The connection's one cancel scope is also its timer: the
    keep-alive idle limit, then the head's or body's.
    """

    def __init__(self, server: HTTPServer, stream: trio.SocketStream, sock: socket.socket) -> None:
        self.server = server
        self.stream = stream
        self.sock = sock
        self.buf = b""  # read and not yet parsed
        self.eof = False
        self.in_handler = False
        self._watch = trio.Event()  # set when a handler has run for a tick
        self._watch_due = _SetWhenDue(self)
        self._watching: trio.CancelScope | None = None  # the watcher's wait on the socket
        self._scope = trio.CancelScope()
        self._waiting_for = ""  # what the timer would cut: "idle", "head" or "body"
        self._pace: _BodyPace | None = None  # the last body's pace, if it was waited for
        self._served = 0

    async def run(self) -> None:
        handover: bytes | None = None
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watcher)
                try:
                    handover = await self._serve()
                except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
                    pass  # the client went away: nothing to log
                finally:
                    nursery.cancel_scope.cancel()
        coarse_timeouts.disarm(self._scope)
        coarse_timeouts.disarm(self._watch_due)
        self.server._idle_scopes.discard(self._scope)
        if self._scope.cancelled_caught:
            if self._waiting_for == "head":
                await self._reject(408, "request headers did not arrive in time")
            elif self._waiting_for == "body":
                if self._pace is not None and self._pace.slow:
                    await self._reject(408, _too_slow(self.server.limits))
                else:
                    await self._reject(408, "request body did not arrive in time")
            return
        if handover is not None:
            await _Connection(self.server, self.stream, handover, first=not self._served).run()

    def _take(self) -> bool:
        """One read of what the socket holds into `buf` (its end sets `eof`); False if
        it held nothing after all."""
        try:
            data = self.sock.recv(_RECV)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if data:
            self.buf += data
        else:
            self.eof = True
        return True

    async def _more(self) -> None:
        """Read what the client sends next (the serving task, between handlers)."""
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            if self._take():
                return

    async def _watcher(self) -> None:
        """While a handler runs past a tick: the client going away cancels it."""
        while True:
            await self._watch.wait()
            self._watch = trio.Event()
            while self.in_handler and not self.eof:
                if self.buf:
                    # Pipelined bytes are kept and no more read: the client's leaving is
                    # seen in its socket's TCP state instead, once a tick.
                    if sockio.peer_left(self.stream.socket):
                        self._scope.cancel()
                    else:
                        now = trio.current_time()
                        coarse_timeouts.arm(self._watch_due, now + coarse_timeouts.TICK_S)
                    break
                with trio.CancelScope() as self._watching:
                    await trio.lowlevel.wait_readable(self.sock)
                self._watching = None
                if not self.in_handler:  # it ended as this woke: the bytes are _more's
                    break
                # Bytes read here are pipelined: kept until the handler ends.
                if self._take() and self.eof:
                    self._scope.cancel()  # the client went away: the handler stops

    async def _serve(self) -> bytes | None:
        """Answer requests until the connection ends; the bytes to hand to h11, if it must."""
        server = self.server
        limits = server.limits
        scope = self._scope
        while not server.draining:
            if not self.buf:
                if self.eof:
                    return None
                # An idle keep-alive connection may be closed by drain() or time out;
                # the first request's head has the head's time limit from the start.
                if self._served:
                    self._waiting_for = "idle"
                    coarse_timeouts.arm(scope, trio.current_time() + limits.keepalive_timeout_s)
                    server._idle_scopes.add(scope)
                else:
                    self._waiting_for = "head"
                    coarse_timeouts.arm(scope, trio.current_time() + limits.header_timeout_s)
                await self._more()
                server._idle_scopes.discard(scope)
                if not self.buf:
                    return None
            end = self.buf.find(b"\r\n\r\n", 0, limits.max_header_bytes)
            parsed = _plain_request(self.buf[:end]) if end >= 0 else None
            if parsed is None:
                too_large = end < 0 and len(self.buf) >= limits.max_header_bytes
                if too_large and not _HEAD_END.search(self.buf, 0, limits.max_header_bytes):
                    coarse_timeouts.disarm(scope)
                    await self._reject(431, _head_too_large(limits))
                    return None
                return self.buf
            request, length, close = parsed
            check = server.check_head
            head_only = check is not None and not check(request)
            if head_only:
                length = 0  # answered from the head; the connection closes unread
            elif length > limits.max_body_bytes:
                message = (
                    f"request body of {length} bytes exceeds the limit of {limits.max_body_bytes}"
                )
                coarse_timeouts.disarm(scope)
                await self._reject(413, message)
                return None
            start = end + 4
            if len(self.buf) - start < length and not await self._body(start, start + length):
                return None  # the client closed during the body
            request.body = self.buf[start : start + length]
            self.buf = self.buf[start + length :]
            self._waiting_for = ""
            coarse_timeouts.disarm(scope)
            responder = Responder(
                None,
                self.stream,
                closing=server.draining or head_only,
                chunked=request.method != b"HEAD",
                head=request.method == b"HEAD",
                sock=self.sock,
                peer_closing=close,
            )
            self._served += 1
            server.busy += 1
            try:
                await self._respond(request, responder)
            finally:
                server.busy -= 1
                if server.draining and server.busy == 0:
                    server.idle_done.set()
            if not responder.done or responder.closing or close:
                return None
        return None

    async def _body(self, start: int, end: int) -> bool:
        """Read until `buf` holds `end` bytes (the body from `start`), within the body's
        time limit and pace; False if the client closed first. Linear in the body's size:
        the reads are joined once, not added to `buf` one by one."""
        limits = self.server.limits
        self._waiting_for = "body"
        coarse_timeouts.arm(self._scope, trio.current_time() + limits.body_timeout_s)
        have = len(self.buf)
        pace = None
        if limits.min_body_rate:
            pace = self._pace = _BodyPace(self._scope, limits.min_body_rate, have - start)
        parts = [self.buf]
        sock = self.sock
        try:
            while have < end:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = sock.recv(_RECV)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.eof = True
                    return False
                parts.append(data)
                have += len(data)
                if pace is not None:
                    pace.received = have - start
        finally:
            self.buf = b"".join(parts)
            if pace is not None:
                coarse_timeouts.disarm(pace)
        return True

    async def _respond(self, request: Request, responder: Responder) -> None:
        if self.eof:
            # The client closed (or half-closed) after its request: as with h11, the
            # handler starts and is cancelled at its first wait, so that only an answer
            # ready at once still goes out.
            self._scope.cancel()
        self.in_handler = True
        coarse_timeouts.arm(self._watch_due, trio.current_time())
        try:
            await self.server.handler(request, responder)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            raise trio.BrokenResourceError("the client went away") from None
        except Exception:
            log.exception("handler failed on %s %s", request.method, request.target)
        finally:
            self.in_handler = False
            coarse_timeouts.disarm(self._watch_due)
            if self._watching is not None:  # the socket is the serving task's again
                self._watching.cancel()
        if not responder.started:
            await responder.error(500, "internal error: the handler sent no response")

    async def _reject(self, status: int, message: str) -> None:
        if self.server.on_reject is not None:
            self.server.on_reject(status, message)
        body = error_body(status, message)
        headers = [*JSON, (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        with trio.move_on_after(2):
            try:
                await sockio.send_all(self.sock, _response_head(status, headers) + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
