"""The heartbeat interval a node is given grows with the fleet, so that the fleet's
heartbeats stay within `[control] heartbeats_per_s` (heartbeat_pace)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from llmgw_server.control.heartbeat_pace import heartbeat_interval, unreachable_after


def test_a_small_fleet_keeps_the_base_interval() -> None:
    assert heartbeat_interval(1, 5.0, 200.0) == 5.0
    assert heartbeat_interval(1000, 5.0, 200.0) == 5.0
    assert heartbeat_interval(2000, 5.0, 200.0) == 10.0
    assert heartbeat_interval(10_000, 5.0, 200.0) == 50.0
    assert unreachable_after(5.0, 15.0) == 15.0
    assert unreachable_after(50.0, 15.0) == 150.0


@given(
    nodes=st.integers(1, 50_000),
    base=st.sampled_from([0.5, 1.0, 5.0]),
    per_s=st.sampled_from([1.0, 50.0, 200.0, 1000.0]),
)
def test_the_fleets_heartbeats_stay_within_the_bound(nodes: int, base: float, per_s: float) -> None:
    interval = heartbeat_interval(nodes, base, per_s)
    assert interval >= base
    # Every node given this interval: within the bound.
    assert nodes / interval <= per_s * (1 + 1e-9)
    # Registered one by one, each keeping the interval of its registration: the total
    # exceeds the bound by the log of the growth past it, no more.
    if nodes <= 3000:
        total = sum(1 / heartbeat_interval(n, base, per_s) for n in range(1, nodes + 1))
        knee = per_s * base  # the nodes the bound takes at the base interval
        bound = nodes / base if nodes <= knee else per_s * (1 + math.log(nodes / knee))
        assert total <= bound * (1 + 1e-9) + 1
