"""Routers following a control plane's route table.

In one process: the hub and a follower over memory channels (what the server's own
router does), the router token's rules. As real processes: a server with agents and
engines, and a separate `router` process following it over TLS with a router token.
"""

from __future__ import annotations

import random
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio

from fleet import Fleet, wait_until
from llmgw_core.autoscaling import RouterLoad
from llmgw_core.catalog import Endpoint
from llmgw_core.config import Config, digest_of, parse_config
from llmgw_core.dial import Target
from llmgw_server.__main__ import run_cli
from llmgw_server.route_feed.connection import LocalConnection, local_pair
from llmgw_server.route_feed.follower import COUNT_INTERVAL_S, Follower, RouteTarget
from llmgw_server.route_feed.hub import RouteHub, refusal
from llmgw_server.route_feed.messages import (
    LOAD_INTERVAL_S,
    OLDEST_PROTOCOL,
    PROTOCOL,
    FeedError,
    Hello,
    InFlight,
    Load,
    Routes,
    RouteTable,
    StaleEpoch,
    Traffic,
    Usage,
    decode_up,
    encode,
)
from llmgw_server.route_feed.relay import TableRelay
from llmgw_server.route_feed.remote import feed_target
from llmgw_server.router.front import Router
from llmgw_server.router.replica import Replica
from procs import Proc, free_port, metric
from test_cache_aware_router import words
from test_fleet_e2e import CHAT, RequestLoop, model

A = Endpoint("127.0.0.1", 9001, api_key="key-a")
B = Endpoint("127.0.0.1", 9002, api_key="key-b")
STATIC = Endpoint("127.0.0.1", 9100)


def config() -> Config:
    return parse_config(
        {
            "agents": {"insecure": True},
            "models": [
                {"name": "static", "endpoints": [STATIC.url]},
                {"name": "chat", "profile": {"engine": "vllm", "model": "org/chat"}},
            ],
        },
        "test.toml",
    )


def endpoints(router: Router, model: str) -> list[Endpoint]:
    return [r.endpoint for r in router.served.balancers[model].replicas]


def replica(router: Router, model: str, endpoint: Endpoint) -> Replica:
    """The router's replica of `model` at `endpoint`, which the test has put there."""
    found = router.served.replica(model, endpoint)
    assert found is not None
    return found


def refused(authorization: bytes | None, router: str | None, admin: str | None) -> tuple[int, str]:
    """The hub's refusal of a follower the test expects to be refused."""
    answer = refusal(authorization, router, admin)
    assert answer is not None
    return answer


async def until(check: Callable[[], object], what: str, hub: RouteHub | None = None) -> None:
    """Wait for `check()` (woken by the hub's reports when given), at most 5 s."""
    with trio.fail_after(5):
        while not check():
            if hub is not None:
                await hub.wait_reported()
            else:
                await trio.sleep(0.01)


@asynccontextmanager
async def following(hub: RouteHub, router: Router | Follower) -> AsyncIterator[Follower]:
    follower = router if isinstance(router, Follower) else Follower(router.served, "test")
    hub_end, router_end = local_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.serve, hub_end, "memory")
        nursery.start_soon(follower.follow, router_end)
        yield follower
        nursery.cancel_scope.cancel()


# -- the follower against a fake router (route_feed.follower.RouteTarget) -----------------


@attrs.define
class FakeTarget:
    """What the follower sees of a router: the endpoints it sets, the drains it marks, and
    the in-flight counts the test sets."""

    static: frozenset[str] = frozenset()
    endpoints: dict[str, tuple[Endpoint, ...]] = attrs.field(factory=dict)
    draining: frozenset[Endpoint] = frozenset()
    skipped: frozenset[str] = frozenset()
    counts: dict[Endpoint, int] = attrs.field(factory=dict)
    adapters: dict[str, str] = attrs.field(factory=dict)
    autoscaled: frozenset[str] = frozenset()
    load: dict[str, RouterLoad] = attrs.field(factory=dict)
    load_wanted: trio.Event = attrs.field(factory=trio.Event)

    def static_models(self) -> frozenset[str]:
        return self.static

    def set_autoscaled(self, models: frozenset[str]) -> None:
        self.autoscaled = models

    def load_report(self) -> Mapping[str, RouterLoad]:
        return dict(self.load)

    async def wait_load_wanted(self) -> None:
        await self.load_wanted.wait()
        self.load_wanted = trio.Event()

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints[model] = tuple(endpoints)

    def forget_model(self, model: str) -> None:
        self.endpoints.pop(model, None)

    def set_draining(self, draining: frozenset[Endpoint], *, skip: frozenset[str]) -> None:
        self.draining, self.skipped = draining, skip

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        self.adapters = dict(adapters)

    def in_flight(self, endpoints: frozenset[Endpoint]) -> dict[str, int]:
        return {e.url: n for e, n in self.counts.items() if e in endpoints and n}


