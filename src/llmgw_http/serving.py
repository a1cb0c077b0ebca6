"""What both kinds of client connection share: the one serve loop, the handler's error
policy, how the server's own refusals go out, and a request body's pace.

A connection is served by the plain parser (`plain_connection`, a plain TCP socket read
directly) or by h11 (`h11_connection`: TLS, and whatever the plain parser hands over);
each gives `serve_requests` its requests one at a time and answers them. A connection
is given what it reads of its server (`ConnectionTerms`) and what it reports to it
(`Drain`), both made here, so that the server imports the connections and not the
reverse.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import attrs
import trio

from llmgw_http import coarse_timeouts
from llmgw_http.limits import BODY_RATE_CHECK_S, BODY_RATE_GRACE_S, ServerLimits, body_too_slow
from llmgw_http.request import Request
from llmgw_http.responder import Responder

# The server's one logger, whichever of its modules writes the line.
log = logging.getLogger("llmgw_http.server")

Handler = Callable[[Request, Responder], Awaitable[None]]
# Called with a request's head before its body is read: True to read the body; False
# to run the handler on the head alone (its body empty), which answers it (a refusal),
# and then close the connection with the body unread.
HeadCheck = Callable[[Request], bool]
UpgradeHandler = Callable[[Request, trio.abc.Stream], Awaitable[None]]
# Told of each request refused before the handler (its status and why): 413, 408, malformed.
RejectListener = Callable[[int, str], None]

_REFUSAL_WRITE_S = 2.0  # a refusal is written within this, or not at all
# What a client's going away looks like to a handler writing to it.
CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)


@attrs.frozen
class ConnectionTerms:
    """What a server's connections read of it, the same for each of them."""

    handler: Handler
    limits: ServerLimits
    check_head: HeadCheck | None = None
    upgrade: UpgradeHandler | None = None  # takes over connections that ask for a websocket
    on_reject: RejectListener | None = None


class Drain:
    """A server's graceful shutdown, as its connections take part in it: each counts
    itself `busy` while inside a request and files its idle keep-alive wait's scope in
    `idle_scopes`; `begin` (the server's shutdown) closes those waits, and `done` is set
    once no request is in flight."""

    __slots__ = ("busy", "done", "draining", "idle_scopes")

    def __init__(self) -> None:
        self.draining = False
        self.busy = 0  # connections inside a request
        self.done = trio.Event()
        self.idle_scopes: set[trio.CancelScope] = set()

    def begin(self) -> None:
        self.draining = True
        for scope in self.idle_scopes:
            scope.cancel()
        if self.busy == 0:
            self.done.set()


class Connection(Protocol):
    """A client connection as the serve loop drives it."""

    async def next_request(self) -> tuple[Request, Responder] | None:
        """The next request and what to answer it through; None: the connection is done
        (the client left or stayed idle, or it was refused, upgraded or handed over)."""
        ...

    async def respond(self, request: Request, responder: Responder) -> bool:
        """Runs the handler (through `run_handler`), watching the client; whether the
        connection may serve another request."""
        ...


async def serve_requests(drain: Drain, connection: Connection) -> None:
    """Answer requests one at a time until the connection is done or the server drains;
    `drain` counts the connections inside a request, for a graceful shutdown."""
    while not drain.draining:
        exchange = await connection.next_request()
        if exchange is None:
            return
        drain.busy += 1
        try:
            go_on = await connection.respond(*exchange)
        finally:
            # Not kept while the next request is awaited: an idle keep-alive connection
            # would pin its last request, body and all (up to max_body_bytes).
            del exchange
            drain.busy -= 1
            if drain.draining and drain.busy == 0:
                drain.done.set()
        if not go_on:
            return


async def run_handler(handler: Handler, request: Request, responder: Responder) -> None:
    """The handler's error policy, the same on every connection: a client gone (a
    stream error) ends the connection quietly; any other failure is logged with the
    request; a handler that sent nothing has the client answered 500."""
    try:
        await handler(request, responder)
    except CLIENT_GONE:
        raise trio.BrokenResourceError("the client went away") from None
    except Exception:
        log.exception("handler failed on %s %s", request.method, request.target)
    if not responder.started:
        await responder.error(500, "internal error: the handler sent no response")


async def send_refusal(
    on_reject: RejectListener | None,
    status: int,
    message: str,
    frame: Callable[[int, str], bytes | None],
    send_all: Callable[[bytes], Awaitable[None]],
) -> None:
    """The server's own answer to a request it does not hand to the handler (413, 408,
    431, malformed): told to `on_reject`, framed by the connection (None: it cannot be
    sent), written within a time limit; the connection closes after it."""
    if on_reject is not None:
        on_reject(status, message)
    wire = frame(status, message)
    if wire is None:
        return
    with trio.move_on_after(_REFUSAL_WRITE_S):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await send_all(wire)


class BodyPace:
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
