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
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from llmgw_core.openai_errors import error_body
from llmgw_core.wire import LOST_LEADER_HEADER, NOT_LEADER_CLOSE, not_leader_reason
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

# The close frame and the peer's answer, at most.
_CLOSE_S = 2.0
# Streams held through an election at once: each keeps its socket and TLS state (tens
# of KiB) for at most a hold; past this, a stream is closed at once without a leader to
# name, and its peer tries the next control plane after a jitter, as without holding.
MAX_HELD = 8192


class _LeadsHere:
    """What `_leader` gives when this control plane won the election meanwhile."""


_HERE = _LeadsHere()


class Leading(Protocol):
    """What a standby knows of the leader (election.Standing)."""

    @property
    def leading(self) -> bool: ...

    @property
    def leader_url(self) -> str | None: ...

    @property
    def why(self) -> str: ...


def admin_url(control_url: str) -> str:
    """The admin API's base URL of a control plane advertised as ws(s)://host:port."""
    scheme, sep, rest = control_url.partition("://")
    return ("https" if scheme == "wss" else "http") + sep + rest.rstrip("/")


def same_control_plane(a: str, b: str) -> bool:
    return a.strip().rstrip("/").lower() == b.strip().rstrip("/").lower()


class StandbyAnswers:
    """The control port's handlers while this control plane stands by.

    A stream that finds no leader to name, or only the one its peer says it lost
    (LOST_LEADER_HEADER: that leader's key lives until its lease ends), is held until
    the election names another (at most `hold_s`): then the peer is sent to the new
    leader as soon as there is one, instead of dialing every control plane in turn, each
    a TLS handshake, for as long as the election takes. A held stream waits on the
    election, not on this process: its place in the port's admission goes to the next.
    A peer that lost the leader the store still names has the seat check whether that
    leader's process is gone (`suspect`). When this control plane is the one elected,
    `adopt` serves the held stream in its new term (an agent's: its register is read
    there, no second handshake); a stream it does not take is closed naming this control
    plane (`here`)."""

    def __init__(
        self,
        standing: Callable[[], Leading],
        metrics: Callable[[], bytes],
        changed: Callable[[], Awaitable[None]] | None = None,
        hold_s: float = 0.0,
        adopt: Callable[[Request, trio.abc.Stream, bytes], Awaitable[bool]] | None = None,
        here: Callable[[], str] | None = None,
        suspect: Callable[[str], None] | None = None,
    ) -> None:
        self._standing = standing
        self._metrics = metrics
        self._changed = changed
        self.hold_s = hold_s
        self._adopt = adopt
        self._here = here
        # Told the leader's URL when a peer says it lost that leader, which the store
        # still names: the seat checks whether its process is gone.
        self._suspect = suspect
        self.held = 0  # streams held now
        self.adopted = 0  # held streams served by this control plane's own term

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
        path = request.path.decode("ascii", "replace")
        lost = (request.header(LOST_LEADER_HEADER) or b"").decode("ascii", "replace")
        with trio.move_on_after(_CLOSE_S):
            try:
                rest = b""
                if isinstance(raw, ReplayStream):
                    rest = head_and_rest(bytes(await raw.receive_some()))
                await raw.send_all(accept_response(request))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.aclose_forcefully(raw)
                return
        # The same path on the leader: what its peer lists (an agent compares URLs whole).
        leader = await self._leader(path, lost, raw)
        if isinstance(leader, _LeadsHere):
            if self._adopt is not None and await self._adopt(request, raw, rest):
                self.adopted += 1
                await trio.aclose_forcefully(raw)
                return
            leader = None if self._here is None else self._here() + path
        standing = self._standing()
        reason = not_leader_reason(leader, standing.why)
        with trio.move_on_after(_CLOSE_S):
            await ServerWebSocket(raw, rest, 64 * 1024).close(NOT_LEADER_CLOSE, reason)
        await trio.aclose_forcefully(raw)

    async def _leader(self, path: str, lost: str, raw: trio.abc.Stream) -> str | _LeadsHere | None:
        """The leader's URL for `path`, once there is one the peer did not lose (held at
        most `hold_s` for it), or _HERE once this control plane leads; None when there
        is none."""

        def named() -> str | _LeadsHere | None:
            standing = self._standing()
            if standing.leading:
                return _HERE
            url = standing.leader_url
            if url is None:
                return None
            if lost and same_control_plane(url + path, lost):
                if self._suspect is not None:
                    self._suspect(url)
                return None
            return url + path

        leader = named()
        if leader is not None or self._changed is None or self.hold_s <= 0 or self.held >= MAX_HELD:
            return leader
        if isinstance(raw, ReplayStream):
            raw.answered()
        self.held += 1
        try:
            with trio.move_on_after(self.hold_s):
                while leader is None:
                    await self._changed()
                    leader = named()
        finally:
            self.held -= 1
        return leader