class Peer:
    """The hub's end of a follower's connection, read frame by frame."""

    def __init__(self, end: LocalConnection) -> None:
        self.end = end

    async def table(self, table: RouteTable) -> None:
        await self.end.send(encode(Routes(table)))

    async def next_up(self) -> Hello | InFlight | Load | Traffic | Usage:
        return decode_up(await self.end.receive())


@asynccontextmanager
async def fake_following(target: FakeTarget) -> AsyncIterator[tuple[Follower, Peer]]:
    follower = Follower(target, "fake")
    hub_end, router_end = local_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follower.follow, router_end)
        peer = Peer(hub_end)
        assert await peer.next_up() == Hello(OLDEST_PROTOCOL, "fake", PROTOCOL)
        yield follower, peer
        nursery.cancel_scope.cancel()


async def test_a_table_sets_endpoints_and_drains_and_its_version_is_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = FakeTarget(static=frozenset({"static"}))
    async with fake_following(target) as (follower, peer):
        await peer.table(RouteTable(4, {"chat": (A, B), "static": (B,)}, frozenset({A}), True))
        assert await peer.next_up() == InFlight(4, {})
        # The config's static model is never the feed's; the drain skips it too.
        assert target.endpoints == {"chat": (A, B)}
        assert (target.draining, target.skipped) == (frozenset({A}), frozenset({"static"}))
        await peer.table(RouteTable(5, {}, frozenset(), True))  # chat is placed no more: forgotten
        assert await peer.next_up() == InFlight(5, {})
        assert target.endpoints == {} and target.draining == frozenset()
        assert follower.table is not None and follower.table.version == 5


async def test_while_an_endpoint_drains_its_count_is_reported_as_it_changes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = FakeTarget(counts={A: 2, B: 7})
    async with fake_following(target) as (_, peer):
        await peer.table(RouteTable(1, {"chat": (A, B)}, frozenset({A}), True))
        assert await peer.next_up() == InFlight(1, {A.url: 2})  # B does not drain
        start = trio.current_time()
        target.counts[A] = 0  # no new table: the follower looks again every 50 ms
        assert await peer.next_up() == InFlight(1, {})
        assert trio.current_time() - start == pytest.approx(COUNT_INTERVAL_S)
        # Nothing drains: nothing more is said, however long (the clock jumps an hour).
        await peer.table(RouteTable(2, {"chat": (A, B)}, frozenset(), True))
        assert await peer.next_up() == InFlight(2, {})
        target.counts[A] = 5
        with trio.move_on_after(3600) as quiet:
            await peer.next_up()
        assert quiet.cancelled_caught


