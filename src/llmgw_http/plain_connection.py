"""A client connection on a plain TCP socket, read without h11 while it can be: the
router's fast path (its grammar is llmgw_http.h1's, proven against h11 by
tests/test_plain_http.py and tests/test_fuzz_http.py)."""

from __future__ import annotations

import socket
from typing import Literal

import trio

from llmgw_http import coarse_timeouts, serving, sockio
from llmgw_http.h1 import REQUEST_HEAD_END, plain_request, refusal
from llmgw_http.h11_connection import H11Connection
from llmgw_http.limits import head_too_large, too_slow
from llmgw_http.request import Request
from llmgw_http.responder import PlainResponder, Responder
from llmgw_http.serving import CLIENT_GONE, BodyPace, run_handler, send_refusal, serve_requests

_RECV = 65536
_Wait = Literal["", "idle", "head", "body"]


class _SetWhenDue:
    """What coarse_timeouts calls when a handler has run for a tick: wake the watcher."""

    __slots__ = ("_conn",)

    def __init__(self, conn: PlainConnection) -> None:
        self._conn = conn

    def cancel(self) -> None:
        self._conn._watch.set()


class PlainConnection:
    """One client connection on a plain TCP socket, read without h11 while it can be.

    Requests as clients send them (a whole HTTP/1.1 head in one read, a Content-Length
    body) are parsed here and answered straight onto the socket; the first request that
    is anything else (a head in pieces, chunked, HTTP/1.0, Expect, an upgrade, anything
    malformed) hands the connection with every byte read to `H11Connection`, which serves
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

    def __init__(
        self,
        terms: serving.ConnectionTerms,
        drain: serving.Drain,
        stream: trio.SocketStream,
        sock: socket.socket,
    ) -> None:
        self.terms = terms
        self.drain = drain
        self.stream = stream
        self.sock = sock
        self.buf = b""  # read and not yet parsed
        self.eof = False
        self.in_handler = False
        self._watch = trio.Event()  # set when a handler has run for a tick
        self._watch_due = _SetWhenDue(self)
        self._watching: trio.CancelScope | None = None  # the watcher's wait on the socket
        self._scope = trio.CancelScope()
        self._waiting_for: _Wait = ""  # what the timer would cut ("": nothing)
        self._pace: BodyPace | None = None  # the last body's pace, if it was waited for
        self._served = 0
        self._answering: PlainResponder | None = None  # the answer to the request in hand
        self._handover: bytes | None = None  # bytes read that h11 is to serve from

    async def run(self) -> None:
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watcher)
                try:
                    await serve_requests(self.drain, self)
                except CLIENT_GONE:
                    pass  # the client went away: nothing to log
                finally:
                    nursery.cancel_scope.cancel()
        coarse_timeouts.disarm(self._scope)
        coarse_timeouts.disarm(self._watch_due)
        self.drain.idle_scopes.discard(self._scope)
        if self._scope.cancelled_caught:
            if self._waiting_for == "head":
                await self._reject(408, "request headers did not arrive in time")
            elif self._waiting_for == "body":
                if self._pace is not None and self._pace.slow:
                    await self._reject(408, too_slow(self.terms.limits))
                else:
                    await self._reject(408, "request body did not arrive in time")
            return
        if self._handover is not None:
            handover = self._handover
            await H11Connection(
                self.terms, self.drain, self.stream, handover, first=not self._served
            ).run()

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

    async def next_request(self) -> tuple[Request, Responder] | None:
        """The next request read here; None also where it is h11's to read (`_handover`
        set to the bytes read)."""
        terms, drain = self.terms, self.drain
        limits = terms.limits
        scope = self._scope
        if not self.buf:
            if self.eof:
                return None
            # An idle keep-alive connection may be closed by drain() or time out;
            # the first request's head has the head's time limit from the start.
            if self._served:
                self._waiting_for = "idle"
                coarse_timeouts.arm(scope, trio.current_time() + limits.keepalive_timeout_s)
                drain.idle_scopes.add(scope)
            else:
                self._waiting_for = "head"
                coarse_timeouts.arm(scope, trio.current_time() + limits.header_timeout_s)
            await self._more()
            drain.idle_scopes.discard(scope)
            if not self.buf:
                return None
        end = self.buf.find(b"\r\n\r\n", 0, limits.max_header_bytes)
        parsed = plain_request(self.buf[:end]) if end >= 0 else None
        if parsed is None:
            too_large = end < 0 and len(self.buf) >= limits.max_header_bytes
            if too_large and not REQUEST_HEAD_END.search(self.buf, 0, limits.max_header_bytes):
                coarse_timeouts.disarm(scope)
                await self._reject(431, head_too_large(limits))
                return None
            self._handover = self.buf
            return None
        request, length, close = parsed
        check = terms.check_head
        head_only = check is not None and not check(request)
        if head_only:
            length = 0  # answered from the head; the connection closes unread
        elif length > limits.max_body_bytes:
            message = f"request body of {length} bytes exceeds the limit of {limits.max_body_bytes}"
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
        responder = self._answering = PlainResponder(
            self.sock,
            self.stream,
            closing=drain.draining or head_only,
            chunked=request.method != b"HEAD",
            head=request.method == b"HEAD",
            peer_closing=close,
        )
        self._served += 1
        return request, responder

    async def _body(self, start: int, end: int) -> bool:
        """Read until `buf` holds `end` bytes (the body from `start`), within the body's
        time limit and pace; False if the client closed first. Linear in the body's size:
        the reads are joined once, not added to `buf` one by one."""
        limits = self.terms.limits
        self._waiting_for = "body"
        coarse_timeouts.arm(self._scope, trio.current_time() + limits.body_timeout_s)
        have = len(self.buf)
        pace = None
        if limits.min_body_rate:
            pace = self._pace = BodyPace(self._scope, limits.min_body_rate, have - start)
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

    async def respond(self, request: Request, responder: Responder) -> bool:
        if self.eof:
            # The client closed (or half-closed) after its request: as with h11, the
            # handler starts and is cancelled at its first wait, so that only an answer
            # ready at once still goes out.
            self._scope.cancel()
        self.in_handler = True
        coarse_timeouts.arm(self._watch_due, trio.current_time())
        try:
            await run_handler(self.terms.handler, request, responder)
        finally:
            self.in_handler = False
            coarse_timeouts.disarm(self._watch_due)
            if self._watching is not None:  # the socket is the serving task's again
                self._watching.cancel()
        answered = self._answering
        assert answered is not None  # next_request made it
        return answered.done and not answered.closing and not answered.peer_closing

    async def _reject(self, status: int, message: str) -> None:
        await send_refusal(self.terms.on_reject, status, message, refusal, self._send_all)

    async def _send_all(self, data: bytes) -> None:
        await sockio.send_all(self.sock, data)
