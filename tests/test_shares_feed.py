"""Shares of the tenants' limits over the route feed (in one process, memory channels,
autojump clock): a control plane's hub, a workers' parent relaying within its own share,
and workers that report their use and apply their grants. The book's arithmetic is
property-tested in test_limit_shares.py; here, what travels and who caps whom."""

from __future__ import annotations

import attrs
import pytest
import trio

import status_docs
from llmgw_server.admin_cli import render_status
from llmgw_server.control.documents import TenantLimitDoc
from llmgw_server.control_shell.admin import tenant_docs
from llmgw_server.route_feed.connection import LocalConnection, local_pair
from llmgw_server.route_feed.hub import SHARE_HOLD_S, RouteHub, ShareRow
from llmgw_server.route_feed.messages import (
    MAX_SHARE_LIMITS,
    PROTOCOL,
    USAGE_INTERVAL_S,
    FeedError,
    Hello,
    Routes,
    Shares,
    Usage,
    decode_down,
    decode_table,
    decode_up,
    encode,
)
from llmgw_server.route_feed.relay import TableRelay

LIMIT = "team-a/tokens"


class Worker:
    """A worker's side of the feed, by hand: it applies every grant and reports."""

    def __init__(self, end: LocalConnection, name: str) -> None:
        self.end = end
        self.name = name
        self.share: float | None = None  # None: no grant yet, the whole limit
        self.applied = -1
        self.wanted = 0.0

    async def run(self, total: float) -> None:
        await self.end.send(encode(Hello(PROTOCOL, self.name)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive)
            while True:
                have = total if self.share is None else self.share
                used = min(have, self.wanted)
                usage = Usage(self.applied, {LIMIT: total}, {LIMIT: have}, {LIMIT: used},
                              {LIMIT: self.wanted})  # fmt: skip
                await self.end.send(encode(usage))
                await trio.sleep(USAGE_INTERVAL_S)

    async def _receive(self) -> None:
        while True:
            message = decode_down(await self.end.receive())
            if isinstance(message, Shares):
                if message.full:
                    self.share = message.shares.get(LIMIT, 0.0)
                elif LIMIT in message.shares:
                    self.share = message.shares[LIMIT]
                self.applied = message.version
            else:
                assert isinstance(message, Routes) and message.table.shares


async def test_a_limit_is_shared_by_a_control_plane_parents_and_workers_within_its_total(
    autojump_clock: trio.abc.Clock,
) -> None:
    control = RouteHub()  # the control plane's
    parents = [TableRelay(RouteHub(relays=True), f"router {i}") for i in range(2)]
    workers: list[Worker] = []
    async with trio.open_nursery() as nursery:
        for i, parent in enumerate(parents):
            up_relay, up_control = local_pair()
            nursery.start_soon(control.serve, up_control, f"router {i}")
            nursery.start_soon(parent.follow, up_relay)
            for j in range(2):
                worker_end, parent_end = local_pair()
                nursery.start_soon(parent.hub.serve, parent_end, f"worker {i}.{j}")
                worker = Worker(worker_end, f"worker {i}.{j}")
                workers.append(worker)
                nursery.start_soon(worker.run, 1000.0)

        def shares() -> list[float]:
            return [1000.0 if w.share is None else w.share for w in workers]

        # Every worker has a grant at once, and the four together hold the limit at most.
        await trio.sleep(2)
        assert all(w.share is not None for w in workers)
        assert sum(shares()) <= 1000
        assert control.shares is not None and control.shares.committed(LIMIT) <= 1000
        # One worker is busy: once the control plane's quiet start is over, the shares
        # move to it, through its parent's share.
        workers[0].wanted = 5000.0
        await trio.sleep(SHARE_HOLD_S + 5)
        assert sum(shares()) <= 1000
        assert shares()[0] >= 900, shares()
        (row,) = control.share_rows()
        assert (row.limit, row.total) == (LIMIT, 1000) and row.committed <= 1000
        assert row.shares["router 0"] >= shares()[0] + shares()[1]
        assert row.shares["router 1"] >= shares()[2] + shares()[3]
        # The busy worker quiets and another gets busy: the shares follow.
        workers[0].wanted = 0.0
        workers[3].wanted = 5000.0
        await trio.sleep(10)
        assert sum(shares()) <= 1000
        assert shares()[3] >= 900, shares()
        nursery.cancel_scope.cancel()


def test_the_status_says_each_shared_limit_and_the_cli_its_use_against_it() -> None:
    hub = RouteHub()
    assert tenant_docs(hub.share_rows()) == ()
    rows = [
        ShareRow("team-a/tokens", 100000.0, 25000.5, {"r1": 60000.0, "r2": 40000.0}),
        ShareRow("team-a/requests/chat", 600.0, 12.0, {}),
    ]
    docs = tenant_docs(rows)
    assert docs[0] == TenantLimitDoc("team-a", "tokens", None, 100000.0, 25000.5,
                                     {"r1": 60000.0, "r2": 40000.0})  # fmt: skip
    assert (docs[1].kind, docs[1].model) == ("requests", "chat")
    shown = render_status(attrs.evolve(status_docs.status([]), tenants=docs))
    line = next(x for x in shown.splitlines() if x.startswith("team-a") and "tokens" in x)
    assert "100000 tokens/min" in line and "25000.5 (25%)" in line and "r1=60000 r2=40000" in line
    assert "600 requests/min" in shown and "chat" in shown


def test_usage_and_shares_frames_round_trip_and_bad_ones_say_why() -> None:
    usage = Usage(3, {LIMIT: 1000.0}, {LIMIT: 500.0}, {LIMIT: 20.0}, {LIMIT: 900.0})
    assert decode_up(encode(usage)) == usage
    shares = Shares(4, {LIMIT: 250.5}, full=True)
    assert decode_down(encode(shares)) == shares
    with pytest.raises(FeedError, match="expected a route table, got shares"):
        decode_table(encode(shares))
    bad = {
        '{"type": "usage", "applied": -2}': "below -1",
        '{"type": "usage", "applied": 0, "used": {"a/tokens": -1}}': "must not be negative",
        '{"type": "usage", "applied": 0, "have": {"": 1}}': "a limit id must be",
        '{"type": "shares", "version": -1}': "must not be negative",
        '{"type": "shares", "version": 1, "shares": {"a/tokens": "x"}}': "shares",
    }
    for frame, says in bad.items():
        with pytest.raises(FeedError, match=says):
            (decode_down if '"shares"' in frame else decode_up)(frame)
    many = {f"t{i}/tokens": 1.0 for i in range(MAX_SHARE_LIMITS + 1)}
    with pytest.raises(FeedError, match="over"):
        decode_up(encode(Usage(0, many)))
