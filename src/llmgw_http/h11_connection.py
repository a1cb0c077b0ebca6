"""A client connection served with h11: TLS connections, and whatever the plain parser
hands over (a head in pieces, chunked, HTTP/1.0, Expect, an upgrade, anything malformed).
"""

from __future__ import annotations

import re
from typing import Any

import h11
import trio

from llmgw_core.openai_errors import error_body
from llmgw_http import coarse_timeouts, serving, sockio
from llmgw_http.h1 import JSON
from llmgw_http.limits import (
    BODY_FREE_PIECES,
    BODY_PIECE_MIN_AVERAGE,
    head_too_large,
    pieces_too_small,
    too_slow,
)
from llmgw_http.request import Request, RequestRejected
from llmgw_http.responder import H11Responder, Responder
from llmgw_http.serving import CLIENT_GONE, BodyPace, run_handler, send_refusal, serve_requests

_RECV = 65536
# In a request head: a line that continues the one before (group 1), or the head's end
# (h11's: a bare LF ends a line too).
_FOLD_OR_HEAD_END = re.compile(rb"\n(?:([ \t])|\r?\n)")


class _Upgrade(Exception):
    def __init__(self, request: Request) -> None:
        self.request = request


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

    def answered(self) -> None:
        """This connection waits on something else from now on (a standby holds it
        through an election): its place in the control port's admission goes to the
        next connection, as once its answers are sent."""
        transport = (
            self._stream.transport_stream if isinstance(self._stream, trio.SSLStream) else None
        )
        answered = getattr(transport, "answered", None)
        if answered is not None:
            answered()

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


