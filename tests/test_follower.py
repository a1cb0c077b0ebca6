"""Routers following a control plane's route table.

In one process: the hub and a follower over memory channels (what the server's own
router does), the router token's rules. As real processes: a server with agents and
engines, and a separate `router` process following it over TLS with a router token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from llmgw_core.catalog import Endpoint
from llmgw_core.config import Config, digest_of, parse_config
from llmgw_core.route_feed import PROTOCOL, FeedError, Hello, InFlight, encode
from llmgw_server.plane.routes import RouteHub, refusal
from llmgw_server.router.follower import Follower, local_pair
from llmgw_server.router.front import Router

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
    return [r.endpoint for r in router.balancers[model].replicas]


async def until(check: object, what: str, hub: RouteHub | None = None) -> None:
    """Wait for `check()` (woken by the hub's reports when given), at most 5 s."""
    with trio.fail_after(5):
        while not check():  # type: ignore[operator]
            if hub is not None:
                await hub.wait_reported()
            else:
                await trio.sleep(0.01)


@asynccontextmanager
async def following(hub: RouteHub, router: Router | Follower) -> AsyncIterator[Follower]:
    follower = router if isinstance(router, Follower) else Follower(router, "test")
    hub_end, router_end = local_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.serve, hub_end, "memory")
        nursery.start_soon(follower.follow, router_end)
        yield follower
        nursery.cancel_scope.cancel()


async def test_tables_reach_the_router_and_a_drain_waits_for_its_requests() -> None:
    hub, router = RouteHub(), Router(config())
    async with following(hub, router) as follower:
        version = hub.publish({"chat": (A, B)}, frozenset(), complete=True)
        await until(lambda: hub.followers and hub.caught_up(version), "the first report", hub)
        assert endpoints(router, "chat") == [A, B]
        assert endpoints(router, "static") == [STATIC]
        assert router.pools[A].endpoint.api_key == "key-a"  # the engine key travels
        replica_a = router.replica("chat", A)
        assert replica_a is not None
        replica_a.outstanding = 2  # two requests in flight on A
        version = hub.publish({"chat": (A, B)}, frozenset({A}), complete=True)
        assert not hub.caught_up(version)  # it may still be sending A new requests
        await until(lambda: hub.caught_up(version), "the report on the drain", hub)
        assert replica_a.draining and not router.replica("chat", B).draining  # type: ignore[union-attr]
        assert hub.in_flight(A) == 2 and hub.in_flight(B) == 0
        replica_a.outstanding = 0  # both finished: reported without a new table
        await until(lambda: hub.in_flight(A) == 0, "the count to fall", hub)
        assert follower.table is not None and follower.table.version == version
        hub.publish({}, frozenset(), complete=True)  # the model is no longer placed
        await until(lambda: not endpoints(router, "chat"), "the model to lose its endpoints")
        assert endpoints(router, "static") == [STATIC]  # the config's own stay


async def test_a_follower_that_leaves_drops_out_of_the_counts() -> None:
    hub, router = RouteHub(), Router(config())
    hub.publish({"chat": (A,)}, frozenset({A}), complete=True)
    async with following(hub, router):
        await until(lambda: hub.followers == 1 and hub.caught_up(1), "the report", hub)
        router.replica("chat", A).outstanding = 3  # type: ignore[union-attr]
        await until(lambda: hub.in_flight(A) == 3, "the count", hub)
    assert hub.followers == 0 and hub.in_flight(A) == 0 and hub.caught_up(1)


async def test_an_incomplete_table_keeps_a_complete_one_but_takes_its_drains() -> None:
    router = Router(config())
    follower = Follower(router, "test")  # one for the router's life, across connections
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
        assert router.replica("chat", B).draining  # type: ignore[union-attr]
        version = second.publish({"chat": (B,)}, frozenset(), complete=True)
        await until(lambda: second.caught_up(version), "the complete table", second)
        assert endpoints(router, "chat") == [B]
        assert not router.replica("chat", B).draining  # type: ignore[union-attr]


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
    status, reason = refusal(b"Bearer admin-secret", router, admin)  # type: ignore[misc]
    assert status == 403 and "admin token may not follow" in reason
    assert refusal(None, router, admin) == (
        401,
        "a router token is required (Authorization: Bearer <router token>)",
    )
    assert refusal(b"Bearer guess", router, admin) == (401, "the router token is not valid")
    assert refusal(b"Basic cm91dGVy", router, admin)[0] == 401  # type: ignore[index]
    status, reason = refusal(b"Bearer router-secret", None, admin)  # type: ignore[misc]
    assert status == 403 and "router_token_digest" in reason
    # One token for both would let a router act: refused whatever it sends.
    status, reason = refusal(b"Bearer admin-secret", admin, admin)  # type: ignore[misc]
    assert status == 403 and "is its admin token" in reason
