"""Following a control plane across the network: a router apart (`llmgw-server router
--control URL`) dials the control port's route feed (`/v1/routes`, a websocket, TLS
unless the URL says http://, offering the ALPN name ROUTER_ALPN so that the port admits
it on the routers' lane), authenticated with the router token, and follows it; it
dials again forever, with jittered backoff and a log line saying why each attempt
failed. What follows is a `Following`: a router's Follower, or a workers' parent's
TableRelay. The dialing itself, and its words, are llmgw_core.dial's.

Several control planes (`--control` repeated or comma-separated: the leader and the
standbys of control planes that share a store): the router follows whichever leads. A
standby closes the feed with NOT_LEADER_CLOSE naming the leader: the router dials it at
once, but only when it is one of its own URLs (same host and port; it is dialed as the
router's URL says, never as the standby wrote it: a standby cannot send the router's
token elsewhere). Naming none (no leader now), a refused stale epoch, or a leader's feed
that broke or went silent: the next URL after a short jitter (`SWITCH_JITTER_S`), for a
failover's time (`FAILOVER_WINDOW_S`), then the usual backoff. Throughout, the router
serves its last table (`Dialing` decides; it is pure).
"""

from __future__ import annotations

import logging
import math
import os
import random
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import attrs
import trio
import trio_websocket

from llmgw_core.agent_lane import ROUTER_ALPN
from llmgw_core.dial import Advice, ConnectFailed, Dialed, Target, describe_rejection, dial
from llmgw_core.logsafe import escaped
from llmgw_core.wire import NOT_LEADER_CLOSE, leader_from_reason
from llmgw_core.ws_frames import Heard, cut_when_silent, read_frames, silence_bound
from llmgw_server.route_feed.connection import Connection
from llmgw_server.route_feed.messages import MAX_FRAME_BYTES, FeedError, RouteTable, StaleEpoch
from llmgw_server.route_feed.ws import WebSocketFeed

log = logging.getLogger("llmgw.router")

ROUTER_TOKEN_ENV = "LLMGW_ROUTER_TOKEN"
ROUTES_RESOURCE = "/v1/routes"
CONNECT_TIMEOUT_S = 10.0
# A dial costs the control plane little, and a router away from it during a drain is not
# waited for: it comes back within a couple of seconds of the control plane's return.
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 2.0
# The leader is pinged after 4 s of quiet and cut after 8 s: a silent one (a frozen
# process, a lost host) is left for the next in the list that soon; the router serves its
# last table meanwhile.
KEEPALIVE_INTERVAL_S = 2.0
# Between control planes during a failover (a standby with no leader yet, a leader gone):
# short, so that the router is on the new leader soon after it is elected, and jittered,
# so that the routers of a fleet do not dial it all at once.
SWITCH_JITTER_S = (0.1, 0.5)
# How long after a leader's feed ended the next control plane is dialed after that jitter
# rather than the backoff: an election (a lease of 10 s by default) and some.
FAILOVER_WINDOW_S = 30.0


class Following(Protocol):
    """What follows a feed: a router's Follower, or a workers' parent's relay."""

    @property
    def table(self) -> RouteTable | None: ...

    async def follow(self, connection: Connection) -> None: ...


# A router apart is told its settings on the command line.
ROUTER_ADVICE = Advice(
    ca="--ca", no_ca="the system's trust store (no --ca given)", plaintext="use an http:// URL"
)


def feed_target(control: str) -> Target:
    """Where the route feed of the control plane at `control` is: its admin URL
    (https://host:port) or the feed's own (wss://host:port/v1/routes). Raises ValueError."""
    try:
        parts = urlsplit(control)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--control {control!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https", "ws", "wss"):
        raise ValueError(
            f"--control {control!r} must be the control plane's https:// URL "
            "(http:// when it runs with [agents] insecure = true)"
        )
    if not parts.hostname:
        raise ValueError(f"--control {control!r} has no host")
    secure = parts.scheme in ("https", "wss")
    return Target(parts.hostname, port or (443 if secure else 80), ROUTES_RESOURCE, secure)


def feed_targets(controls: str | Sequence[str]) -> list[Target]:
    """The route feeds of the control planes `controls` names: one URL, or several (each
    `--control` given, each comma-separated). Raises ValueError."""
    given = [controls] if isinstance(controls, str) else list(controls)
    urls = [url.strip() for value in given for url in value.split(",") if url.strip()]
    if not urls:
        raise ValueError("--control URL is required")
    targets: list[Target] = []
    for url in urls:
        where = feed_target(url)
        if any(_same_place(where, t) for t in targets):
            raise ValueError(f"--control names {where.where} twice")
        targets.append(where)
    return targets


def _same_place(a: Target, b: Target) -> bool:
    return (a.host.lower(), a.port) == (b.host.lower(), b.port)


def known_leader(url: str, targets: Sequence[Target]) -> int | None:
    """Which of `targets` is at the host and port of the leader's `url` (a standby's
    NOT_LEADER_CLOSE), None when none is: such a leader is not followed."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    except ValueError:
        return None
    if not parts.hostname:
        return None
    leader = Target(parts.hostname, port, ROUTES_RESOURCE, True)
    return next((i for i, t in enumerate(targets) if _same_place(leader, t)), None)


def read_router_token(token_file: str | None) -> str:
    """The raw router token: the first line of `token_file`, else $LLMGW_ROUTER_TOKEN.
    Raises ValueError saying what is missing."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the router token from {token_file}: {exc}") from None
        if not token:
            raise ValueError(f"the router token file {token_file} is empty")
        return token
    token = os.environ.get(ROUTER_TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"a router token is required: --token-file PATH or ${ROUTER_TOKEN_ENV} (its digest "
            "is the control plane's [admin] router_token_digest)"
        )
    return token


