"""Work proportional to change: what the core visits per event, counted, not timed.

The same fleet is built at several sizes: 4 replicas of a small model that serve,
and two models no node can hold, one of them across nodes (placement keeps falling
short on them, as in the fleet bench). Each event below changes one node or one replica, so the nodes, replicas
and shard records the core visits for it must be the same whatever the fleet's
size. A count that grows with the fleet fails the test, whatever the machine.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from fleetsim import Fleet, catalog, gpu_node, model

from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import ShardState

SIZES = (100, 1_000, 3_000)
SETTINGS = ControlSection(settle_after_start_s=0.0, reconcile_interval_s=0.0)
EVENTS = (
    "registration, on average over the fleet's",
    "heartbeat that changes nothing",
    "tick with nothing due",
    "a new node registers",
    "a node holding a replica reconnects",
    "a shard fails",
    "its restart comes due",
    "the operator cordons a node",
    "a node's stream closes",
)
Cost = tuple[int, int, int]  # nodes, replicas, shard records visited


def visited(f: Fleet, event: Callable[[], object]) -> Cost:
    before = attrs.evolve(f.cp.work)
    event()
    after = f.cp.work
    return (
        after.nodes - before.nodes,
        after.replicas - before.replicas,
        after.shards - before.shards,
    )


def events(n: int) -> dict[str, Cost]:
    """The cost of each event on a fleet of `n` nodes; time stays short of every
    heartbeat deadline, so that only the event itself is counted."""
    f = Fleet(
        SETTINGS,
        catalog(
            model("small", 4, tensor_parallel=1),
            model("huge", 1, tensor_parallel=8, gpu_model="B300"),
            model("spanning", 1, tensor_parallel=8, pipeline_parallel=2, gpu_model="B300"),
        ),
        now=0.0,
    )
    out: dict[str, Cost] = {}
    joined = visited(f, lambda: f.join(*(gpu_node(f"n{i}", 2) for i in range(n))))
    # Per registration, rounded down: the first ones place the small model.
    out["registration, on average over the fleet's"] = (
        joined[0] // n,
        joined[1] // n,
        joined[2] // n,
    )
    f.ready_all()
    holders = sorted({name for name, _ in f.shards()})
    idle = f"n{n - 1}"
    assert idle not in holders
    f.now = 1.0
    out["heartbeat that changes nothing"] = visited(f, lambda: f.feed(f.cp.heartbeat(idle, f.now)))
    assert not f.last_step.reconciled and not f.last_step.commands
    out["tick with nothing due"] = visited(f, lambda: f.cp.tick(f.now))
    out["a new node registers"] = visited(f, lambda: f.join(gpu_node("late", 2)))
    out["a node holding a replica reconnects"] = visited(f, lambda: f.register(holders[0]))
    name, shard = f.shards()[0]
    rid = shard.spec.replica_id
    out["a shard fails"] = visited(
        f, lambda: f.report(name, rid, 0, ShardState.FAILED, "exit status 1")
    )
    f.now += SETTINGS.restart_backoff_s
    out["its restart comes due"] = visited(f, lambda: f.feed(f.cp.tick(f.now)))
    assert any(s.spec.replica_id == rid and s.spec.attempt == 1 for _, s in f.shards())
    out["the operator cordons a node"] = visited(f, lambda: f.feed(f.cp.cordon(idle, True, f.now)))
    out["a node's stream closes"] = visited(f, lambda: f.silence(idle, tell=True))
    assert list(out) == list(EVENTS)
    return out


# Session, not module: pytest-xdist (make test) may hand a worker another module's tests
# between two of these, and a module fixture would be made again each time.
@pytest.fixture(scope="session")
def costs() -> dict[int, dict[str, Cost]]:
    return {n: events(n) for n in SIZES}


def test_a_heartbeat_that_changes_nothing_visits_nothing(
    costs: dict[int, dict[str, Cost]],
) -> None:
    for n in SIZES:
        assert costs[n]["heartbeat that changes nothing"] == (0, 0, 0)


@pytest.mark.parametrize("event", EVENTS)
def test_the_work_of_an_event_does_not_grow_with_the_fleet(
    costs: dict[int, dict[str, Cost]], event: str
) -> None:
    by_size = {n: costs[n][event] for n in SIZES}
    smallest = by_size[SIZES[0]]
    for cost in by_size.values():
        assert cost == smallest, f"{event}: nodes, replicas, shards visited by size: {by_size}"
