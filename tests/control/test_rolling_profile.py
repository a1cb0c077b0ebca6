"""Rolling a changed profile: replicas are replaced one at a time, make before break."""

from __future__ import annotations

from fleetsim import FAST, Fleet, catalog, gpu_node, model

from llmgw_core.inventory import ShardState
from llmgw_server.control.commands import DrainShard, StartShard

NEW_ARGS = ("--max-model-len", "8192")


def fleet(replicas: int, *, gpus: int = 8, nodes: int = 2, tp: int = 4) -> Fleet:
    f = Fleet(FAST, catalog(model("a", replicas, tensor_parallel=tp)))
    f.join(*[gpu_node(f"n{i}", gpus) for i in range(1, nodes + 1)])
    f.ready_all()
    return f


def serving(f: Fleet) -> set[str]:
    return {e.url for e in f.cp.serving()["a"]}


def starting(f: Fleet) -> set[str]:
    return f.replicas("a", ShardState.PENDING, ShardState.STARTING)


def change(f: Fleet, replicas: int, tp: int = 4) -> None:
    f.set_catalog(catalog(model("a", replicas, tensor_parallel=tp, args=NEW_ARGS)))


def new_ones(f: Fleet) -> set[str]:
    return {s.spec.replica_id for _, s in f.shards() if s.spec.args == NEW_ARGS}


def test_a_two_replica_model_rolls_one_replica_at_a_time() -> None:
    f = fleet(2)
    old = f.replicas("a")
    assert len(old) == 2 and len(serving(f)) == 2
    change(f, 2)
    seen_new: set[str] = set()
    for step in range(10):
        # Each step: whatever starts becomes ready, and drained replicas are reported so.
        assert len(serving(f)) >= 2, step
        assert len(starting(f)) <= 1, (step, starting(f))
        for _, s in f.shards(ShardState.DRAINING):
            f.feed(f.cp.replica_drained(s.spec.replica_id, f.now))
        assert len(serving(f)) >= 2, step
        seen_new |= starting(f)
        for _, s in f.shards():
            if s.state in (ShardState.PENDING, ShardState.STARTING):
                f.report(_node(f, s.spec.replica_id), s.spec.replica_id, 0, ShardState.STARTING)
                f.report(_node(f, s.spec.replica_id), s.spec.replica_id, 0, ShardState.READY)
                break  # one engine at a time gets ready
        assert len(serving(f)) >= 2, step
        assert len(starting(f)) <= 1, (step, starting(f))
    assert f.replicas("a") == new_ones(f) == seen_new and len(seen_new) == 2
    assert not f.replicas("a") & old
    assert len(serving(f)) == 2
    starts = [c for c in f.commands if isinstance(c, StartShard) and c.spec.args == NEW_ARGS]
    assert len(starts) == 2


def _node(f: Fleet, rid: str) -> str:
    return next(name for name, s in f.shards() if s.spec.replica_id == rid)


def test_the_roll_step_by_step() -> None:
    f = fleet(2)
    a1, a2 = sorted(f.replicas("a"))
    f.commands.clear()
    change(f, 2)
    (start,) = f.commands  # one replacement; both old ones serve on
    assert isinstance(start, StartShard)
    b1 = start.spec.replica_id
    assert len(serving(f)) == 2
    f.commands.clear()
    f.report(start.node, b1, 0, ShardState.STARTING)
    assert f.commands == []  # no second replacement while the first starts
    f.report(start.node, b1, 0, ShardState.READY)
    drain, start2 = f.commands  # one old replica drains, the next replacement starts
    assert isinstance(drain, DrainShard) and drain.replica_id in (a1, a2)
    assert isinstance(start2, StartShard) and start2.spec.args == NEW_ARGS
    assert len(serving(f)) == 2
    kept_old = ({a1, a2} - {drain.replica_id}).pop()
    f.commands.clear()
    f.report(start2.node, start2.spec.replica_id, 0, ShardState.STARTING)
    f.report(start2.node, start2.spec.replica_id, 0, ShardState.READY)
    assert f.commands == [DrainShard(_node(f, kept_old), kept_old, 0)]
    assert len(serving(f)) == 2


def test_a_stale_replica_that_does_not_serve_is_retired_at_once() -> None:
    f = Fleet(FAST, catalog(model("a", 2, tensor_parallel=4)))
    f.join(gpu_node("n1", 8), gpu_node("n2", 8))
    f.commands.clear()
    change(f, 2)  # nothing serves yet: the old ones go, both new ones start
    assert sorted(type(c).__name__ for c in f.commands).count("StartShard") == 2
    assert {s.spec.args for _, s in f.shards()} == {NEW_ARGS}


def test_a_scale_up_with_the_change_places_the_extra_replicas_at_once() -> None:
    f = fleet(2, nodes=3)
    f.commands.clear()
    change(f, 4, tp=2)
    starts = [c for c in f.commands if isinstance(c, StartShard)]
    assert len(starts) == 3  # 2 extra, and one replacement of the 2 old ones
    assert len(serving(f)) == 2


def test_a_roll_with_no_room_waits_and_the_old_replica_serves() -> None:
    f = fleet(1, nodes=1, tp=8)
    (old,) = f.replicas("a")
    f.commands.clear()
    change(f, 1, tp=8)
    assert f.commands == []
    assert any("roll of a" in n and "waits for room" in n for n in f.notes)
    assert f.replicas("a") == {old} and len(serving(f)) == 1
    (unplaced,) = f.cp.view().unplaced.values()
    assert unplaced.count == 1 and unplaced.waiting is None
    # Room comes: the roll goes on.
    f.join(gpu_node("n2", 8))
    (start,) = f.starts()[-1:]
    assert start.spec.args == NEW_ARGS and start.node == "n2"


def test_a_restarted_control_plane_with_a_changed_profile_rolls_one_at_a_time() -> None:
    f = fleet(2)
    f.catalog = catalog(model("a", 2, tensor_parallel=4, args=NEW_ARGS))
    f.commands.clear()
    f.restart_control_plane(instance="b")
    f.advance(FAST.settle_after_start_s + 1)
    starts = [c for c in f.commands if isinstance(c, StartShard)]
    assert len(starts) == 1 and not any(isinstance(c, DrainShard) for c in f.commands)
    assert len(serving(f)) == 2
    for _ in range(6):  # engines load, drains time out: the roll ends, one at a time
        f.ready_all()
        f.advance(FAST.drain_timeout_s)
        assert len(serving(f)) >= 2 and len(starting(f)) <= 1
    assert f.replicas("a") == new_ones(f) and len(new_ones(f)) == 2
