"""HTTP/1.1 served on trio streams: the listeners, TLS, and graceful shutdown.

Both the router and the mock engine serve through this: it reads a request head and
body within their time limits, runs the handler while watching the client socket (a
client that goes away cancels the handler at once), and writes whatever the handler
sends, streamed or whole. A plain TCP connection is read by the plain parser
(`plain_connection`, the fast path), a TLS one by h11 (`h11_connection`); both share
one serve loop and error policy (`serving`), answer through one responder protocol
(`responder`), and frame by one grammar (`h1`).
"""

from __future__ import annotations

import errno
import logging
import ssl
from typing import Any

import trio

from llmgw_core.logsafe import peer_address
from llmgw_core.ratelog import RateLimit
from llmgw_http import sockio
from llmgw_http.h1 import JSON, refusal
from llmgw_http.h11_connection import H11Connection, ReplayStream
from llmgw_http.limits import ServerLimits
from llmgw_http.plain_connection import PlainConnection
from llmgw_http.request import Request, RequestRejected
from llmgw_http.responder import Responder
from llmgw_http.serving import (
    CLIENT_GONE,
    ConnectionTerms,
    Drain,
    Handler,
    HeadCheck,
    RejectListener,
    UpgradeHandler,
)
from llmgw_http.tls_admission import Gate, Ticket

# What handlers and the processes that serve them import from here.
__all__ = [
    "JSON",
    "HTTPServer",
    "Handler",
    "HeadCheck",
    "ReplayStream",
    "Request",
    "RequestRejected",
    "Responder",
    "ServerLimits",
    "UpgradeHandler",
]

log = logging.getLogger(__name__)

_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}

_TOO_MANY_MESSAGE = "the server has as many connections as it may serve (max_connections)"
_TOO_MANY = refusal(503, _TOO_MANY_MESSAGE, [*JSON, (b"retry-after", b"1")])


class HTTPServer:
    """Serves one handler on any number of listeners; `draining` closes idle keep-alives."""

    def __init__(
        self,
        handler: Handler,
        limits: ServerLimits,
        upgrade: UpgradeHandler | None = None,
        ssl_context: ssl.SSLContext | None = None,
        on_reject: RejectListener | None = None,
        check_head: HeadCheck | None = None,
    ) -> None:
        self.terms = ConnectionTerms(handler, limits, check_head, upgrade, on_reject)
        self.drain = Drain()  # what shutdown waits for
        self.ssl_context = ssl_context  # TLS on every accepted connection
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
                    if self.ssl_context is not None:
                        acceptors.start_soon(self.tls_admission.reset_refused)
                    task_status.started(listeners)
            for listener in listeners:
                await listener.aclose()

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            if self.ssl_context is not None:
                await self.tls_admission.room_to_accept()
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                    log.error("accept failed (%s); retrying in 100 ms", exc)
                    await trio.sleep(0.1)
                    continue
                raise
            if self.ssl_context is None:
                limit = self.terms.limits.max_connections
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
        on_reject = self.terms.on_reject
        if on_reject is not None:
            on_reject(503, _TOO_MANY_MESSAGE)
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
        host, peer = peer_address(ticket.stream)
        await trio.aclose_forcefully(ticket.stream)
        if failure is None:
            limits = self.tls_admission.core.limits
            level, why = (
                logging.INFO,
                (
                    f"no handshake within {limits.deadline_s:g} s, or no answer to the server's"
                    f" flight within {limits.flight_answer_s:g} s"
                ),
            )
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
        self.drain.begin()
        with trio.move_on_after(grace_s):
            await self.drain.done.wait()
            return True
        return False

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        try:
            sock = sockio.raw_socket(stream)
            if sock is None:  # TLS: h11 on the decrypted stream
                await H11Connection(self.terms, self.drain, stream).run()
            else:
                assert isinstance(stream, trio.SocketStream)  # as raw_socket found it
                await PlainConnection(self.terms, self.drain, stream, sock).run()
        except CLIENT_GONE:
            pass
        except Exception:
            log.exception("connection handler failed")
        finally:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                await stream.aclose()
