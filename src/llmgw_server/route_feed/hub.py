"""The route feed's hub: the control plane publishes its route table here, and every
router that follows it (its own process's router, workers, routers apart) gets each
new table and reports what it has in flight on draining endpoints.

`RouteHub.serve(connection)` runs one follower over any connection with
`send(text)` / `receive() -> text` (`route_feed.connection`); `serve_websocket` is
the control port's `GET /v1/routes`, for routers apart, authenticated with the
router token (`[admin] router_token_digest`): a credential that can only follow,
never the admin token.

A follower sends every table it applies back as the version of its reports, so a
drain waits until every follower has seen the drain intent (`caught_up`) and none
has a request in flight there (`in_flight`). A follower that goes away drops out
of both.

A hub made with an `epoch` (a leader's, of a control plane kept in a store) stamps
every table it sends with it, so that routers refuse the tables of a control plane
that no longer leads (route_feed.messages); epoch 0 is a single control plane's.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping

import attrs
import trio
import trio_websocket

from llmgw_core.autoscaling import RouterLoad
from llmgw_core.bearer import bearer_digest
from llmgw_core.catalog import Endpoint
from llmgw_core.limit_shares import Grant, ShareBook
from llmgw_core.logsafe import escaped
from llmgw_core.traffic import Sample, TrafficStore
from llmgw_core.ws_frames import Heard, cut_when_silent, read_frames, silence_bound
from llmgw_http.server import Request
from llmgw_server.route_feed.connection import Connection
from llmgw_server.route_feed.messages import (
    EPOCH_PROTOCOL,
    MAX_FRAME_BYTES,
    MAX_TRAFFIC_ROWS,
    FeedError,
    Hello,
    InFlight,
    Load,
    Routes,
    RouteTable,
    Shares,
    Traffic,
    Usage,
    decode_up,
    encode,
    spoken,
)
from llmgw_server.route_feed.ws import WebSocketFeed

log = logging.getLogger("llmgw.routes")

ROUTES_PATH = b"/v1/routes"
HELLO_TIMEOUT_S = 10.0
KEEPALIVE_INTERVAL_S = 5.0  # a silent follower is pinged after 10 s and cut after 20 s
_RATE = 100.0  # reports a second, sustained: a follower sends one per table and change
_BURST = 1000
# How long a follower that left keeps what it may hold counted (limit_shares): a router
# cut off from its control plane serves on its last shares meanwhile.
SHARE_HOLD_S = 120.0
TTFT_KEPT = 256  # TTFT reports kept a model, all followers together (a minute of 2 s ones)


@attrs.define
class _Follower:
    name: str
    peer: str
    protocol: int  # the route feed protocol it is followed in (messages.spoken)
    version: int = -1  # of the table its last report answers; -1: none yet
    counts: Mapping[str, int] = attrs.field(factory=dict)
    load: Mapping[str, RouterLoad] = attrs.field(factory=dict)  # its last Load
    # Shares of the tenants' limits: the totals its config sets and the wanted it
    # reported (by limit id), the grant waiting to be sent, the event that wakes its
    # sender.
    totals: Mapping[str, float] = attrs.field(factory=dict)
    wanted: Mapping[str, float] = attrs.field(factory=dict)
    grant: Grant | None = None  # not sent yet: a later one is merged into it
    wake: trio.Event = attrs.field(factory=trio.Event)
    in_book: bool = False


@attrs.frozen
class ShareRow:
    """One limit as the hub shares it (for status and the fleet page)."""

    limit: str  # "<tenant>/<kind>" or "<tenant>/<kind>/<model>"
    total: float
    committed: float  # what the followers may be using together
    shares: Mapping[str, float]  # follower name -> its share


class RouteHub:
    def __init__(
        self,
        relays: bool = False,
        wall_clock: Callable[[], float] = time.time,
        *,
        epoch: int = 0,
    ) -> None:
        """`relays`: a workers' parent's hub, whose followers' traffic is summed for its
        relay to send on (`take_traffic`); a control plane's keeps it (`traffic`).
        `epoch`: the leadership every table is stamped with (0: a single control plane);
        the next `publish` stamps a new one set here."""
        self.epoch = epoch
        self.table = RouteTable(0, {}, frozenset(), complete=False, epoch=epoch, shares=True)
        self._followers: dict[int, _Follower] = {}
        self._ids = itertools.count()
        self._published = trio.Event()
        self._reported = trio.Event()
        self._held = trio.Event()
        # Requests that arrived at the followers, by model, as their loads said: a count
        # that only grows (readers take differences: the page's requests a second).
        self.arrived: Counter[str] = Counter()
        # Each model's TTFT p90s as followers reported them, with when (a report covers
        # its follower's last interval; readers ask for the worst since their last look).
        self._ttft: dict[str, deque[tuple[float, float]]] = {}
        self.traffic = TrafficStore()  # each model's and replica's, for the fleet page
        self._wall_clock = wall_clock
        self._relays = relays
        self._pending: dict[tuple[str, str], Sample] = {}  # since take_traffic, relays only
        # The followers' shares of the tenants' limits (llmgw_core.limit_shares), made at
        # the first report of use. A control plane's hub may have had a predecessor (a
        # restart, another leader) whose followers still hold shares: it raises none for
        # a book's hold at first. A relay's workers started with it: none are held.
        self.shares: ShareBook | None = None
        self.share_totals: dict[str, float] = {}  # limit id -> the least total reported
        # A relay's own shares from the control plane it follows (None: none yet, each
        # limit whole): the totals its workers share are capped by them.
        self.share_caps: dict[str, float] | None = None

    @property
    def followers(self) -> int:
        return len(self._followers)

    def publish(
        self,
        models: Mapping[str, tuple[Endpoint, ...]],
        draining: frozenset[Endpoint],
        *,
        complete: bool,
        adapters: Mapping[str, str] | None = None,
        autoscaled: frozenset[str] = frozenset(),
    ) -> int:
        """Make this the table every follower gets; returns its version (unchanged when
        the table is). `adapters`: LoRA adapter -> its model (None: none)."""
        old = self.table
        adapters = dict(adapters or {})
        same = (
            dict(old.models), old.draining, old.complete, dict(old.adapters), old.autoscaled,
            old.epoch,
        )  # fmt: skip
        if same == (dict(models), draining, complete, adapters, autoscaled, self.epoch):
            return old.version
        self.table = RouteTable(
            old.version + 1, dict(models), draining, complete, adapters, autoscaled, True,
            self.epoch, True,
        )  # fmt: skip
        self._published.set()
        self._published = trio.Event()
        for follower in self._followers.values():
            follower.wake.set()
        return self.table.version

    def in_flight(self, endpoint: Endpoint) -> int:
        """Requests in flight on `endpoint`, as the followers last reported them."""
        url = endpoint.url
        return sum(f.counts.get(url, 0) for f in self._followers.values())

    def caught_up(self, version: int) -> bool:
        """Whether every follower has reported on table `version` or a later one."""
        return all(f.version >= version for f in self._followers.values())

    def loads(self) -> dict[str, list[RouterLoad]]:
        """Each model's load as every follower last reported it (those that report)."""
        out: dict[str, list[RouterLoad]] = {}
        for follower in self._followers.values():
            for model, load in follower.load.items():
                out.setdefault(model, []).append(load)
        return out

    def ttft_peak(self, model: str, since: float) -> float | None:
        """The worst TTFT p90 a follower reported for `model` at or after `since`."""
        return max((p90 for at, p90 in self._ttft.get(model, ()) if at >= since), default=None)

    def take_traffic(self) -> tuple[Sample, ...]:
        """The followers' traffic since the last take, summed (a relaying hub's)."""
        rows, self._pending = tuple(self._pending.values()), {}
        return rows

    def _traffic(self, message: Traffic) -> None:
        if not self._relays:
            self.traffic.add(self._wall_clock(), message.interval_s, message.rows)
            return
        for row in message.rows:
            key = (row.model, row.replica)
            was = self._pending.get(key)
            if was is None:
                if len(self._pending) < MAX_TRAFFIC_ROWS:
                    self._pending[key] = row
                continue
            p90s = [t for t in (was.ttft_p90_ms, row.ttft_p90_ms) if t is not None]
            self._pending[key] = Sample(
                row.model,
                row.replica,
                was.requests + row.requests,
                was.e4xx + row.e4xx,
                was.e5xx + row.e5xx,
                max(p90s) if p90s else None,
                was.in_flight + row.in_flight,  # workers report once an interval each
            )

    async def wait_held(self) -> None:
        """Until a follower reports a request it holds (a model no replica serves)."""
        await self._held.wait()

    async def wait_reported(self) -> None:
        """Until a follower reports, joins or leaves."""
        await self._reported.wait()

    def _notify(self) -> None:
        self._reported.set()
        self._reported = trio.Event()

    async def serve(self, connection: Connection, peer: str) -> None:
        """Serve one follower until it closes the connection; raises FeedError for a
        frame that cannot be used. The connection's owner closes it."""
        hello: object = None
        with trio.move_on_after(HELLO_TIMEOUT_S):
            try:
                hello = decode_up(await connection.receive())
            except trio.EndOfChannel:
                return  # gone before saying hello
        if hello is None:
            raise FeedError(f"no hello within {HELLO_TIMEOUT_S:g} s")
        if not isinstance(hello, Hello):
            raise FeedError(f"the first message must be hello, not {type(hello).__name__}")
        name = escaped(hello.router, limit=100)
        follower = _Follower(name, peer, spoken(hello))
        key = next(self._ids)
        self._followers[key] = follower
        self._notify()
        log.info(
            "router %s (%s) follows the route table (route feed protocol %d)",
            follower.name,
            peer,
            follower.protocol,
        )
        if self.epoch and follower.protocol < EPOCH_PROTOCOL:
            log.warning(
                "router %s (%s) speaks route feed protocol %d: it does not refuse the tables "
                "of a control plane that no longer leads; upgrade it",
                follower.name,
                peer,
                follower.protocol,
            )
        failure: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send, connection, follower, nursery.cancel_scope)
                try:
                    await self._receive_reports(connection, follower, key)
                except trio.EndOfChannel:
                    pass
                except Exception as exc:
                    failure = exc
                nursery.cancel_scope.cancel()
        finally:
            del self._followers[key]
            if follower.in_book and self.shares is not None:
                self.shares.left(key, trio.current_time())
                self._recount_totals()
            self._notify()
            log.info("router %s (%s) no longer follows", follower.name, peer)
        if failure is not None:
            raise failure

    async def _send(
        self, connection: Connection, follower: _Follower, scope: trio.CancelScope
    ) -> None:
        """The one sender to a follower: each new table, and each grant of shares."""
        sent = -1
        try:
            while True:
                table = self.table
                grant, follower.grant = follower.grant, None
                if grant is not None:
                    await connection.send(encode(Shares(grant.version, grant.shares, grant.full)))
                if table.version != sent:
                    await connection.send(encode(Routes(table)))
                    sent = table.version
                    continue
                if follower.grant is None:
                    await follower.wake.wait()
                    follower.wake = trio.Event()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()  # gone: the receiving side ends the feed

    # -- shares of the tenants' limits -----------------------------------------------

    def _usage(self, key: int, follower: _Follower, usage: Usage, now: float) -> None:
        """A follower's use of its limits: the book hears it, and its grant is queued."""
        book = self.shares
        if book is None:
            quiet = -math.inf if self._relays else now + SHARE_HOLD_S
            book = self.shares = ShareBook(hold_s=SHARE_HOLD_S, quiet_until=quiet)
        if not follower.in_book:
            follower.in_book = True
            book.join(key, now)
        if usage.totals != follower.totals:
            follower.totals = dict(usage.totals)
            self._recount_totals()
        follower.wanted = dict(usage.wanted)
        book.report(key, usage.applied, usage.have, usage.used, usage.wanted, now)
        grant = book.grant(key, now)
        if grant is not None:
            # One not sent yet is merged, never replaced: the book counts every grant.
            waiting = follower.grant
            follower.grant = grant if waiting is None else waiting.then(grant)
            follower.wake.set()

    def _recount_totals(self) -> None:
        """Each limit's total: the least any follower's config sets (and, for a relay,
        within its own share from the control plane)."""
        totals: dict[str, float] = {}
        for follower in self._followers.values():
            for limit, total in follower.totals.items():
                known = totals.get(limit)
                totals[limit] = total if known is None else min(known, total)
        caps = self.share_caps
        if caps is not None:
            totals = {limit: min(total, caps.get(limit, 0.0)) for limit, total in totals.items()}
        if totals != self.share_totals and self.shares is not None:
            self.shares.set_totals(totals)
        self.share_totals = totals

    def share_rows(self) -> list[ShareRow]:
        """Every limit the followers share: its total, what they may be using together
        (the book's committed sum), and each follower's share by its name."""
        book = self.shares
        if book is None:
            return []
        held = {f.name: book.shares_of(key) for key, f in self._followers.items() if f.in_book}
        return [
            ShareRow(
                limit,
                total,
                book.committed(limit),
                {name: got[limit] for name, got in held.items() if limit in got},
            )
            for limit, total in sorted(self.share_totals.items())
        ]

    def set_share_caps(self, shares: Shares) -> None:
        """A relay's grant from the control plane: what its workers share, at most."""
        if shares.full or self.share_caps is None:
            self.share_caps = {}
        self.share_caps.update(shares.shares)
        self._recount_totals()

    def relay_usage(self, applied: int) -> Usage | None:
        """A relay's report up: its workers' limits, their use summed as the book counts
        it (what each may be using), what they would use, and what it enforces."""
        book, totals = self.shares, self.share_totals
        if book is None or not totals:
            return None
        raw: dict[str, float] = {}
        wanted: dict[str, float] = {}
        for follower in self._followers.values():
            for limit, total in follower.totals.items():
                known = raw.get(limit)
                raw[limit] = total if known is None else min(known, total)
            for limit, amount in follower.wanted.items():
                wanted[limit] = wanted.get(limit, 0.0) + amount
        caps = self.share_caps
        have = {
            limit: total if caps is None else caps.get(limit, 0.0) for limit, total in raw.items()
        }
        used = {limit: book.committed(limit) for limit in raw}
        return Usage(applied, raw, have, used, {k: wanted.get(k, 0.0) for k in raw})

    async def _receive_reports(self, connection: Connection, follower: _Follower, key: int) -> None:
        tokens, at = float(_BURST), trio.current_time()
        while True:
            message = decode_up(await connection.receive())
            now = trio.current_time()
            tokens, at = min(_BURST, tokens + (now - at) * _RATE), now
            if tokens < 1:
                raise FeedError(
                    f"more than {_BURST} reports in a burst (at most {_RATE:g} a second)"
                )
            tokens -= 1
            if isinstance(message, Traffic):
                self._traffic(message)
                continue
            if isinstance(message, Usage):
                self._usage(key, follower, message, now)
                continue
            if isinstance(message, Load):
                # Only the models the table autoscales: what a follower names is bounded.
                scaled = self.table.autoscaled
                follower.load = {m: v for m, v in message.models.items() if m in scaled}
                for model, load in follower.load.items():
                    self.arrived[model] += load.requests
                    if load.ttft_p90_ms is not None:
                        seen = self._ttft.setdefault(model, deque(maxlen=TTFT_KEPT))
                        seen.append((now, load.ttft_p90_ms))
                if any(load.held for load in message.models.values()):
                    self._held.set()
                    self._held = trio.Event()
                continue
            if not isinstance(message, InFlight):
                raise FeedError("hello is sent once, first")
            if message.version > self.table.version:
                raise FeedError(
                    f"a report on table {message.version}, which was never sent "
                    f"(the latest is {self.table.version})"
                )
            follower.version, follower.counts = message.version, dict(message.counts)
            self._notify()


