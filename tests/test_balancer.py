"""The balancer's decisions, with no I/O."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_core.catalog import Endpoint
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.policies import registered


def replicas(n: int) -> list[Replica]:
    return [Replica(Endpoint("127.0.0.1", 9000 + i)) for i in range(n)]


def test_least_outstanding_wins() -> None:
    rs = replicas(3)
    rs[0].outstanding, rs[1].outstanding, rs[2].outstanding = 4, 1, 3
    assert Balancer(rs).pick() is rs[1]


def test_ties_rotate_instead_of_piling_on_the_first() -> None:
    rs = replicas(3)
    balancer = Balancer(rs)
    assert Counter(balancer.pick() for _ in range(30)) == Counter({r: 10 for r in rs})


@given(st.lists(st.integers(0, 50), min_size=5, max_size=40), st.integers(0, 2**32))
def test_power_of_two_choices_never_picks_the_busiest_of_two(loads: list[int], seed: int) -> None:
    rs = replicas(len(loads))
    for r, load in zip(rs, loads, strict=True):
        r.outstanding = load
    chosen = Balancer(rs, rng=random.Random(seed)).pick()
    assert chosen is not None
    # With many replicas the pick is the lighter of two sampled ones: never the single busiest.
    busiest = max(loads)
    assert chosen.outstanding < busiest or loads.count(busiest) > 1 or len(set(loads)) == 1


def test_excluded_and_unavailable_replicas_are_skipped() -> None:
    rs = replicas(3)
    rs[0].healthy = False
    balancer = Balancer(rs)
    assert balancer.pick(exclude=[rs[1]]) is rs[2]
    assert balancer.pick(exclude=[rs[1], rs[2]]) is None


def test_session_affinity_holds_while_healthy_then_moves() -> None:
    rs = replicas(2)
    balancer = Balancer(rs)
    first = balancer.pick(session="s")
    assert first is not None
    first.outstanding = 10  # still pinned even when busier
    assert all(balancer.pick(session="s") is first for _ in range(5))
    first.healthy = False
    moved = balancer.pick(session="s")
    assert moved is not None and moved is not first
    # Rendezvous hashing keeps no memory: back home once home is back, as every other
    # router process (which never saw the move) would also send it.
    first.healthy = True
    assert balancer.pick(session="s") is first


@pytest.mark.parametrize("balancing", tuple(registered()))
def test_sessions_agree_across_router_processes_in_every_mode(balancing: str) -> None:
    """Two balancers that share nothing (two router processes) send a session to one replica."""
    mine = Balancer(replicas(5), balancing=balancing)
    theirs = Balancer(replicas(5), balancing=balancing)
    homes: Counter[int] = Counter()
    for i in range(200):
        a = mine.pick(session=f"user-{i}")
        b = theirs.pick(session=f"user-{i}")
        assert a is not None and b is not None and a.endpoint == b.endpoint
        homes[a.endpoint.port] += 1
    assert len(homes) == 5 and min(homes.values()) >= 20  # and they spread


def test_ejection_after_consecutive_failures_and_probe_back() -> None:
    rs = replicas(2)
    balancer = Balancer(rs, eject_after_failures=3, eject_cooldown_s=10)
    bad = rs[0]
    assert not balancer.failed(bad, now=0)
    balancer.succeeded(bad)  # a success resets the run of failures
    assert not balancer.failed(bad, now=1)
    assert not balancer.failed(bad, now=2)
    assert balancer.failed(bad, now=3)
    assert not bad.available and balancer.pick(exclude=[rs[1]]) is None
    assert not balancer.due_for_probe(bad, now=12)
    assert balancer.due_for_probe(bad, now=13)
    balancer.probed(bad, ok=False, now=13)
    assert not bad.available and not balancer.due_for_probe(bad, now=22)
    balancer.probed(bad, ok=True, now=23)
    assert bad.available and bad.failures == 0


def test_a_probe_sent_before_the_ejection_does_not_lift_it() -> None:
    """A health probe in flight while requests eject the replica answers about the replica
    as it was: seen in CI, where it lifted an ejection 0.1 s old."""
    rs = replicas(2)
    balancer = Balancer(rs, eject_after_failures=2, eject_cooldown_s=10)
    bad = rs[0]
    asked_at = 1.0  # the probe goes out; two failures eject before it answers
    assert not balancer.failed(bad, now=1.1)
    assert balancer.failed(bad, now=1.2)
    balancer.probed(bad, ok=True, now=1.3, asked_at=asked_at)
    assert bad.ejected and not bad.available
    balancer.probed(bad, ok=True, now=11.5, asked_at=11.2)  # sent after the cooldown
    assert bad.available


def test_probes_mark_replicas_unhealthy_and_back() -> None:
    rs = replicas(1)
    balancer = Balancer(rs)
    balancer.probed(rs[0], ok=False, now=0)
    assert balancer.healthy_count == 0 and balancer.pick() is None
    balancer.probed(rs[0], ok=True, now=1)
    assert balancer.pick() is rs[0]


def test_set_endpoints_keeps_known_replicas_and_moves_their_sessions() -> None:
    rs = replicas(3)
    balancer = Balancer(list(rs))
    home = balancer.pick(session="s")
    assert home is not None
    kept = [r for r in rs if r is not home]
    kept[0].outstanding = 3
    new = Endpoint("127.0.0.1", 9100)
    removed = balancer.set_endpoints([kept[0].endpoint, kept[1].endpoint, new])
    assert removed == [home]
    assert balancer.replicas[:2] == kept and balancer.replicas[0].outstanding == 3
    moved = balancer.pick(session="s")
    assert moved is not None and moved is not home  # its home is gone: the next in its ranking


def test_a_draining_replica_takes_no_new_requests() -> None:
    rs = replicas(2)
    balancer = Balancer(rs)
    balancer.mark_draining({rs[0].endpoint})  # the route table's word
    assert rs[0].draining and not rs[1].draining
    assert all(balancer.pick() is rs[1] for _ in range(4))
    balancer.mark_draining(())  # no longer draining: it takes requests again
    assert {balancer.pick() for _ in range(4)} == set(rs)


def test_what_each_status_says_about_the_replica() -> None:
    from llmgw_server.router.balancer import Verdict, judge

    assert {s: judge(s) for s in (200, 400, 401, 404, 422, 501, 505)} == dict.fromkeys(
        (200, 400, 401, 404, 422, 501, 505), Verdict.RELAY
    )
    assert [judge(s) for s in (500, 502, 504)] == [Verdict.FAILED] * 3
    assert [judge(s) for s in (429, 503)] == [Verdict.BUSY] * 2


def test_retry_after_within_bounds() -> None:
    from llmgw_server.router.balancer import busy_pause_s

    assert busy_pause_s(b"7") == 7.0
    assert busy_pause_s(b"") == 1.0  # none given: still set aside for a moment
    assert busy_pause_s(b"Wed, 21 Oct 2015 07:28:00 GMT") == 1.0
    assert busy_pause_s(b"nan") == 1.0
    assert busy_pause_s(b"-5") == 1.0
    assert busy_pause_s(b"86400") == 60.0


def test_a_busy_replica_goes_last_until_its_pause_ends() -> None:
    rs = replicas(2)
    balancer = Balancer(rs)
    balancer.busy(rs[0], 5.0, now=100.0)
    assert {balancer.pick(now=101.0) for _ in range(10)} == {rs[1]}
    assert balancer.pick(exclude=[rs[1]], now=101.0) is rs[0]  # busy, but the only one
    assert {balancer.pick(now=105.0) for _ in range(10)} == set(rs)
