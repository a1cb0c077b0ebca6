"""Following a control plane's route table, over any connection.

`Follower.follow(connection)` runs one feed: it sends `Hello`, applies every
`Routes` table it receives to the router, and reports back (`InFlight`) the
requests in flight on each draining endpoint: after every table, and whenever
those counts change, so the control plane stops a drained replica as soon as
no router still uses it. The same loop serves every transport, any `Connection`
(route_feed.connection): a websocket to the control port (a router apart,
`remote`), a Unix socket between a workers' parent and a worker, memory channels in
one process. `follow` returns when the peer closed, raises `FeedError` for a frame
that cannot be used (or what the connection raised), and never closes the
connection itself: its owner does.

The router is reached through `RouteTarget`, the little the feed needs of it (a
router.front.Router implements it): the follower is tested against a fake.

One `Follower` lives as long as its router, across connections: a router
keeps serving the last table it applied while no control plane is reachable,
and a table marked incomplete (a control plane that just started and has not
heard from every agent yet) does not replace a complete one; only its drain
intents are applied. It keeps the highest epoch it applied, too: a table of a lower
one (a control plane that no longer leads) is refused, counted, and ends the feed
(`StaleEpoch`, a FeedError) so that its owner looks for the leader; the router keeps
serving the table it has. Each connection's first load report goes out as soon as its
first table is applied: a new control plane hears at once of requests held here.

Models named in the router's own config with static endpoints are the config's:
the feed never changes them, nor gives their names to adapters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs
import trio

from llmgw_core.autoscaling import RouterLoad
from llmgw_core.catalog import Endpoint
from llmgw_core.traffic import Sample
from llmgw_server.route_feed.connection import Connection
from llmgw_server.route_feed.messages import (
    LOAD_INTERVAL_S,
    OLDEST_PROTOCOL,
    PROTOCOL,
    TRAFFIC_INTERVAL_S,
    USAGE_INTERVAL_S,
    FeedError,
    Hello,
    InFlight,
    Load,
    Routes,
    RouteTable,
    Shares,
    StaleEpoch,
    Traffic,
    Usage,
    decode_down,
    encode,
    stale,
)

log = logging.getLogger("llmgw.follower")

# While an endpoint drains, how often its in-flight count is looked at. The count is a
# plain integer the request path updates; reading it here keeps that path untouched.
COUNT_INTERVAL_S = 0.05
# At most one load report this often: far within what the hub takes (hub._RATE).
LOAD_MIN_GAP_S = 0.1


class RouteTarget(Protocol):
    """What a follower applies tables to, and reads the in-flight counts from."""

    def static_models(self) -> frozenset[str]:
        """The models its own config serves from static endpoints: the feed's never."""
        ...

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint]) -> None:
        """Serve `model` from `endpoints` (none: the model has no replica)."""
        ...

    def forget_model(self, model: str) -> None:
        """`model` left the table (removed from the catalog): not served, and unknown
        here, as a name never placed is."""
        ...

    def set_draining(self, draining: frozenset[Endpoint], *, skip: frozenset[str]) -> None:
        """Mark the replicas of `draining` endpoints (and unmark the others) in every
        model but `skip`."""
        ...

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        """Serve each LoRA adapter (the key) from the replicas of its model (the value),
        under its own name; the adapters before are served no more."""
        ...

    def in_flight(self, endpoints: frozenset[Endpoint]) -> dict[str, int]:
        """Requests in flight on each of `endpoints` it holds, by URL, all models summed."""
        ...

    def set_autoscaled(self, models: frozenset[str]) -> None:
        """Meter these models, and hold their requests while no replica serves them."""
        ...

    def load_report(self) -> Mapping[str, RouterLoad]:
        """Each autoscaled model's load since the last report."""
        ...

    async def wait_load_wanted(self) -> None:
        """Until the control plane should hear the load at once (a request was held)."""
        ...


@runtime_checkable
class TrafficSource(Protocol):
    """A router that counts what it answers for the fleet page (router.front.Router)."""

    def traffic_report(self) -> tuple[Sample, ...]:
        """What it answered since the last report, by model and replica."""
        ...


class ShareTarget(Protocol):
    """A router that enforces tenants' limits, shared with the hub's other followers
    (router.front.Router, through its router.tenancy.Tenancy)."""

    def share_usage(self) -> Usage | None:
        """Its limits' use now, with the version of the grant it applied on this
        connection; None when it has no limit to share."""
        ...

    def apply_shares(self, shares: Shares) -> None: ...

    def shares_connection(self) -> None:
        """A new feed: no grant of it applied yet."""
        ...


@runtime_checkable
class RefusalCounter(Protocol):
    """A router that counts the tables it refused (router.front.Router, on /metrics)."""

    def table_refused(self, reason: str) -> None: ...


Reporter = Callable[[Connection, trio.CancelScope], Awaitable[None]]