async def test_autoscaled_models_load_is_reported_on_its_interval_and_at_once_when_held(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = FakeTarget(static=frozenset({"static"}))
    target.load = {"chat": RouterLoad(in_flight=3, ttft_p90_ms=40.0, idle_s=0.5)}
    async with fake_following(target) as (_, peer):
        # A table that autoscales nothing: no load is ever sent.
        await peer.table(RouteTable(1, {"chat": (A,)}, frozenset(), True))
        assert await peer.next_up() == InFlight(1, {})
        with trio.move_on_after(60) as quiet:
            await peer.next_up()
        assert quiet.cancelled_caught and target.autoscaled == frozenset()
        models = {"chat": (A,), "static": (B,)}
        table = RouteTable(2, models, frozenset(), True, autoscaled=frozenset({"chat", "static"}))
        await peer.table(table)
        assert await peer.next_up() == InFlight(2, {})
        assert target.autoscaled == frozenset({"chat"})  # never the config's static model
        start = trio.current_time()
        assert await peer.next_up() == Load(dict(target.load))
        assert trio.current_time() - start <= LOAD_INTERVAL_S
        # A request held: reported at once, not at the next interval.
        await trio.sleep(LOAD_INTERVAL_S / 4)
        target.load = {"chat": RouterLoad(held=1, idle_s=0.0)}
        start = trio.current_time()
        target.load_wanted.set()
        assert await peer.next_up() == Load(dict(target.load))
        assert trio.current_time() - start < LOAD_INTERVAL_S / 4


async def test_a_tables_lora_adapters_reach_the_router_but_never_shadow_its_static_models(
    autojump_clock: trio.testing.MockClock,
) -> None:
    target = FakeTarget(static=frozenset({"static"}))
    async with fake_following(target) as (_, peer):
        # Adapting the config's static model (whose engines are not the feed's): not here.
        models = {"chat": (A,), "static": (B,)}
        adapters = {"chat-sql": "chat", "static-sql": "static"}
        await peer.table(RouteTable(1, models, frozenset(), True, adapters))
        assert await peer.next_up() == InFlight(1, {})
        assert target.adapters == {"chat-sql": "chat"}
        # Named like the static model: not here either; one gone from the table, gone.
        await peer.table(RouteTable(2, {"chat": (A,)}, frozenset(), True, {"static": "chat"}))
        assert await peer.next_up() == InFlight(2, {})
        assert target.adapters == {}
        await peer.table(RouteTable(3, {"chat": (A,)}, frozenset(), True, {"chat-a": "chat"}))
        assert await peer.next_up() == InFlight(3, {})
        assert target.adapters == {"chat-a": "chat"}


async def test_a_frame_the_follower_cannot_use_ends_the_feed_with_why() -> None:
    follower = Follower(FakeTarget(), "fake")
    hub_end, router_end = local_pair()
    await hub_end.send('{"type": "routes", "table": 3}')
    with pytest.raises(FeedError), trio.fail_after(5):
        await follower.follow(router_end)


async def test_the_peer_closing_ends_the_feed_and_the_table_stays() -> None:
    target = FakeTarget()
    follower = Follower(target, "fake")
    hub_end, router_end = local_pair()
    await hub_end.send(encode(Routes(RouteTable(1, {"chat": (A,)}, frozenset(), True))))
    hub_end.outbox.close()
    with trio.fail_after(5):
        await follower.follow(router_end)  # returns: the ordinary end
    assert target.endpoints == {"chat": (A,)} and follower.complete.is_set()


async def follow_tables(follower: Follower, *tables: RouteTable) -> None:
    """`follower` follows one connection on which a hub sends `tables`, then closes it."""
    hub_end, router_end = local_pair()
    for table in tables:
        await hub_end.send(encode(Routes(table)))
    hub_end.outbox.close()
    with trio.fail_after(5):
        await follower.follow(router_end)


async def test_a_table_of_a_lower_epoch_is_refused_and_ends_the_feed() -> None:
    router = Router(config())
    follower = Follower(router.served, "fake")
    await follow_tables(follower, RouteTable(1, {"chat": (A,)}, frozenset(), True, epoch=5))
    assert follower.epoch == 5 and endpoints(router, "chat") == [A]
    # A control plane that led at epoch 4, woken: its table is refused, the feed ends.
    with pytest.raises(StaleEpoch, match=r"stale epoch 4 was refused .* follows epoch 5"):
        await follow_tables(follower, RouteTable(9, {"chat": (B,)}, frozenset(), True, epoch=4))
    assert endpoints(router, "chat") == [A] and follower.table is not None
    assert (follower.table.version, follower.epoch, follower.refused_stale) == (1, 5, 1)
    assert router.metrics.tables_refused == {"stale_epoch": 1}
    metrics = router.metrics.render(router.served.balancers, router.served.pools).decode()
    assert 'llmgw_route_tables_refused_total{reason="stale_epoch"} 1' in metrics.splitlines()
    # Epoch 0 (a single control plane) is never fenced; the same epoch and a later one are
    # applied as ever, the later one becoming the floor.
    await follow_tables(follower, RouteTable(2, {"chat": (B,)}, frozenset(), True))
    assert endpoints(router, "chat") == [B] and follower.epoch == 5
    await follow_tables(
        follower,
        RouteTable(3, {"chat": (A,)}, frozenset(), True, epoch=5),
        RouteTable(4, {"chat": (A, B)}, frozenset(), True, epoch=6),
    )
    assert endpoints(router, "chat") == [A, B] and follower.epoch == 6
    with pytest.raises(StaleEpoch):
        await follow_tables(follower, RouteTable(5, {}, frozenset(), True, epoch=5))
    assert endpoints(router, "chat") == [A, B] and follower.refused_stale == 2


async def test_an_incomplete_table_of_a_new_leader_raises_the_epoch() -> None:
    target = FakeTarget()
    follower = Follower(target, "fake")
    follower.apply(RouteTable(1, {"chat": (A,)}, frozenset(), True, epoch=2))
    follower.apply(RouteTable(1, {}, frozenset(), False, epoch=3))  # a new leader, starting
    assert target.endpoints == {"chat": (A,)}
    assert follower.table is not None and follower.table.epoch == follower.epoch == 3


async def test_a_connections_first_table_brings_a_load_report_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A router that holds requests when it connects (a new control plane, after a
    failover) says so as soon as it has the table, not a load interval later."""
    target = FakeTarget()
    target.load = {"chat": RouterLoad(held=2)}
    async with fake_following(target) as (_, peer):
        start = trio.current_time()
        table = RouteTable(1, {"chat": ()}, frozenset(), True, autoscaled=frozenset({"chat"}))
        await peer.table(table)
        reports = [await peer.next_up(), await peer.next_up()]
        assert Load({"chat": RouterLoad(held=2)}) in reports and InFlight(1, {}) in reports
        assert trio.current_time() - start < LOAD_INTERVAL_S / 4


def test_the_router_is_a_route_target_summing_in_flight_over_its_models() -> None:
    router = Router(config())
    target: RouteTarget = router.served
    assert target.static_models() == {"static"}
    target.set_endpoints("chat", (A, STATIC))
    target.set_draining(frozenset({A, STATIC}), skip=frozenset({"static"}))
    assert replica(router, "chat", STATIC).draining
    assert not replica(router, "static", STATIC).draining
    replica(router, "chat", STATIC).outstanding = 2
    replica(router, "static", STATIC).outstanding = 1
    assert target.in_flight(frozenset({A, STATIC})) == {A.url: 0, STATIC.url: 3}


# -- the follower with a Router and the hub --------------------------------------------------


async def test_tables_reach_the_router_and_a_drain_waits_for_its_requests() -> None:
    hub, router = RouteHub(), Router(config())
    async with following(hub, router) as follower:
        version = hub.publish({"chat": (A, B)}, frozenset(), complete=True)
        await until(lambda: hub.followers and hub.caught_up(version), "the first report", hub)
        assert endpoints(router, "chat") == [A, B]
        assert endpoints(router, "static") == [STATIC]
        assert router.served.pools[A].endpoint.api_key == "key-a"  # the engine key travels
        replica_a = router.served.replica("chat", A)
        assert replica_a is not None
        replica_a.outstanding = 2  # two requests in flight on A
        version = hub.publish({"chat": (A, B)}, frozenset({A}), complete=True)
        assert not hub.caught_up(version)  # it may still be sending A new requests
        await until(lambda: hub.caught_up(version), "the report on the drain", hub)
        assert replica_a.draining and not replica(router, "chat", B).draining
        assert hub.in_flight(A) == 2 and hub.in_flight(B) == 0
        replica_a.outstanding = 0  # both finished: reported without a new table
        await until(lambda: hub.in_flight(A) == 0, "the count to fall", hub)
        assert follower.table is not None and follower.table.version == version
        hub.publish({}, frozenset(), complete=True)  # the model is no longer placed
        await until(lambda: "chat" not in router.served.balancers, "the model to be forgotten")
        assert A not in router.served.pools and B not in router.served.pools  # their connections closed
        assert endpoints(router, "static") == [STATIC]  # the config's own stay


async def test_adapters_reach_the_router_and_an_incomplete_table_keeps_them() -> None:
    router = Router(config())
    follower = Follower(router.served, "test")
    first = RouteHub()
    version = first.publish({"chat": (A,)}, frozenset(), complete=True, adapters={"chat-sql": "chat"})
    assert first.publish({"chat": (A,)}, frozenset(), complete=True) == version + 1  # a change
    version = first.publish({"chat": (A,)}, frozenset(), complete=True, adapters={"chat-sql": "chat"})
    async with following(first, follower):
        await until(lambda: first.followers and first.caught_up(version), "the table", first)
        assert router.served.adapters == {"chat-sql": "chat"}
    # A control plane that just started (incomplete table) may not know them yet.
    second = RouteHub()
    version = second.publish({"chat": (A,)}, frozenset(), complete=False)
    async with following(second, follower):
        await until(lambda: second.followers and second.caught_up(version), "the report", second)
        assert router.served.adapters == {"chat-sql": "chat"}


async def test_a_workers_parent_relays_the_adapters_to_its_workers() -> None:
    plane, local = RouteHub(), RouteHub()  # the control plane's, the parent's for its workers
    relay, worker = TableRelay(local, "relay"), FakeTarget()
    async with trio.open_nursery() as nursery:
        up_plane, up_relay = local_pair()
        nursery.start_soon(plane.serve, up_plane, "relay")
        nursery.start_soon(relay.follow, up_relay)
        async with following(local, Follower(worker, "worker")):
            plane.publish({"chat": (A,)}, frozenset(), complete=True, adapters={"chat-sql": "chat"})
            await until(lambda: worker.adapters == {"chat-sql": "chat"}, "the adapters", local)
        nursery.cancel_scope.cancel()


async def test_a_follower_that_leaves_drops_out_of_the_counts() -> None:
    hub, router = RouteHub(), Router(config())
    hub.publish({"chat": (A,)}, frozenset({A}), complete=True)
    async with following(hub, router):
        await until(lambda: hub.followers == 1 and hub.caught_up(1), "the report", hub)
        replica(router, "chat", A).outstanding = 3
        await until(lambda: hub.in_flight(A) == 3, "the count", hub)
    assert hub.followers == 0 and hub.in_flight(A) == 0 and hub.caught_up(1)


async def test_an_incomplete_table_keeps_a_complete_one_but_takes_its_drains() -> None:
    router = Router(config())
    follower = Follower(router.served, "test")  # one for the router's life, across connections
    first = RouteHub()
    first.publish({"chat": (A, B)}, frozenset(), complete=True)
    async with following(first, follower):
        await until(lambda: first.caught_up(1) and first.followers, "the first table", first)
    # A control plane that just started has heard from one agent only, and drains B.
    second = RouteHub()
    version = second.publish({"chat": (B,)}, frozenset({B}), complete=False)
    async with following(second, follower):
        await until(lambda: second.followers and second.caught_up(version), "the report", second)
        assert endpoints(router, "chat") == [A, B]  # A is not dropped
        assert replica(router, "chat", B).draining
        version = second.publish({"chat": (B,)}, frozenset(), complete=True)
        await until(lambda: second.caught_up(version), "the complete table", second)
        assert endpoints(router, "chat") == [B]
        assert not replica(router, "chat", B).draining


async def test_a_fresh_router_takes_an_incomplete_table() -> None:
    hub, router = RouteHub(), Router(config())
    version = hub.publish({"chat": (A,)}, frozenset(), complete=False)
    async with following(hub, router):
        await until(lambda: hub.followers and hub.caught_up(version), "the report", hub)
        assert endpoints(router, "chat") == [A]


async def hub_rejects(*frames: str) -> str:
    """What FeedError the hub raises for a follower that sends `frames`."""
    hub = RouteHub()
    hub_end, peer = local_pair()
    for frame in frames:
        await peer.send(frame)
    with pytest.raises(FeedError) as raised, trio.fail_after(5):
        await hub.serve(hub_end, "memory")
    assert hub.followers == 0
    return str(raised.value)


async def test_bad_followers_are_closed_with_the_reason() -> None:
    hello = encode(Hello(PROTOCOL, "r"))
    assert "first message must be hello" in await hub_rejects(encode(InFlight(0, {})))
    assert "protocol 9 is not supported" in await hub_rejects(encode(Hello(9, "r")))
    assert "not JSON" in await hub_rejects(hello, "{")
    assert "never sent" in await hub_rejects(hello, encode(InFlight(7, {})))
    assert "hello is sent once" in await hub_rejects(hello, hello)


async def test_a_follower_gone_before_hello_ends_quietly() -> None:
    hub = RouteHub()
    hub_end, peer = local_pair()
    peer.close()
    with trio.fail_after(5):
        await hub.serve(hub_end, "memory")


async def test_a_silent_follower_is_given_up_after_the_hello_timeout(
    autojump_clock: object,
) -> None:
    hub = RouteHub()
    hub_end, _peer = local_pair()
    with pytest.raises(FeedError, match="no hello within"):
        with trio.fail_after(60):
            await hub.serve(hub_end, "memory")


def test_only_the_router_token_may_follow() -> None:
    router, admin = digest_of("router-secret"), digest_of("admin-secret")
    assert refusal(b"Bearer router-secret", router, admin) is None
    assert refusal(b"bearer  router-secret ", router, None) is None
    status, reason = refused(b"Bearer admin-secret", router, admin)
    assert status == 403 and "admin token may not follow" in reason
    assert refusal(None, router, admin) == (
        401,
        "a router token is required (Authorization: Bearer <router token>)",
    )
    assert refusal(b"Bearer guess", router, admin) == (401, "the router token is not valid")
    assert refused(b"Basic cm91dGVy", router, admin)[0] == 401
    status, reason = refused(b"Bearer router-secret", None, admin)
    assert status == 403 and "router_token_digest" in reason
    # One token for both would let a router act: refused whatever it sends.
    status, reason = refused(b"Bearer admin-secret", admin, admin)
    assert status == 403 and "is its admin token" in reason


# -- a router apart, as real processes -------------------------------------------------

ROUTER_TOKEN = "router-" + secrets.token_hex(8)
ADMIN_TOKEN = "admin-" + secrets.token_hex(8)
# The [admin] table rides in after [control]: status open, actions and routes by token.
ADMIN = (
    f'\n[admin]\ntoken_digest = "sha256:{digest_of(ADMIN_TOKEN)}"\n'
    f'router_token_digest = "sha256:{digest_of(ROUTER_TOKEN)}"\nopen_status = true\n'
)
# Engines that take a while to load, and streams of 16 words that last 0.8 s: a replica
# stopped before the routers' streams on it end cuts them.
SLOW = 'LLMGW_MOCK_STARTUP_DELAY = "1.5", LLMGW_MOCK_TPS = "20"'


class StreamLoop:
    """Streams through a router from two threads, so that one is nearly always in flight,
    until the block ends; what failed goes to `errors`."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.done = 0
        self.errors: list[str] = []
        self.served_by: set[str] = set()  # the engines' fingerprints, "mock:PORT"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def __enter__(self) -> StreamLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
            assert not thread.is_alive(), "the stream loop hangs"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream = self.client.chat.completions.create(
                    model="chat",
                    messages=CHAT,
                    stream=True,
                )
                words = []
                for chunk in stream:
                    self.served_by.add(chunk.system_fingerprint or "")
                    words += [c.delta.content or "" for c in chunk.choices]
                assert len("".join(words).split()) == 16, words
            except (openai.APIError, AssertionError) as exc:
                self.errors.append(f"stream {self.done}: {exc!r}")
            self.done += 1


def secret_file(fleet: Fleet, name: str, token: str) -> Path:
    path = fleet.procs.tmp / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def separate_router(
    fleet: Fleet, token: str, *, ca: Path | None = None, workers: int = 1
) -> Proc:
    """`llmgw-server router` with the control plane's own config, on a port of its own,
    trusting the fleet's CA (or `ca`), with `workers` processes."""
    port = free_port()
    text = (fleet.procs.tmp / "server.toml").read_text()
    path = fleet.procs.tmp / f"router-{port}.toml"
    text = text.replace(f'listen = "127.0.0.1:{fleet.port}"', f'listen = "127.0.0.1:{port}"')
    path.write_text(text.replace("workers = 1\n", f"workers = {workers}\n"))
    argv = [
        sys.executable, "-m", "llmgw_server", "router", "--config", str(path),
        "--control", fleet.control, "--ca", str(ca or fleet.certs / "ca.crt"),
        "--token-file", str(secret_file(fleet, f"token-{port}", token)),
    ]  # fmt: skip
    proc = Proc(argv, port)
    fleet.procs.all.append(proc)
    proc.wait_http("/healthz")
    return proc


def fingerprint(client: openai.OpenAI, session: str | None = None) -> str:
    """Which engine answers (one token: the engines here write 20 a second)."""
    answer = client.chat.completions.create(
        model="chat",
        messages=CHAT,
        max_tokens=1,
        extra_headers={"x-session-id": session} if session else None,
    )
    return answer.system_fingerprint or ""


def available(router_url: str, model: str = "chat") -> int:
    """How many of `model`'s replicas the router at `router_url` sends requests to."""
    page = httpx.get(router_url + "/metrics", timeout=10).text
    head = f'llmgw_replica_available{{model="{model}",'
    return sum(line.startswith(head) and line.endswith(" 1") for line in page.splitlines())


def ask(router: Proc, messages: list[dict[str, str]]) -> str:
    body = {"model": "chat", "messages": messages, "max_tokens": 3}
    response = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    return str(response.json()["system_fingerprint"])


def upgrade(fleet: Fleet, token: str | None) -> httpx.Response:
    """The websocket handshake on /v1/routes, as far as its answer."""
    headers = {
        "connection": "Upgrade",
        "upgrade": "websocket",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "sec-websocket-version": "13",
    }
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return httpx.get(fleet.control + "/v1/routes", headers=headers, verify=fleet.tls, timeout=5)


def test_a_separate_router_follows_keeps_serving_without_the_control_plane_and_catches_up(
    fleet: Fleet,
) -> None:
    fleet.server(model("chat", replicas=2), control=ADMIN)
    fleet.agent("gpu-1", "node-2xl4.toml", env=SLOW)
    old = wait_until(
        lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None,
        what="both replicas on gpu-1",
    )
    router = separate_router(fleet, ROUTER_TOKEN)
    apart = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    inside = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: [m.id for m in apart.models.list()] == ["chat"], what="the router to follow")
    old_ports = {"mock:" + r["url"].rsplit(":", 1)[1] for r in old}
    assert fingerprint(apart) in old_ports
    # Rendezvous hashing: both routers send a session to the same replica, once each has
    # both (once, the control plane's own router had only one when first asked).
    wait_until(
        lambda: available(router.url) == available(fleet.url) == 2,
        what="both replicas available to both routers",
    )
    picks = {s: fingerprint(apart, s) for s in (f"session-{i}" for i in range(16))}
    assert picks == {s: fingerprint(inside, s) for s in picks}
    assert set(picks.values()) == old_ports  # 16 sessions reach both replicas
    # Cache-aware: each conversation stays on the replica that holds its prompt.
    rng = random.Random(11)
    conversations = [
        [{"role": "system", "content": words(rng, 300)}, {"role": "user", "content": words(rng, 9)}]
        for _ in range(6)
    ]
    homes: dict[int, set[str]] = {i: set() for i in range(len(conversations))}
    for _turn in range(3):
        for i, messages in enumerate(conversations):
            homes[i].add(ask(router, messages))
            messages += [
                {"role": "assistant", "content": words(rng, 9)},
                {"role": "user", "content": words(rng, 6)},
            ]
    assert all(len(h) == 1 for h in homes.values()), homes
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_balancing_decisions_total", model="chat", kind="cache_hit") == 12

    # Only the router token follows; it acts on nothing.
    refused = upgrade(fleet, None)
    assert refused.status_code == 401 and "a router token is required" in refused.text
    refused = upgrade(fleet, ADMIN_TOKEN)
    assert refused.status_code == 403 and "the admin token may not follow" in refused.text
    assert upgrade(fleet, "guess").status_code == 401
    assert upgrade(fleet, ROUTER_TOKEN).status_code == 101
    cordon = httpx.post(
        fleet.control + "/v1/admin/nodes/gpu-1/cordon",
        headers={"authorization": f"Bearer {ROUTER_TOKEN}"},
        json={},
        verify=fleet.tls,
    )
    assert cordon.status_code == 401 and not fleet.node("gpu-1")["cordoned"]
    # A router with the admin token, or trusting another CA, is told why it cannot follow:
    # test_router_apart, in one process (route_feed.remote against a control port).

    # The control plane goes away: the engines stay (their agents keep them), and so does
    # the separate router's table.
    assert fleet.server_proc is not None
    fleet.server_proc.stop()
    wait_until(
        lambda: "serving the last route table (1 models)" in router.output(),
        what="the router to notice",
    )
    # Every session still reaches its own replica, both replicas among them. (Six asks
    # without a session reached both only while cache_aware's recent share had not
    # decayed: a machine busy enough sent all six to one.)
    assert {s: fingerprint(apart, s) for s in picks} == picks
    wait_until(
        lambda: "connection refused by 127.0.0.1:" in router.output(),
        what="the router to say the control plane is unreachable",
    )

    # It comes back; a second node joins and the first is drained, under load through
    # the separate router: the replicas move and no request fails.
    fleet.server(model("chat", replicas=2), control=ADMIN)
    fleet.agent("gpu-2", "node-2xl4.toml", env=SLOW)
    wait_until(lambda: fleet.node("gpu-2")["status"] == "reachable", what="gpu-2 to register")
    wait_until(lambda: len(fleet.serving("chat")) == 2, what="the replicas to be adopted")
    wait_until(
        lambda: router.output().count("following the route table of") == 2,
        what="the router to follow again",
    )
    admin_token = secret_file(fleet, "admin-token", ADMIN_TOKEN)
    with StreamLoop(apart) as loop:
        wait_until(lambda: loop.done >= 4, what="requests before the drain")
        drain = fleet.cli("drain", "gpu-1", "--token-file", str(admin_token), timeout=60)
        after = loop.done
        wait_until(lambda: loop.done >= after + 4, what="requests after the drain")
    assert drain.returncode == 0, drain.stderr
    assert loop.errors == []
    new = fleet.serving("chat")
    assert [r["shards"][0]["node"] for r in new] == ["gpu-2", "gpu-2"]
    new_ports = {"mock:" + r["url"].rsplit(":", 1)[1] for r in new}
    assert loop.served_by == old_ports | new_ports  # old ones, then new ones
    assert {fingerprint(apart, s) for s in picks} == new_ports  # caught up
    assert router.popen.poll() is None
    lines = router.output()
    assert "following the route table of 127.0.0.1" in lines
    assert ROUTER_TOKEN not in lines