def refusal(
    authorization: bytes | None, router_digest: str | None, admin_digest: str | None
) -> tuple[int, str] | None:
    """Why a follower with this Authorization header may not follow: (status, reason),
    or None when it may. Digests are compared in constant time."""
    if router_digest is None:
        return 403, (
            "this control plane takes no routers: set [admin] router_token_digest "
            "(or router_token_env) in its config"
        )
    if admin_digest is not None and hmac.compare_digest(router_digest, admin_digest):
        return 403, (
            "the control plane's router token is its admin token, which may not follow: "
            "give routers a token of their own ([admin] router_token_digest)"
        )
    digest = bearer_digest(authorization)
    if digest is None:
        return 401, "a router token is required (Authorization: Bearer <router token>)"
    if hmac.compare_digest(digest, router_digest):
        return None
    if admin_digest is not None and hmac.compare_digest(digest, admin_digest):
        return 403, "the admin token may not follow routes: give the router token"
    return 401, "the router token is not valid"


async def serve_websocket(
    hub: RouteHub,
    request: Request,
    raw: trio.abc.Stream,
    *,
    router_digest: str | None,
    admin_digest: str | None,
    peer: str,
) -> None:
    """`GET /v1/routes` on the control port: one follower per connection."""
    async with trio.open_nursery() as nursery:
        ws_request = await trio_websocket.wrap_server_stream(
            nursery, raw, max_message_size=MAX_FRAME_BYTES
        )
        refused = refusal(request.header(b"authorization"), router_digest, admin_digest)
        if refused is not None:
            status, reason = refused
            log.warning("refused a router from %s: %s", peer, reason)
            await ws_request.reject(status, body=reason.encode())
            return
        ws = await ws_request.accept()
        try:
            await _serve_ws(hub, ws, peer)
        finally:
            nursery.cancel_scope.cancel()


async def _serve_ws(hub: RouteHub, ws: trio_websocket.WebSocketConnection, peer: str) -> None:
    inbox_send, inbox_receive = trio.open_memory_channel[str | bytes](64)
    heard = Heard(trio.current_time())
    code, reason = 1000, ""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_frames, ws, inbox_send, None, heard)
            nursery.start_soon(
                cut_when_silent,
                ws,
                heard,
                silence_bound(KEEPALIVE_INTERVAL_S),
                nursery.cancel_scope,
            )
            try:
                await hub.serve(WebSocketFeed(ws, inbox_receive, "the follower"), peer)
            except FeedError as exc:
                code, reason = 1008, str(exc)
                log.warning("closing the route feed of %s: %s", peer, escaped(reason))
            nursery.cancel_scope.cancel()
    finally:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await ws.aclose(code=code, reason=reason[:120])