async def run_feed(
    connection: Connection,
    name: str,
    take: Callable[[RouteTable], None],
    report: Reporter,
    take_shares: Callable[[Shares], None] | None = None,
) -> None:
    """One feed, as every follower runs it: `Hello` as `name`, then each table received
    to `take` (and each grant of shares to `take_shares`) while `report` (given the
    scope to cancel when the peer is gone) sends the reports, until the peer closes the
    connection. What the connection raises, or a frame that cannot be used (FeedError),
    is raised as it is, not in a group."""
    # The oldest protocol first: a control plane of protocol 1 takes that one alone.
    await connection.send(encode(Hello(OLDEST_PROTOCOL, name, PROTOCOL)))
    failure: BaseException | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(report, connection, nursery.cancel_scope)
        try:
            while True:
                message = decode_down(await connection.receive())
                if isinstance(message, Routes):
                    take(message.table)
                elif take_shares is None:
                    raise FeedError("shares were sent to a follower that asked for none")
                else:
                    take_shares(message)
        except trio.EndOfChannel:
            pass
        except Exception as exc:
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


class Follower:
    def __init__(
        self,
        router: RouteTarget,
        name: str,
        *,
        log_changes: bool = True,
        shares: ShareTarget | None = None,
    ) -> None:
        self.router = router
        self.shares = shares  # what enforces the tenants' limits, shared with the hub's others
        self.name = name  # how the control plane's log calls this router
        # "<model> is served by ..." on each change (one router of a process says it).
        self.log_changes = log_changes
        self.table: RouteTable | None = None  # the last table applied, from any control plane
        # Set once a complete table has been applied: the router then knows the fleet's
        # models (an incomplete one, from a control plane that just started, may lack some).
        self.complete = trio.Event()
        self._static = router.static_models()
        self._ignored: set[str] = set()  # feed models shadowed by static ones, logged once
        self.epoch = 0  # the highest epoch of a table applied (0: none, or unfenced ones)
        self.refused_stale = 0  # tables refused for a stale epoch
        self._version = -1  # of the last table received on the current connection
        self._received = trio.Event()
        self._first_table = trio.Event()  # of the current connection
        self._report_failure: BaseException | None = None

    async def follow(self, connection: Connection) -> None:
        """Follow one connection until the peer closes it (see the module's docstring)."""
        self._version = -1
        self._first_table = trio.Event()
        self._report_failure = None
        take_shares = None
        if self.shares is not None:
            self.shares.shares_connection()
            take_shares = self.shares.apply_shares
        await run_feed(
            connection, self.name, self._received_table, self._report_forever, take_shares
        )
        if self._report_failure is not None:
            raise self._report_failure

    def _received_table(self, table: RouteTable) -> None:
        if stale(table.epoch, self.epoch):
            self.refused_stale += 1
            if isinstance(self.router, RefusalCounter):
                self.router.table_refused("stale_epoch")
            raise StaleEpoch(table.epoch, self.epoch)
        self.apply(table)
        self._version = table.version
        self._received.set()
        self._first_table.set()

    def apply(self, table: RouteTable) -> None:
        """Serve `table`, or only its drain intents when it is incomplete and the router
        already serves a complete one."""
        held = self.table
        self.epoch = max(self.epoch, table.epoch)
        if not table.complete and held is not None and held.complete:
            table = attrs.evolve(
                held, version=table.version, draining=table.draining, epoch=table.epoch
            )
        apply_table(self.router, table, held, self._static, self._ignored, self.log_changes)
        self.table = table
        if table.complete:
            self.complete.set()

    def in_flight(self) -> dict[str, int]:
        """Requests in flight on each draining endpoint this router holds, by URL."""
        draining = self.table.draining if self.table else frozenset()
        return self.router.in_flight(draining) if draining else {}

    async def _report_forever(self, connection: Connection, scope: trio.CancelScope) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_load, connection, scope)
            if isinstance(self.router, TrafficSource):
                rows = self.router.traffic_report
                nursery.start_soon(report_traffic, connection, scope, lambda: self.table, rows)
            if self.shares is not None:
                usage = self.shares.share_usage
                nursery.start_soon(report_usage, connection, scope, lambda: self.table, usage)
            await self._report_in_flight(connection, scope)
            nursery.cancel_scope.cancel()

    async def _report_load(self, connection: Connection, scope: trio.CancelScope) -> None:
        async def load() -> Mapping[str, RouterLoad]:
            await self.router.wait_load_wanted()
            return self.router.load_report()

        await report_load(
            connection,
            scope,
            lambda: self.table,
            self.router.load_report,
            load,
            self._first_table,
        )

    async def _report_in_flight(self, connection: Connection, scope: trio.CancelScope) -> None:
        sent: InFlight | None = None
        try:
            while True:
                draining = self.table is not None and bool(self.table.draining)
                with trio.move_on_after(COUNT_INTERVAL_S if draining else math.inf):
                    await self._received.wait()
                self._received = trio.Event()
                if self._version < 0:
                    continue  # nothing received yet on this connection
                report = InFlight(self._version, self.in_flight())
                if report != sent:
                    await connection.send(encode(report))
                    sent = report
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()  # the peer went: the receiving side says how
        except Exception as exc:
            self._report_failure = exc
            scope.cancel()


