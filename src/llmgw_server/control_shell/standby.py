"""What a control plane that does not lead answers on its control port.

A standby (`[control.store]`, seat.py) decides nothing and commands no one, but its port
stays open so that every peer finds the leader through any control plane it knows:

- an agent's stream or a router's route feed is accepted and closed at once with
  NOT_LEADER_CLOSE, its reason naming the leader's URL (or why none leads now): the peer
  dials that leader when it is one of the control planes it was given;
- the admin API and the fleet page answer 307 to the same path on the leader (the CLI
  and browsers follow it, with the method and body kept), or 503 with why none leads;
- `/metrics` is this process's own: whether it leads, its epoch, the store's latency.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Protocol

import trio

from llmgw_core.openai_errors import error_body
from llmgw_core.wire import NOT_LEADER_CLOSE, not_leader_reason
from llmgw_http.h11_connection import ReplayStream
from llmgw_http.server import Request, Responder
from llmgw_http.ws_server import (
    ServerWebSocket,
    accept_response,
    handshake_problem,
    head_and_rest,
    refusal,
)

log = logging.getLogger("llmgw.control")

# The close frame and the peer's answer, at most: a standby never holds a stream.
_CLOSE_S = 2.0


class Leading(Protocol):
    """What a standby knows of the leader (election.Standing)."""

    @property
    def leader_url(self) -> str | None: ...

    @property
    def why(self) -> str: ...


def admin_url(control_url: str) -> str:
    """The admin API's base URL of a control plane advertised as ws(s)://host:port."""
    scheme, sep, rest = control_url.partition("://")
    return ("https" if scheme == "wss" else "http") + sep + rest.rstrip("/")


class StandbyAnswers:
    """The control port's handlers while this control plane stands by."""

    def __init__(self, standing: Callable[[], Leading], metrics: Callable[[], bytes]) -> None:
        self._standing = standing
        self._metrics = metrics

    async def handle(self, request: Request, responder: Responder) -> None:
        if request.path == b"/metrics":
            page = self._metrics()
            await responder.whole(200, page, [(b"content-type", b"text/plain; version=0.0.4")])
            return
        standing = self._standing()
        leader = standing.leader_url
        if leader is None:
            message = f"this control plane stands by and no leader is known: {standing.why}"
            body = json.loads(error_body(503, message, "no_leader"))
            body["leader"] = None
            await responder.whole(503, json.dumps(body).encode(), [(b"retry-after", b"1")])
            return
        location = admin_url(leader).encode() + request.target
        message = f"this control plane stands by: the leader is {admin_url(leader)}"
        await responder.whole(
            307,
            error_body(307, message, "not_leader"),
            [(b"location", location), (b"content-type", b"application/json")],
        )

    async def upgrade(self, request: Request, raw: trio.abc.Stream) -> None:
        """Any stream (an agent's, a router's): accepted, then closed naming the leader."""
        problem = handshake_problem(request)
        if problem is not None:
            with trio.move_on_after(_CLOSE_S):
                try:
                    await raw.send_all(refusal(400, b"Bad Request", problem.encode()))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await trio.aclose_forcefully(raw)
            return
        standing = self._standing()
        # The same path on the leader: what its peer lists (an agent compares URLs whole).
        leader = standing.leader_url
        path = request.path.decode("ascii", "replace")
        reason = not_leader_reason(None if leader is None else leader + path, standing.why)
        with trio.move_on_after(_CLOSE_S):
            try:
                rest = b""
                if isinstance(raw, ReplayStream):
                    rest = head_and_rest(bytes(await raw.receive_some()))
                await raw.send_all(accept_response(request))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.aclose_forcefully(raw)
                return
            await ServerWebSocket(raw, rest, 64 * 1024).close(NOT_LEADER_CLOSE, reason)
        await trio.aclose_forcefully(raw)
