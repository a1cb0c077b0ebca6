"""A router's health probes and its own stalls (router/health.py, llmgw_core/awake_time.py),
on the autojump clock: a jump of the clock inside the probe is the router's process
stopped (nothing of it runs, its timers expire together); a sleep is an engine that does
not answer."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from llmgw_core.catalog import Endpoint
from llmgw_server.router.health import probe_forever
from test_load_signals import router_for


@pytest.mark.parametrize("router_stalled", [True, False])
async def test_a_probe_that_timed_out_while_the_router_stalled_is_not_judged(
    autojump_clock: trio.testing.MockClock, router_stalled: bool
) -> None:
    async def engine(request: httpx.Request) -> httpx.Response:
        if router_stalled:
            autojump_clock.jump(3.0)
        else:
            await trio.sleep(3.0)
        raise httpx.ReadTimeout("timed out", request=request)

    router = router_for(Endpoint("127.0.0.1", 1), balancing="round_robin")
    (replica,) = router.served.balancers["m"].replicas
    transport = httpx.MockTransport(engine)
    async with httpx.AsyncClient(transport=transport) as client, trio.open_nursery() as nursery:
        await nursery.start(probe_forever, router, client)  # after the first round
        assert replica.healthy is router_stalled
        nursery.cancel_scope.cancel()
