"""What the leader keeps in its store and what a new leader does with it (issue 35):
control.persisted (the stored values, their one converter, snapshot, diff, hostile
values) and Reconciler.restore (placement waits for exactly the stored nodes, the
store's flags win, the autoscalers go on)."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from fleetsim import Fleet, catalog, gpu_node, model, profile

from llmgw_core.autoscaling import Autoscale
from llmgw_core.catalog import Catalog, ModelEntry
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import ShardState
from llmgw_server.control.autoscale import ModelLoad
from llmgw_server.control.commands import MarkNode, StartShard
from llmgw_server.control.persisted import (
    FORMAT_KEY,
    Keeper,
    StoredModel,
    StoredNode,
    StoredReplica,
    StoredShard,
    converter,
    diff,
    encode,
    read,
    snapshot,
)
from llmgw_server.control.reconciler import Reconciler, Step

SETTINGS = ControlSection(
    unreachable_after_s=15,
    lost_after_s=60,
    settle_after_start_s=30,
    reconcile_interval_s=0,
)
READY = ShardState.READY
LIVE = (ShardState.PENDING, ShardState.STARTING, ShardState.READY)
WALL_A = 1_780_000_000.0 - 1000.0  # A's wall clock minus its monotonic clock


def scaled(name: str = "chat", **kw: object) -> ModelEntry:
    spec: dict[str, Any] = {"min": 0, "max": 4, "target_in_flight": 1.0, "scale_down_after_s": 60.0}
    spec.update(kw)
    return ModelEntry(name=name, profile=profile(tensor_parallel=1), autoscale=Autoscale(**spec))


def running(cat: Catalog, *nodes: str, settings: ControlSection = SETTINGS) -> Fleet:
    fleet = Fleet(settings, cat, now=1000.0, instance="a")
    fleet.join(*(gpu_node(n, 2) for n in nodes))
    fleet.advance(settings.settle_after_start_s)
    fleet.ready_all()
    return fleet


def fail_over(
    fleet: Fleet, stored: dict[str, bytes], *, instance: str = "b", wall: float = WALL_A
) -> Step:
    """A new leader takes over from what `stored` holds; no agent registered yet."""
    fleet.cp = Reconciler(fleet.settings, fleet.catalog, now=fleet.now, instance=instance)
    fleet.guard_held, fleet.guarded, fleet.released = False, set(), {}
    return fleet.feed(fleet.cp.restore(stored, fleet.now, wall))


def placed_since(fleet: Fleet, count: int) -> list[StartShard]:
    return [c for c in fleet.commands[count:] if isinstance(c, StartShard)]


# -- the values ---------------------------------------------------------------------------


def test_the_snapshot_keeps_placement_flags_and_autoscalers_and_no_engine_key() -> None:
    fleet = running(catalog(model("one", 2), scaled(max=3)), "n1", "n2", "n3")
    fleet.feed(
        fleet.cp.autoscale({"chat": ModelLoad(in_flight=2, last_request_at=fleet.now)}, fleet.now)
    )
    fleet.ready_all()
    fleet.feed(fleet.cp.cordon("n1", True, fleet.now))
    fleet.feed(fleet.cp.drain_node("n3", True, fleet.now, force=True))
    stored = snapshot(fleet.cp, WALL_A)
    assert json.loads(stored[FORMAT_KEY]) == {"version": 1}
    specs = {(s.spec.replica_id, s.spec.rank): (n, s.spec) for n, s in fleet.shards()}
    replicas = {k for k in stored if k.startswith("replicas/")}
    assert replicas == {f"replicas/{rid}" for rid, _ in specs}
    for (rid, _), (node, spec) in specs.items():
        value = converter.structure(json.loads(stored[f"replicas/{rid}"]), StoredReplica)
        assert value.model == spec.model_name and value.ranks == (
            StoredShard(node, spec.gpu_indices),
        )
        assert (value.port, value.dist_port, value.attempt) == (spec.port, spec.dist_port, 0)
        assert spec.api_key and spec.api_key.encode() not in stored[f"replicas/{rid}"]
    assert not any(
        spec.api_key.encode() in v for v in stored.values() for _, spec in specs.values()
    )
    assert converter.structure(json.loads(stored["nodes/n1"]), StoredNode) == StoredNode(
        cordoned=True
    )
    n3 = converter.structure(json.loads(stored["nodes/n3"]), StoredNode)
    assert (n3.draining, n3.drain_forced, n3.drain_since) == (True, True, fleet.now + WALL_A)
    assert "nodes/n2" not in stored  # no flag, nothing kept
    chat = converter.structure(json.loads(stored["models/chat"]), StoredModel)
    assert chat.desired == 2 and chat.changed_at == fleet.now + WALL_A
    assert chat.last_change is not None and (chat.last_change.before, chat.last_change.after) == (
        0,
        2,
    )
    assert "models/one" not in stored  # not autoscaled


def test_diff_puts_what_changed_and_deletes_what_went() -> None:
    before = {"a": b"1", "b": b"2", "c": b"3"}
    after = {"a": b"1", "b": b"9", "d": b"4"}
    assert diff(before, after) == ({"b": b"9", "d": b"4"}, ["c"])
    assert diff(after, after) == ({}, [])
    assert diff({}, after) == (after, [])


def test_a_step_writes_only_what_it_touched_and_matches_a_full_snapshot() -> None:
    fleet = running(catalog(model("one", 2), scaled(max=3)), "n1", "n2", "n3")
    keeper = Keeper({})
    puts, deletes = keeper.everything(fleet.cp, WALL_A)
    assert set(puts) == set(snapshot(fleet.cp, WALL_A)) and not deletes

    def each(step: Step) -> None:
        p, d = keeper.step(fleet.cp, step.touched, WALL_A)
        puts.update(p)
        deletes.extend(d)

    puts, deletes = {}, []
    fleet.heartbeats()
    each(fleet.feed(fleet.cp.tick(fleet.now)))
    assert (puts, deletes) == ({}, [])  # heartbeats and time: nothing stored changes
    each(fleet.feed(fleet.cp.cordon("n2", True, fleet.now)))
    assert list(puts) == ["nodes/n2"] and not deletes
    each(fleet.feed(fleet.cp.cordon("n2", False, fleet.now)))
    assert deletes == ["nodes/n2"]
    # Every step through a scale-up, a drain, shards moving and the autoscaler: the
    # keeper's copy is the full snapshot.
    steps: list[Step] = []
    original = fleet.feed

    def feed(step: Step) -> Step:
        steps.append(step)
        each(step)
        return original(step)

    fleet.feed = feed  # type: ignore[method-assign]
    fleet.feed(
        fleet.cp.autoscale({"chat": ModelLoad(in_flight=3, last_request_at=fleet.now)}, fleet.now)
    )
    fleet.ready_all()
    fleet.feed(fleet.cp.drain_node("n1", True, fleet.now))
    fleet.ready_all()
    fleet.advance(90)
    fleet.feed(fleet.cp.autoscale({}, fleet.now))
    assert keeper.stored == snapshot(fleet.cp, WALL_A)
    assert any(k.startswith("replicas/") for k in puts)
    assert len(steps) > 5


def test_a_replica_drained_is_stored_retiring_whoever_began_the_drain() -> None:
    """A drain sent to an agent that does not answer, and a drain an agent reports on its
    own: each step's writes carry the replica, now retiring (it counts toward nothing)."""
    fleet = running(catalog(model("one", 1)), "n1", "n2")
    keeper = Keeper({})
    keeper.everything(fleet.cp, WALL_A)
    original = fleet.feed

    def feed(step: Step) -> Step:
        keeper.step(fleet.cp, step.touched, WALL_A)
        return original(step)

    fleet.feed = feed  # type: ignore[method-assign]
    ((node, shard),) = fleet.shards()
    rid = shard.spec.replica_id
    fleet.agents[node].connected = False  # silent, not yet unreachable: commands are lost
    fleet.feed(fleet.cp.drain_node(node, True, fleet.now))
    fleet.ready_all()  # the replacement serves: the old replica is drained
    stored = converter.structure(json.loads(keeper.stored[f"replicas/{rid}"]), StoredReplica)
    assert stored.retiring
    assert keeper.stored == snapshot(fleet.cp, WALL_A)
    # An agent draining a shard on its own says so; the leader stores it.
    other = next(r for r in fleet.replicas("one", READY) if r != rid)
    where = next(n for n, s in fleet.shards() if s.spec.replica_id == other)
    fleet.report(where, other, 0, ShardState.DRAINING)
    stored = converter.structure(json.loads(keeper.stored[f"replicas/{other}"]), StoredReplica)
    assert stored.retiring
    assert keeper.stored == snapshot(fleet.cp, WALL_A)


