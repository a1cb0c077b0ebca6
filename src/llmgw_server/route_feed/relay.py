"""A workers' parent's follower of a control plane, on behalf of its workers (a router
apart with `[server] workers = N`): it follows the control plane as a router's Follower
does, and relays each table to the workers through a hub of its own."""

from __future__ import annotations

import attrs
import trio

from llmgw_core.autoscaling import RouterLoad, combine
from llmgw_server.route_feed.connection import Connection
from llmgw_server.route_feed.follower import report_load, report_traffic, report_usage, run_feed
from llmgw_server.route_feed.hub import RouteHub
from llmgw_server.route_feed.messages import InFlight, RouteTable, Shares, StaleEpoch, encode, stale


class TableRelay:
    """A parent's follower of a control plane on behalf of its workers.

    It follows one connection as route_feed.follower.Follower does (`follow`, `table`), but
    instead of serving each table it publishes it to `hub`, which the workers follow;
    back up go their in-flight counts, summed by the hub, under the control plane's
    version of the latest table every worker has applied. The hub numbers its tables
    itself: `_versions` maps its versions to the control plane's. It refuses a table of a
    stale epoch as a Follower does (the workers keep the table they have).
    """

    def __init__(self, hub: RouteHub, name: str) -> None:
        self.hub = hub
        self.name = name
        self.table: RouteTable | None = None  # the last table received
        self.epoch = 0  # the highest epoch of a table relayed
        self.refused_stale = 0  # tables refused for a stale epoch
        self._versions: dict[int, int] = {}  # hub version -> the control plane's
        self._wake = trio.Event()
        self._first_table = trio.Event()  # of the current connection
        self._arrived_before: dict[str, int] = {}  # hub.arrived when load() last read it
        self.shares_version = -1  # of the control plane's last grant, on this connection

    async def follow(self, connection: Connection) -> None:
        """Follow until the peer closes the connection (see route_feed.follower)."""
        self._versions = {}
        self._first_table = trio.Event()
        self.shares_version = -1
        await run_feed(
            connection, self.name, self._received_table, self._report_forever, self._shares
        )

    def _shares(self, shares: Shares) -> None:
        """The control plane's grant to this router: what its workers share at most."""
        self.hub.set_share_caps(shares)
        self.shares_version = shares.version

    def _received_table(self, table: RouteTable) -> None:
        if stale(table.epoch, self.epoch):
            self.refused_stale += 1
            raise StaleEpoch(table.epoch, self.epoch)
        self.epoch = max(self.epoch, table.epoch)
        self.table = table
        local = self.hub.publish(
            table.models,
            table.draining,
            complete=table.complete,
            adapters=table.adapters,
            autoscaled=table.autoscaled,
        )
        self._versions[local] = table.version
        self._wake.set()
        self._first_table.set()

    async def _wake_on_reports(self) -> None:
        while True:
            await self.hub.wait_reported()
            self._wake.set()

    def report(self) -> InFlight | None:
        """What to tell the control plane now; None before every worker has a table."""
        hub = self.hub
        done = [local for local in self._versions if hub.caught_up(local)]
        if not done or self.table is None:
            return None
        latest = max(done)
        for local in [v for v in self._versions if v < latest]:
            del self._versions[local]
        counts = {e.url: n for e in self.table.draining if (n := hub.in_flight(e))}
        return InFlight(self._versions[latest], counts)

    def load(self) -> dict[str, RouterLoad]:
        """Each autoscaled model's load, every worker's last report combined, with the
        requests that arrived since the last time it was read."""
        arrived = self.hub.arrived
        load = {}
        for model, loads in self.hub.loads().items():
            combined = combine(loads)
            new = arrived[model] - self._arrived_before.get(model, 0)
            load[model] = attrs.evolve(combined, requests=new)
        self._arrived_before = dict(arrived)
        return load

    async def _load_held(self) -> dict[str, RouterLoad]:
        await self.hub.wait_held()
        return self.load()

    async def _report_forever(self, connection: Connection, scope: trio.CancelScope) -> None:
        """Tell the control plane what the workers report, each time it changes."""
        sent: InFlight | None = None
        async with trio.open_nursery() as nursery:
            table, load, held = (lambda: self.table), self.load, self._load_held
            nursery.start_soon(report_load, connection, scope, table, load, held, self._first_table)
            nursery.start_soon(self._wake_on_reports)
            nursery.start_soon(report_traffic, connection, scope, table, self.hub.take_traffic)
            usage = lambda: self.hub.relay_usage(self.shares_version)  # noqa: E731
            nursery.start_soon(report_usage, connection, scope, table, usage)
            try:
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    report = self.report()
                    if report is not None and report != sent:
                        await connection.send(encode(report))
                        sent = report
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                scope.cancel()  # the peer went: the receiving side says how
            nursery.cancel_scope.cancel()