def test_the_router_command_says_what_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:1"]\n')
    monkeypatch.delenv("LLMGW_ROUTER_TOKEN", raising=False)
    assert run_cli(["router", "--config", str(path)]) == 2
    assert "--control URL is required" in capsys.readouterr().err
    assert run_cli(["router", "--config", str(path), "--control", "ftp://cp:8081"]) == 2
    assert "must be the control plane's https:// URL" in capsys.readouterr().err
    assert run_cli(["router", "--config", str(path), "--control", "https://cp:8081"]) == 2
    assert "a router token is required: --token-file PATH or $LLMGW_ROUTER_TOKEN" in (
        capsys.readouterr().err
    )
    empty = tmp_path / "token"
    empty.write_text("\n")
    argv = ["router", "--config", str(path), "--control", "https://cp", "--token-file", str(empty)]
    assert run_cli(argv) == 2
    assert f"the router token file {empty} is empty" in capsys.readouterr().err
    assert feed_target("https://cp.example:8081/ui") == Target(
        "cp.example", 8081, "/v1/routes", True
    )
    assert feed_target("http://[::1]") == Target("::1", 80, "/v1/routes", False)


def test_a_separate_router_with_workers_follows_keeps_sessions_reloads_and_loses_nothing_in_a_drain(
    fleet: Fleet,
) -> None:
    """The one end-to-end thread of a router apart with workers: the parent follows the
    control plane through its relay (tested alone in test_workers), its workers follow
    the parent. Which worker takes a connection is chosen by pausing the other one."""
    from test_workers import fresh_client, only_worker_accepts

    fleet.server(model("chat", replicas=2), control=ADMIN)
    fleet.agent("gpu-1", "node-2xl4.toml", env=SLOW)
    old = wait_until(
        lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None,
        what="both replicas on gpu-1",
    )
    router = separate_router(fleet, ROUTER_TOKEN, workers=2)
    inside = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)

    def answered_by(session: str) -> tuple[str, str]:
        response = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "chat", "messages": CHAT, "max_tokens": 3},
            headers={"connection": "close", "x-session-id": session},
            timeout=20,
        )
        assert response.status_code == 200, response.text
        worker = response.headers["x-llmgw-worker"].split(";")[0]
        return worker, str(response.json()["system_fingerprint"])

    def listed() -> set[str]:
        response = httpx.get(router.url + "/v1/models", headers={"connection": "close"})
        return {m["id"] for m in response.json()["data"]}

    # Each worker follows, and sends each session where the server's own router does
    # (rendezvous hashing over the same table).
    sessions = [f"s{n}" for n in range(8)]
    # The server's own router may apply the table a moment after the status says both
    # serve (a CI run hashed every session onto the one replica it had yet).
    wait_until(
        lambda: httpx.get(fleet.url + "/readyz").json()["models"].get("chat") == 2,
        what="the server's router to hold both replicas",
    )
    homes = {s: fingerprint(inside, s) for s in sessions}
    assert set(homes.values()) == {"mock:" + r["url"].rsplit(":", 1)[1] for r in old}
    for index in ("0", "1"):
        with only_worker_accepts(router, int(index)):
            wait_until(lambda: listed() == {"chat"}, what=f"worker {index} to follow")
            assert {s: answered_by(s) for s in sessions} == {
                s: (index, home) for s, home in homes.items()
            }

    # SIGHUP reloads every worker: a static model added to the file (one of the engines,
    # which answers health probes) is served by both.
    path = fleet.procs.tmp / f"router-{router.port}.toml"
    added = f'[[models]]\nname = "added"\nendpoints = ["{old[0]["url"]}"]\n'
    path.write_text(path.read_text() + "\n" + added)
    router.popen.send_signal(signal.SIGHUP)
    for index in ("0", "1"):
        with only_worker_accepts(router, int(index)):
            wait_until(lambda: listed() == {"chat", "added"}, what=f"worker {index} to reload")

    # A second node joins and the first is drained, under load through both workers: the
    # replicas move and no request fails.
    fleet.agent("gpu-2", "node-2xl4.toml", env=SLOW)
    wait_until(lambda: fleet.node("gpu-2")["status"] == "reachable", what="gpu-2 to register")
    loops = [RequestLoop(fresh_client(router.url)) for _ in range(3)]
    for loop in loops:
        loop.__enter__()
    try:
        wait_until(lambda: all(loop.done >= 4 for loop in loops), what="requests before")
        admin = secret_file(fleet, "admin-token", ADMIN_TOKEN)
        drain = fleet.cli("--token-file", str(admin), "drain", "gpu-1", timeout=60)
        after = [loop.done for loop in loops]
        wait_until(
            lambda: all(loop.done >= n + 4 for loop, n in zip(loops, after, strict=True)),
            what="requests after the drain",
        )
    finally:
        for loop in loops:
            loop.__exit__()
    assert drain.returncode == 0, drain.stderr
    assert [loop.errors for loop in loops] == [[], [], []]
    new = fleet.serving("chat")
    assert [r["shards"][0]["node"] for r in new] == ["gpu-2", "gpu-2"]
    ports = {"mock:" + r["url"].rsplit(":", 1)[1] for r in old + new}
    assert set().union(*(loop.served_by for loop in loops)) == ports
    assert router.popen.poll() is None