class H11Connection:
    """One client connection: a reader task owns the socket's receiving side.

    The reader reads only when allowed (the request loop needs bytes, or a
    handler runs and the client's end must be watched), so a client that
    pipelines without reading answers cannot make the server buffer without
    bound. When the client goes away while a handler runs, the reader cancels
    the handler at once; no task is started per request.
    """

    def __init__(
        self,
        terms: serving.ConnectionTerms,
        drain: serving.Drain,
        stream: trio.abc.Stream,
        received: bytes = b"",
        first: bool = True,
    ) -> None:
        self.terms = terms
        self.drain = drain
        self.stream = stream
        self.first = first  # no request was answered on this connection yet
        self.conn = h11.Connection(
            h11.SERVER, max_incomplete_event_size=terms.limits.max_header_bytes
        )
        # Bytes read already by the plain parser, which handed the connection over.
        if received:
            self.conn.receive_data(received)
        # Bytes of the first request head, kept only where an upgrade may need them.
        self.raw: bytearray | None = bytearray(received) if terms.upgrade and first else None
        self._may_read = trio.Event()
        self._arrived = trio.Event()
        self._eof = False
        self._handler_scope: trio.CancelScope | None = None
        self._fed = 0  # bytes given to h11, to measure a request head
        self._head_only = False  # the head check refused the request: its body is not read
        self._reader_scope = trio.CancelScope()  # the reader task's; cancelled for an upgrade

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reader, self._reader_scope)
            try:
                await serve_requests(self.drain, self)
            except CLIENT_GONE:
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
                del data  # h11 keeps its own copy: not pinned while the reader waits
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

    async def _next_head(self) -> tuple[Any, bool]:
        """h11's next event where a request head is due, and whether the head has an
        obsolete line fold (a line that starts with a space or tab), which h11 unfolds
        unseen: h11's buffer is searched as it grows, each byte about once, up to the
        head's end (h11 reads the head from the buffer's start once that end is in)."""
        conn = self.conn
        folded = False
        scanned = 0  # -1: the head's end was found first
        while True:
            if scanned >= 0 and not folded:
                buffer = conn._receive_buffer._data  # no public view: h11 is pinned
                found = _FOLD_OR_HEAD_END.search(buffer, scanned)
                if found is None:
                    scanned = max(0, len(buffer) - 2)
                elif found.group(1):
                    folded = True
                else:
                    scanned = -1
            event = conn.next_event()
            if event is h11.NEED_DATA:
                self._arrived = trio.Event()
                self._may_read.set()
                await self._arrived.wait()
                continue
            return event, folded

    async def next_request(self) -> tuple[Request, Responder] | None:
        try:
            request = await self._read_request(self.first)
        except _Upgrade as upgrade:
            upgrade_handler = self.terms.upgrade
            assert upgrade_handler is not None and self.raw is not None
            self._reader_scope.cancel()  # the upgrade handler reads the socket from here on
            await trio.lowlevel.checkpoint()
            await upgrade_handler(upgrade.request, ReplayStream(bytes(self.raw), self.stream))
            return None
        except RequestRejected as exc:
            await self._reject(exc.status, exc.message)
            return None
        except h11.RemoteProtocolError as exc:
            await self._reject(exc.error_status_hint, f"malformed request: {exc}")
            return None
        if request is None:
            return None
        self.first = False
        responder = H11Responder(
            self.conn,
            self.stream,
            closing=self.drain.draining or self._head_only,
            chunked=request.http_version == b"1.1" and request.method != b"HEAD",
            head=request.method == b"HEAD",
        )
        return request, responder

    async def _read_request(self, first: bool) -> Request | None:
        limits = self.terms.limits
        if not first:
            # An idle keep-alive connection may be closed by drain() or time out;
            # one inside a request may not.
            idle_scope = trio.CancelScope(deadline=trio.current_time() + limits.keepalive_timeout_s)
            self.drain.idle_scopes.add(idle_scope)
            try:
                with idle_scope:
                    while not self.conn.trailing_data[0] and not self._eof:
                        self._arrived = trio.Event()
                        self._may_read.set()
                        await self._arrived.wait()
            finally:
                self.drain.idle_scopes.discard(idle_scope)
            if idle_scope.cancelled_caught:
                return None
        unparsed, fed = _unparsed(self.conn), self._fed
        with trio.move_on_after(limits.header_timeout_s) as head_scope:
            event, folded = await self._next_head()
        if head_scope.cancelled_caught:
            raise RequestRejected(408, "request headers did not arrive in time")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise RequestRejected(400, "expected a request")
        # h11 limits only a head it is still waiting for; one that came whole is measured.
        if unparsed + self._fed - fed - _unparsed(self.conn) > limits.max_header_bytes:
            raise RequestRejected(431, head_too_large(limits))
        request = Request(
            method=event.method,
            target=event.target,
            headers=list(event.headers),
            http_version=event.http_version,
        )
        framing = request.header(b"transfer-encoding"), request.header(b"content-length")
        if None not in framing:
            # RFC 9112 section 6.1: a server must at least close such a connection.
            raise RequestRejected(
                400, "a request with both Transfer-Encoding and Content-Length is ambiguous"
            )
        if folded:
            # RFC 9112 section 5.2 lets a server refuse it (h11 unfolds it): a proxy
            # before this one may have read a folded Transfer-Encoding or Content-Length
            # otherwise, so the connection is closed, as for the case above.
            raise RequestRejected(400, "a request header folded over lines is not accepted")
        if self.raw is not None and (request.header(b"upgrade") or b"").lower() == b"websocket":
            raise _Upgrade(request)
        self.raw = None
        check = self.terms.check_head
        if check is not None and not check(request):
            self._head_only = True
            return request
        request.body = await self._read_body(request)
        return request

    async def _read_body(self, request: Request) -> bytes:
        limits = self.terms.limits
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
            pace = BodyPace(scope, limits.min_body_rate, 0) if limits.min_body_rate else None
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
            raise RequestRejected(408, too_slow(limits))
        raise RequestRejected(408, "request body did not arrive in time")

    async def respond(self, request: Request, responder: Responder) -> bool:
        if self._eof:
            raise trio.BrokenResourceError("the client went away")
        self._may_read.set()  # watch the client's end while the handler runs
        with trio.CancelScope() as scope:
            self._handler_scope = scope
            try:
                await run_handler(self.terms.handler, request, responder)
            finally:
                self._handler_scope = None
        if scope.cancelled_caught:
            raise trio.BrokenResourceError("the client went away")
        conn = self.conn
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return False
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:
            return False
        return True

    async def _reject(self, status: int, message: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # an answer was begun: the connection just closes
        await send_refusal(
            self.terms.on_reject, status, message, self._refusal, self.stream.send_all
        )

    def _refusal(self, status: int, message: str) -> bytes | None:
        """A refusal framed through h11 (None where h11 will not send one)."""
        body = error_body(status, message)
        length = (b"content-length", str(len(body)).encode())
        headers = [*JSON, length, (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=status, headers=headers))
            out += self.conn.send(h11.Data(data=body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return None
        return out


def _unparsed(conn: h11.Connection) -> int:
    """The bytes h11 holds unparsed (it has no public count; trailing_data copies them)."""
    return len(conn._receive_buffer)