def client_context(ca: Path | None) -> ssl.SSLContext:
    """Trust the fleet CA (`--ca`), else the system's trust store."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


@attrs.frozen
class FeedEnd:
    """How one try at following a control plane ended."""

    followed: bool  # its feed was opened (a standby's close is not following)
    why: str
    standby: bool = False  # closed with NOT_LEADER_CLOSE: it does not lead
    leader: str | None = None  # the leader that standby named (None: none leads now)
    stale: bool = False  # it sent a table of a stale epoch, refused here


@attrs.define
class Dialing:
    """Which control plane to dial next, and when, after each try (pure: `jitter` and
    the times are given)."""

    targets: Sequence[Target]
    jitter: Callable[[float, float], float] = random.uniform
    at: int = 0  # the index of the one dialed last
    failures: int = 0  # tries in a row that followed nothing, outside a failover
    failover_until: float = -math.inf  # dial the next one after SWITCH_JITTER_S until then
    redirected: bool = False  # the last try was sent on by a standby

    def after(self, end: FeedEnd, now: float) -> tuple[float, str]:
        """Move on from `end` (at `now`): (the delay before the next dial, which is
        `targets[at]`, and what this router does, in words)."""
        redirected, self.redirected = self.redirected, False
        ahead = (self.at + 1) % len(self.targets)
        if end.standby and end.leader is not None:
            named = known_leader(end.leader, self.targets)
            if named is not None:
                self.at, self.redirected = named, True
                # At once; a second redirect in a row (standbys that disagree while an
                # election settles) waits the jitter: never a loop of dials.
                delay = self._switch() if redirected else 0.0
                return delay, "the leader is one of --control"
            self.at = ahead
            return self._switch(), "that leader is none of --control: not followed"
        if end.standby or end.stale:
            self.at = ahead
            return self._switch(), "looking for the leader"
        if end.followed:  # a leader's feed that ended: a failover, perhaps
            self.failures = 0
            self.failover_until = now + FAILOVER_WINDOW_S
            self.at = ahead
            return self._switch(), "looking for the leader"
        self.at = ahead
        if now < self.failover_until:
            return self._switch(), "looking for the leader"
        self.failures += 1
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(self.failures, 10))
        # Routers that lost the same control plane spread.
        return delay * self.jitter(0.5, 1.0), "backing off"

    def _switch(self) -> float:
        return self.jitter(*SWITCH_JITTER_S)


async def follow_forever(
    follower: Following,
    where: Target | Sequence[Target],
    token: str,
    ssl_context: ssl.SSLContext | None,
    ca: Path | None,
) -> None:
    """Follow the control plane that leads among `where` (one, or several that share a
    store), dialing again after every failure, forever (see the module's docstring)."""
    dialing = Dialing([where] if isinstance(where, Target) else list(where))
    while True:
        dialed = dialing.targets[dialing.at]
        end = await follow_ended(follower, dialed, token, ssl_context, ca)
        delay, doing = dialing.after(end, trio.current_time())
        table = follower.table
        held = (
            f"serving the last route table ({len(table.models)} models)"
            if table is not None
            else "no route table yet"
        )
        following = dialing.targets[dialing.at]
        then = f"dialing {following.where}" if following != dialed else "dialing again"
        then += f" in {delay:.1f} s" if delay else " now"
        if len(dialing.targets) > 1:
            then = f"{doing}; {then}"
        level = logging.INFO if end.standby and delay == 0 else logging.WARNING
        log.log(level, "route feed from %s: %s; %s; %s", dialed.where, end.why, held, then)
        await trio.sleep(delay)


async def follow_once(
    follower: Following,
    where: Target,
    token: str,
    ssl_context: ssl.SSLContext | None,
    ca: Path | None,
) -> tuple[bool, str]:
    """Dial and follow until the feed ends: (whether it was followed, why it ended)."""
    end = await follow_ended(follower, where, token, ssl_context, ca)
    return end.followed, end.why


async def follow_ended(
    follower: Following,
    where: Target,
    token: str,
    ssl_context: ssl.SSLContext | None,
    ca: Path | None,
) -> FeedEnd:
    """Dial and follow until the feed ends: how it ended."""
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await dial(where, ssl_context, ca, alpn=ROUTER_ALPN, advice=ROUTER_ADVICE)
    except ConnectFailed as exc:
        return FeedEnd(False, str(exc))
    except trio.TooSlowError:
        return FeedEnd(False, f"no answer from {where.where} within {CONNECT_TIMEOUT_S:g} s")
    outcome = FeedEnd(False, "")
    try:
        async with trio.open_nursery() as nursery:
            outcome = await _follow_stream(nursery, follower, stream, where, token)
            nursery.cancel_scope.cancel()
    # trio-websocket raises a refusal from its reader task: it comes out of the nursery.
    except* trio_websocket.ConnectionRejected as group:
        first = group.exceptions[0]
        assert isinstance(first, trio_websocket.ConnectionRejected)
        outcome = FeedEnd(False, describe_rejection(first))
    except* (trio_websocket.HandshakeError, OSError, trio.BrokenResourceError) as group:
        outcome = FeedEnd(
            False, f"the websocket handshake with {where.where} failed: {group.exceptions[0]!r}"
        )
    finally:
        await trio.aclose_forcefully(stream)
    return outcome


async def _follow_stream(
    nursery: trio.Nursery,
    follower: Following,
    stream: Dialed,
    where: Target,
    token: str,
) -> FeedEnd:
    host = where.host if where.port == (443 if where.secure else 80) else where.where
    ws = None
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        ws = await trio_websocket.wrap_client_stream(
            nursery,
            stream,  # type: ignore[arg-type]  # any stream works; it is typed narrowly
            host,
            where.resource,
            extra_headers=[(b"authorization", f"Bearer {token}".encode())],
            max_message_size=MAX_FRAME_BYTES,
        )
    if ws is None:
        hint = "" if where.secure else " (if the control port runs TLS, dial https://)"
        return FeedEnd(
            False,
            f"no answer to the websocket handshake from {where.where} within "
            f"{CONNECT_TIMEOUT_S:g} s{hint}",
        )
    log.info("following the route table of %s", where.where)
    inbox_send, inbox_receive = trio.open_memory_channel[str | bytes](64)
    heard = Heard(trio.current_time())
    silent = trio.CancelScope()
    nursery.start_soon(read_frames, ws, inbox_send, None, heard)
    nursery.start_soon(cut_when_silent, ws, heard, silence_bound(KEEPALIVE_INTERVAL_S), silent)
    why = "the control plane closed the route feed"
    stale = closed_here = False
    with silent:
        try:
            await follower.follow(WebSocketFeed(ws, inbox_receive, "the control plane"))
        except FeedError as exc:
            stale, closed_here = isinstance(exc, StaleEpoch), True
            why = f"a frame from the control plane cannot be used: {exc}"
            with trio.move_on_after(1):
                await ws.aclose(code=1008, reason=str(exc)[:120])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it went away while this router spoke: the close says why
        except Exception as exc:  # a bug here must not stop the router serving
            log.exception("following the route table failed")
            why = f"following failed: {type(exc).__name__}: {exc}"
    closed = ws.closed
    if silent.cancelled_caught:
        cut = silence_bound(KEEPALIVE_INTERVAL_S).cut_after_s
        why = f"nothing heard from the control plane for {cut:g} s"
    elif closed is None or closed_here:
        pass  # why says it; the close's reason is this router's own
    elif closed.code == NOT_LEADER_CLOSE:
        reason = escaped(closed.reason or "", limit=200)
        leader = leader_from_reason(closed.reason)
        with trio.move_on_after(1):
            await ws.aclose()
        return FeedEnd(False, f"it does not lead ({reason})", standby=True, leader=leader)
    elif closed.reason:
        why += f" ({closed.reason})"
    with trio.move_on_after(1):
        await ws.aclose()
    return FeedEnd(True, why, stale=stale)
