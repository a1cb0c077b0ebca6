"""HTTP/1.1 served with h11 directly on trio streams.

Both the router and the mock engine serve through this: it reads a request
head and body within their time limits, runs the handler while watching the
client socket (a client that goes away cancels the handler at once), and
writes whatever the handler sends, streamed or whole.
"""

from __future__ import annotations

import errno
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import h11
import trio

from llmgw_core.openai_errors import error_body
from llmgw_core.ratelog import RateLimit

log = logging.getLogger(__name__)

_RECV = 65536
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
JSON = [(b"content-type", b"application/json")]


@attrs.frozen
class ServerLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0


@attrs.define(slots=True)
class Request:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased by h11
    body: bytes = b""
    http_version: bytes = b"1.1"

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
    """What a handler writes its answer through."""

    __slots__ = ("_conn", "_stream", "chunked", "closing", "head", "started")

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
        self.head = head  # a HEAD request: the head is sent, never a body
        self.closing = closing  # ask the client to close after this response
        self.started = False
        # A response started without a content-length goes to this client in
        # chunked framing (an HTTP/1.1 request that is not HEAD), as h11 would write it.
        self.chunked = chunked

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        await self._stream.send_all(
            self._conn.send(h11.Response(status_code=status, headers=headers))
        )

    async def send(self, data: bytes) -> None:
        if data and not self.head:
            await self._stream.send_all(self._conn.send(h11.Data(data=data)))

    async def end(self) -> None:
        await self._stream.send_all(self._conn.send(h11.EndOfMessage()))

    async def whole(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON
    ) -> None:
        if self.closing:
            headers = [*headers, (b"connection", b"close")]
        self.started = True
        conn = self._conn
        out = conn.send(
            h11.Response(
                status_code=status,
                headers=[*headers, (b"content-length", str(len(body)).encode())],
            )
        )
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
        if not self.head:
            await self._stream.send_all(framed)

    async def abort(self) -> None:
        """Close the connection mid-answer: the client sees a truncated response."""
        await self._stream.aclose()

    async def send_raw(self, data: bytes) -> None:
        """Bytes outside HTTP framing (the mock engine's garbage mode); then close."""
        self.started = True
        await self._stream.send_all(data)


Handler = Callable[[Request, Responder], Awaitable[None]]
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
    ) -> None:
        self.handler = handler
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
                connections.start_soon(self.serve_connection, stream)
            else:
                tls = trio.SSLStream(stream, self.ssl_context, server_side=True)
                connections.start_soon(self._serve_tls, tls)

    async def _serve_tls(self, tls: trio.SSLStream[trio.SocketStream]) -> None:
        """The TLS handshake first, so that a failed one is logged with the peer's address
        (rate-limited per peer host and reason: a fleet with the wrong CA must not flood
        the log)."""
        failure: BaseException | None = None
        with trio.move_on_after(self.limits.header_timeout_s) as handshake:
            try:
                await tls.do_handshake()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                failure = exc.__cause__ or exc
        if failure is None and not handshake.cancelled_caught:
            await self.serve_connection(tls)
            return
        host, peer = _peer_address(tls.transport_stream)
        await trio.aclose_forcefully(tls.transport_stream)
        if failure is None:
            level, why = logging.INFO, f"no handshake within {self.limits.header_timeout_s:g} s"
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
            await _Connection(self, stream).run()
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


class _Connection:
    """One client connection: a reader task owns the socket's receiving side.

    The reader reads only when allowed (the request loop needs bytes, or a
    handler runs and the client's end must be watched), so a client that
    pipelines without reading answers cannot make the server buffer without
    bound. When the client goes away while a handler runs, the reader cancels
    the handler at once; no task is started per request.
    """

    def __init__(self, server: HTTPServer, stream: trio.abc.Stream) -> None:
        self.server = server
        self.stream = stream
        self.conn = h11.Connection(
            h11.SERVER, max_incomplete_event_size=server.limits.max_header_bytes
        )
        # Bytes of the first request head, kept only where an upgrade may need them.
        self.raw: bytearray | None = bytearray() if server.upgrade else None
        self._may_read = trio.Event()
        self._arrived = trio.Event()
        self._eof = False
        self._handler_scope: trio.CancelScope | None = None

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
                self.conn.receive_data(data)  # b"" tells h11 the client closed
                self._arrived.set()
                if not data:
                    self._eof = True
                    if self._handler_scope is not None:
                        self._handler_scope.cancel()
                    return

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
        first = True
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
        with trio.move_on_after(limits.header_timeout_s) as head_scope:
            event = await self._next_event()
        if head_scope.cancelled_caught:
            raise RequestRejected(408, "request headers did not arrive in time")
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise RequestRejected(400, "expected a request")
        request = Request(
            method=event.method,
            target=event.target,
            headers=list(event.headers),
            http_version=event.http_version,
        )
        if self.raw is not None and (request.header(b"upgrade") or b"").lower() == b"websocket":
            raise _Upgrade(request)
        self.raw = None
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
        with trio.move_on_after(limits.body_timeout_s) as scope:
            while True:
                event = await self._next_event()
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > limits.max_body_bytes:
                        raise RequestRejected(
                            413, f"request body exceeds the limit of {limits.max_body_bytes} bytes"
                        )
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(chunks)
                elif isinstance(event, h11.ConnectionClosed):
                    raise trio.BrokenResourceError("client closed during the body")
        assert scope.cancelled_caught
        raise RequestRejected(408, "request body did not arrive in time")

    async def _respond(self, request: Request) -> None:
        responder = Responder(
            self.conn,
            self.stream,
            closing=self.server.draining,
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