async def report_load(
    connection: Connection,
    scope: trio.CancelScope,
    table: Callable[[], RouteTable | None],
    now: Callable[[], Mapping[str, RouterLoad]],
    wanted: Callable[[], Awaitable[Mapping[str, RouterLoad]]],
    first_table: trio.Event | None = None,
) -> None:
    """While the table autoscales models, send `Load` every LOAD_INTERVAL_S (`now()`),
    at once whenever `wanted()` returns one (a request was held), and at once when
    `first_table` is set (the connection's first table: requests held before it, as
    across a switch of control plane, reach the new one without waiting)."""
    try:
        while True:
            report: Mapping[str, RouterLoad] | None = None
            with trio.move_on_after(LOAD_INTERVAL_S):
                if first_table is not None:
                    await first_table.wait()
                else:
                    report = await wanted()
            first_table = None
            current = table()
            if current is None or not current.autoscaled:
                continue
            if report is None:
                report = now()
            await connection.send(encode(Load(dict(report))))
            await trio.sleep(LOAD_MIN_GAP_S)  # held requests in a burst: one report
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()  # the peer went: the receiving side says how


async def report_usage(
    connection: Connection,
    scope: trio.CancelScope,
    table: Callable[[], RouteTable | None],
    usage: Callable[[], Usage | None],
) -> None:
    """Every USAGE_INTERVAL_S, the use of the limits this router enforces, to a hub that
    hands out shares of them (its table says so); nothing while it has none to share."""
    try:
        while True:
            current = table()
            report = usage() if current is not None and current.shares else None
            if report is not None:
                await connection.send(encode(report))
            await trio.sleep(USAGE_INTERVAL_S)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()  # the peer went: the receiving side says how


async def report_traffic(
    connection: Connection,
    scope: trio.CancelScope,
    table: Callable[[], RouteTable | None],
    rows: Callable[[], tuple[Sample, ...]],
) -> None:
    """Every TRAFFIC_INTERVAL_S, what the router answered (`rows()`), to a control plane
    that takes it (its table says so) and when there is something to say."""
    try:
        while True:
            await trio.sleep(TRAFFIC_INTERVAL_S)
            report = rows()  # taken even when not sent: each report covers one interval
            current = table()
            if report and current is not None and current.traffic:
                await connection.send(encode(Traffic(TRAFFIC_INTERVAL_S, report)))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()  # the peer went: the receiving side says how


def apply_table(
    router: RouteTarget,
    table: RouteTable,
    previous: RouteTable | None,
    static: frozenset[str] = frozenset(),
    ignored: set[str] | None = None,
    log_changes: bool = True,
) -> None:
    """Give the router the table's endpoints (a model gone from it is forgotten), mark the
    replicas that drain and give it the adapters. `static` models are left alone, and an
    adapter named like one or adapting one is not served (each named in `ignored` once)."""
    ignored = set() if ignored is None else ignored
    for model, endpoints in table.models.items():
        if model in static:
            if model not in ignored:
                ignored.add(model)
                log.warning(
                    "the control plane places %s, which this router's config serves from "
                    "static endpoints: the config's endpoints are kept",
                    model,
                )
            continue
        if log_changes and (previous is None or previous.models.get(model) != endpoints):
            # An endpoint prints as its URL: the engine key stays out of the log.
            log.info("%s is served by %s", model, ", ".join(map(str, endpoints)) or "nothing")
        router.set_endpoints(model, endpoints)
    for model in previous.models if previous is not None else ():
        if model not in table.models and model not in static:
            if log_changes:
                log.info("%s is no longer placed by the control plane", model)
            router.forget_model(model)
    router.set_draining(table.draining, skip=static)
    adapters = {}
    for adapter, model in table.adapters.items():
        clash = adapter if adapter in static else model if model in static else None
        if clash is None:
            adapters[adapter] = model
        elif adapter not in ignored:
            ignored.add(adapter)
            log.warning(
                "the control plane serves the LoRA adapter %s of %s, but this router's "
                "config serves %s from static endpoints: the adapter is not served here",
                adapter,
                model,
                clash,
            )
    before = previous.adapters if previous is not None else {}
    if log_changes:
        for adapter, model in adapters.items():
            if before.get(adapter) != model:
                log.info("%s is a LoRA adapter of %s, served by its replicas", adapter, model)
        for adapter in before.keys() - adapters.keys() - static:
            log.info("the LoRA adapter %s is no longer served", adapter)
    router.set_adapters(adapters)
    router.set_autoscaled(table.autoscaled - static)
