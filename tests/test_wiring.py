"""The router service every router process runs (llmgw_server.wiring.serve_router), in
one process: what it starts before saying it serves, when it turns ready, and the order
of its shutdown. Each layout's own part is tested with its process (test_follower,
test_router_apart, test_workers)."""

from __future__ import annotations

import logging
from functools import partial

import attrs
import httpx
import pytest
import trio

from llmgw_core.config import parse_config
from llmgw_server.route_feed.follower import Follower
from llmgw_server.route_feed.messages import RouteTable
from llmgw_server.router.front import Router
from llmgw_server.wiring import serve_router


def router() -> Router:
    # An engine nobody listens on: its probe fails at once, and the health round ends.
    return Router(
        parse_config(
            {
                "router": {"health_interval_s": 0.05},
                "models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}],
            },
            "t.toml",
        )
    )


@attrs.define
class Recorded:
    """A layout that records what the service asked of it; `follower`: readiness waits
    for its complete table."""

    router: Router
    follower: Follower | None = None
    events: list[str] = attrs.field(factory=list)

    def listening(self) -> str | None:
        return None

    async def start(self, nursery: trio.Nursery, router: Router) -> Follower | None:
        self.events.append("start")
        return self.follower

    def closing(self) -> None:
        self.events.append(f"closing (draining: {self.router.draining})")

    async def drained(self) -> None:
        self.events.append("drained")


async def test_the_service_is_ready_when_it_says_it_serves_and_drains_before_its_layout_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.server")
    r = router()
    layout = Recorded(r)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            serve = partial(serve_router, r, listeners, layout, sighup=None, stop=stop)
            await nursery.start(serve)
            assert layout.events == ["start"] and r.ready  # one health round came first
            async with httpx.AsyncClient() as client:
                ready = await client.get(f"http://127.0.0.1:{port}/readyz")
            assert ready.status_code == 200
            stop.set()
    # Told once requests in flight ended (a control plane then closes its agents' streams).
    assert layout.events == ["start", "closing (draining: True)", "drained"]
    assert "shutting down: no new connections" in caplog.text and "stopped" in caplog.text
    with pytest.raises(OSError):  # the port is closed
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_with_a_follower_probes_and_readiness_wait_for_a_complete_table() -> None:
    r = router()
    follower = Follower(r.served, "test")
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            serve = partial(serve_router, r, listeners, Recorded(r, follower), sighup=None)
            await nursery.start(partial(serve, stop=stop))
            await trio.sleep(0.2)  # four health intervals: none runs without a table
            assert not r.ready
            follower.apply(RouteTable(1, {}, frozenset(), complete=False))
            await trio.sleep(0.2)
            assert not r.ready  # an incomplete table may lack the fleet's models
            follower.apply(RouteTable(2, {}, frozenset(), complete=True))
            while not r.ready:
                await trio.sleep(0.01)
            stop.set()