def test_times_are_stored_on_the_wall_clock_and_read_back_on_the_new_leaders() -> None:
    value = StoredModel(2, changed_at=5000.0, idle_since=4000.0, window=((5100.0, 3),))
    stored = {FORMAT_KEY: b'{"version":1}', "models/chat": encode(value)}
    # The new leader's monotonic clock reads 70 where the wall clock reads 5120.
    restored = read(stored, now=70.0, wall_minus_monotonic=5050.0)
    m = restored.models["chat"]
    assert (m.desired, m.changed_at, m.idle_since, m.window) == (2, -50.0, -1050.0, ((50.0, 3),))
    # A time ahead of this leader's clock (another host's clock ahead): now, not later.
    assert read(stored, now=10.0, wall_minus_monotonic=5050.0).models["chat"].window == ((10.0, 3),)


BAD_VALUES = [
    ("replicas/r1", b"not json"),
    ("replicas/r2", b'{"model": "m"}'),  # fields missing
    ("replicas/r3", encode(StoredReplica("m", (), "h", 20000, 20001))),  # no rank
    ("replicas/r4", encode(StoredReplica("m", (StoredShard("n"),), "h", 0, 1))),  # no port
    ("replicas/", encode(StoredReplica("m", (StoredShard("n"),), "h", 20000, 20001))),
    ("nodes/n9", b'{"cordoned": "yes"}'),
    ("nodes/n8", b'{"draining": true, "drain_since": NaN}'),
    ("models/m1", b'{"desired": -1, "changed_at": 1, "idle_since": 1}'),
    ("models/m2", b'{"desired": 1, "changed_at": 1, "idle_since": 1, "window": [[1, 5000]]}'),
    (
        "models/m3",
        b'{"desired":1,"changed_at":1,"idle_since":1,"last_change":'
        b'{"before":0,"after":1,"reason":"a reason from the future","detail":""}}',
    ),
    ("models/m4", b"[" * 100_000),
    ("elsewhere/x", b"{}"),
    ("replicas/r5", b"\xff\xfe"),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_a_bad_stored_value_is_skipped_with_a_note_and_the_rest_is_read(
    key: str, value: bytes
) -> None:
    good = encode(StoredReplica("one", (StoredShard("n1", (0,)),), "10.0.0.1", 20000, 20001))
    stored = {
        FORMAT_KEY: b'{"version":1}',
        "replicas/good": good,
        "nodes/n1": encode(StoredNode(True)),
        key: value,
    }
    restored = read(stored, now=0.0, wall_minus_monotonic=0.0)
    assert restored.found
    assert list(restored.replicas) == ["good"] and restored.nodes["n1"].cordoned
    assert not restored.models
    assert len(restored.notes) == 1 and repr(key[:200]) in restored.notes[0], restored.notes
    assert restored.unreadable_nodes == (
        {key[len("nodes/") :]} if key.startswith("nodes/") else set()
    )
    # A new leader restores around it, and never deletes it: a newer version may read it.
    fleet = Fleet(SETTINGS, catalog(model("one", 1)), now=1000.0)
    step = fail_over(fleet, stored, wall=0.0)
    assert any(repr(key[:200]) in n for n in step.notes)
    keeper = Keeper(stored)
    _, deletes = keeper.everything(fleet.cp, 0.0)
    assert key not in deletes and "replicas/good" not in deletes


def test_another_layout_version_is_read_as_far_as_it_goes() -> None:
    stored = {FORMAT_KEY: b'{"version":2,"more":1}', "nodes/n1": b'{"cordoned":true,"new":1}'}
    restored = read(stored, now=0.0, wall_minus_monotonic=0.0)
    assert restored.nodes["n1"].cordoned and "version 2" in restored.notes[0]


# -- a new leader -----------------------------------------------------------------------


def test_placement_waits_for_exactly_the_stored_nodes_then_goes_on_at_once() -> None:
    fleet = running(catalog(model("one", 2), model("two", 1)), "n1", "n2", "n3", "n4")
    stored = snapshot(fleet.cp, WALL_A)
    with_shards = sorted(n for n, a in fleet.agents.items() if a.shards)
    assert len(with_shards) >= 2
    # The last one's engine ended while no leader was there: its agent reports nothing.
    last = with_shards[-1]
    fleet.agents[last].shards.clear()
    count = len(fleet.commands)
    start = fleet.now
    fail_over(fleet, stored)
    for name in sorted(fleet.agents):
        if name != last:
            fleet.register(name)
    assert placed_since(fleet, count) == []  # `last` is named and has not registered
    fleet.advance(5)
    assert placed_since(fleet, count) == []
    fleet.register(last)  # the last stored node: what runs is known, the settle time ends
    starts = placed_since(fleet, count)
    assert len(starts) == 1 and starts[0].spec.replica_id.split("-")[-2] == "b"
    assert any("every node the store names has registered" in n for n in fleet.notes)
    assert fleet.now - start < SETTINGS.settle_after_start_s


def test_a_replica_on_a_stored_node_that_never_comes_back_is_replaced_after_lost_after_s() -> None:
    fleet = running(catalog(model("one", 3)), "n1", "n2", "n3", "n4")
    stored = snapshot(fleet.cp, WALL_A)
    dead = next(n for n, a in sorted(fleet.agents.items()) if a.shards)
    lost = len(fleet.agents[dead].shards)
    fleet.silence(dead)  # its host went down with the leader
    count = len(fleet.commands)
    start = fleet.now
    fail_over(fleet, stored)
    for name in sorted(fleet.agents):
        if name != dead:
            fleet.register(name)
    fleet.advance(SETTINGS.settle_after_start_s + 5)
    # The settle time is over, but the dead node's replicas count until lost_after_s.
    assert placed_since(fleet, count) == []
    fleet.advance(SETTINGS.lost_after_s - SETTINGS.settle_after_start_s)
    starts = placed_since(fleet, count)
    assert len(starts) == lost and fleet.now - start >= SETTINGS.lost_after_s


def test_what_a_new_leader_awaits_stays_stored_for_the_next_one() -> None:
    """A second failover before a stored node came back still knows its replicas."""
    fleet = running(catalog(model("one", 2)), "n1", "n2", "n3")
    stored = snapshot(fleet.cp, WALL_A)
    away = next(n for n, a in sorted(fleet.agents.items()) if a.shards)
    fleet.silence(away)
    fail_over(fleet, stored)
    for name in sorted(fleet.agents):
        if name != away:
            fleet.register(name)
    again = snapshot(fleet.cp, WALL_A)
    assert {k: v for k, v in again.items() if k.startswith("replicas/")} == {
        k: v for k, v in stored.items() if k.startswith("replicas/")
    }
    count = len(fleet.commands)
    fail_over(fleet, again, instance="c")
    for name in sorted(fleet.agents):
        if name != away:
            fleet.register(name)
    fleet.advance(SETTINGS.settle_after_start_s + 5)
    assert placed_since(fleet, count) == []  # still awaited, for lost_after_s
    fleet.register(away)
    assert fleet.cp.awaited_replicas() == []
    assert keys(snapshot(fleet.cp, WALL_A)) == keys(stored)


def keys(stored: dict[str, bytes]) -> set[str]:
    return {k for k in stored if k.startswith("replicas/")}


def test_a_model_short_of_replicas_is_placed_once_the_stored_nodes_registered() -> None:
    """A replica the old leader could not place is not held for lost_after_s."""
    fleet = running(catalog(model("one", 1)), "n1")
    fleet.join(gpu_node("n2", 2))
    fleet.set_catalog(catalog(model("one", 1), model("big", 1, tensor_parallel=4)))
    stored = snapshot(fleet.cp, WALL_A)
    count = len(fleet.commands)
    fail_over(fleet, stored)
    fleet.register("n1")
    assert placed_since(fleet, count) == []  # nothing fits "big"
    fleet.register("n2")
    fleet.join(gpu_node("n5", 4))
    assert [s.spec.model_name for s in placed_since(fleet, count)] == ["big"]


def test_the_stores_flags_win_and_the_agent_is_told() -> None:
    fleet = running(catalog(model("one", 1)), "n1", "n2", "n3")
    fleet.feed(fleet.cp.cordon("n1", True, fleet.now))
    fleet.feed(fleet.cp.drain_node("n2", True, fleet.now, force=True))
    stored = snapshot(fleet.cp, WALL_A)
    # The agents disagree: n1 missed its cordon, n3 holds a cordon the operator lifted.
    fleet.agents["n1"].cordoned = False
    fleet.agents["n3"].cordoned = True
    count = len(fleet.commands)
    fail_over(fleet, stored)
    for name in ("n1", "n2", "n3"):
        fleet.register(name)
    nodes = fleet.cp.lifecycle.nodes
    assert (nodes["n1"].cordoned, nodes["n3"].cordoned) == (True, False)
    assert nodes["n2"].draining and nodes["n2"].drain_forced
    marks = [c for c in fleet.commands[count:] if isinstance(c, MarkNode)]
    assert marks == [MarkNode("n1", True, False), MarkNode("n3", False, False)]


def test_a_new_leader_takes_a_cordon_of_a_stored_node_before_it_registers() -> None:
    """The store names n1 (cordoned): a new leader takes an operator's uncordon and
    cordon of it before its agent is back, keeps them in the store, and the node gets
    the flags when it registers. A node the store does not name is still unknown."""
    fleet = running(catalog(model("one", 1)), "n1", "n2")
    fleet.feed(fleet.cp.cordon("n1", True, fleet.now))
    fail_over(fleet, snapshot(fleet.cp, WALL_A))
    fleet.feed(fleet.cp.cordon("n1", False, fleet.now))
    assert json.loads(snapshot(fleet.cp, WALL_A).get("nodes/n1", b"{}")).get("cordoned") in (
        None,
        False,
    )
    fleet.feed(fleet.cp.drain_node("n1", False, fleet.now))
    fleet.feed(fleet.cp.cordon("n1", True, fleet.now))
    assert json.loads(snapshot(fleet.cp, WALL_A)["nodes/n1"])["cordoned"] is True
    with pytest.raises(KeyError):
        fleet.cp.cordon("n2", True, fleet.now)  # not flagged, so not in the store
    count = len(fleet.commands)
    fleet.agents["n1"].cordoned = False
    fleet.register("n1")
    assert fleet.cp.lifecycle.nodes["n1"].cordoned
    marks = [c for c in fleet.commands[count:] if isinstance(c, MarkNode)]
    assert marks == [MarkNode("n1", True, False)]


def test_an_empty_store_leaves_the_agents_flags_and_the_settle_time_as_after_a_restart() -> None:
    fleet = running(catalog(model("one", 2)), "n1", "n2")
    fleet.feed(fleet.cp.cordon("n1", True, fleet.now))
    agent = next(a for _, a in sorted(fleet.agents.items()) if a.shards)
    del agent.shards[next(iter(agent.shards))]
    count = len(fleet.commands)
    fail_over(fleet, {})
    fleet.register("n1")
    fleet.register("n2")
    assert fleet.cp.lifecycle.nodes["n1"].cordoned
    assert placed_since(fleet, count) == []  # the settle time holds, as after a restart
    fleet.advance(SETTINGS.settle_after_start_s)
    assert len(placed_since(fleet, count)) == 1


def test_an_unreadable_node_record_takes_the_agents_flags() -> None:
    fleet = running(catalog(model("one", 1)), "n1")
    fleet.feed(fleet.cp.cordon("n1", True, fleet.now))
    stored = snapshot(fleet.cp, WALL_A) | {"nodes/n1": b"{broken"}
    fail_over(fleet, stored)
    fleet.register("n1")
    assert fleet.cp.lifecycle.nodes["n1"].cordoned  # its agent kept the cordon


def test_an_autoscaled_model_keeps_its_count_and_its_window_goes_on() -> None:
    fleet = running(catalog(scaled(max=4, scale_down_after_s=60.0)), "n1", "n2")
    busy = ModelLoad(in_flight=3, last_request_at=fleet.now)
    fleet.feed(fleet.cp.autoscale({"chat": busy}, fleet.now))
    fleet.ready_all()
    assert len(fleet.replicas("chat", READY)) == 3
    fleet.advance(40)
    calm = ModelLoad(in_flight=1, last_request_at=fleet.now)
    fleet.feed(fleet.cp.autoscale({"chat": calm}, fleet.now))
    fleet.advance(10)
    # The new leader's monotonic clock is 10,000 s behind: the wall clock links them.
    stored = snapshot(fleet.cp, WALL_A)
    shift = 10_000.0
    old_now = fleet.now
    fleet.now -= shift
    fleet.heard = {n: t - shift for n, t in fleet.heard.items()}
    count = len(fleet.commands)
    fail_over(fleet, stored, wall=WALL_A + shift)
    for name in ("n1", "n2"):
        fleet.register(name)
    assert fleet.cp.scaling.counts() == {"chat": 3}
    scaler = fleet.cp.scaling.autoscalers["chat"]
    assert scaler.changed_at == old_now - 50 - shift
    # Down only once the window from the old leader's change has passed: 60 s after it,
    # not 60 s after the failover.
    fleet.feed(fleet.cp.autoscale({"chat": calm}, fleet.now))
    assert fleet.cp.scaling.counts() == {"chat": 3}  # 50 s after the change
    fleet.advance(11 + 60 / 16)  # its readings' times are stored rounded up a step
    fleet.feed(fleet.cp.autoscale({"chat": calm}, fleet.now))
    assert fleet.cp.scaling.counts() == {"chat": 1}
    assert placed_since(fleet, count) == []


def test_a_reading_that_holds_replicas_holds_them_on_the_new_leader() -> None:
    """The window's readings come over: a spike 20 s before the failover still holds."""
    fleet = running(catalog(scaled(max=4, scale_down_after_s=60.0)), "n1", "n2")
    fleet.feed(
        fleet.cp.autoscale({"chat": ModelLoad(in_flight=3, last_request_at=fleet.now)}, fleet.now)
    )
    fleet.advance(70)
    spike = ModelLoad(in_flight=3, last_request_at=fleet.now)
    fleet.feed(fleet.cp.autoscale({"chat": spike}, fleet.now))
    fleet.advance(20)
    stored = snapshot(fleet.cp, WALL_A)
    fail_over(fleet, stored)
    for name in ("n1", "n2"):
        fleet.register(name)
    calm = ModelLoad(in_flight=1, last_request_at=fleet.now)
    fleet.feed(fleet.cp.autoscale({"chat": calm}, fleet.now))
    assert fleet.cp.scaling.counts() == {"chat": 3}
    fleet.advance(41 + 60 / 16)  # the spike leaves the window (its time stored rounded up)
    fleet.feed(fleet.cp.autoscale({"chat": calm}, fleet.now))
    assert fleet.cp.scaling.counts() == {"chat": 1}


def test_restore_is_for_a_reconciler_no_node_registered_with() -> None:
    fleet = running(catalog(model("one", 1)), "n1")
    with pytest.raises(RuntimeError):
        fleet.cp.restore({}, fleet.now, 0.0)


def test_a_value_is_small() -> None:
    replica = encode(
        StoredReplica("chat", (StoredShard("gpu-node-0001", (0, 1)),), "10.0.0.1", 20000, 20001)
    )
    node = encode(StoredNode(True, True, False, 1_780_000_000.25))
    assert len(replica) < 200 and len(node) < 100
    assert attrs.asdict(converter.structure(json.loads(replica), StoredReplica))["model"] == "chat"
