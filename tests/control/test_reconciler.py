"""The reconciler by example: launch specs, adoption, retiring, restarts, lost nodes."""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs
import pytest
from fleetsim import FAST, Fleet, catalog, gpu_node, model

from llmgw_core.catalog import Endpoint, LoraAdapter, ModelEntry
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import LaunchSpec, ShardState
from llmgw_server.control.commands import DrainShard, MarkNode, StartShard, StopShard
from llmgw_server.control.documents import to_json
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.reconciler import DrainRefused, Reconciler, Stuck
from llmgw_server.control.shards import Phase
from llmgw_server.control_shell.admin import status_doc

READY, FAILED, STARTING = ShardState.READY, ShardState.FAILED, ShardState.STARTING
POD_A = {"ib_domain": "pod-a"}


def counting_keys(prefix: str = "key") -> Callable[[], str]:
    """A deterministic engine-key source: key-1, key-2..."""
    count = 0

    def next_key() -> str:
        nonlocal count
        count += 1
        return f"{prefix}-{count}"

    return next_key


def keyed(f: Fleet, keys: Callable[[], str] | None = None, *, instance: str = "a") -> Fleet:
    """Give the fleet's (new) control plane a deterministic key source, before anyone joins."""
    f.cp = Reconciler(
        f.settings, f.catalog, now=f.now, instance=instance, engine_keys=keys or counting_keys()
    )
    return f


def fleet_with(*models: ModelEntry, settings: ControlSection = FAST, nodes: int = 2) -> Fleet:
    f = keyed(Fleet(settings, catalog(*models)))
    f.join(*[gpu_node(f"n{i}", 8, fabric=POD_A) for i in range(1, nodes + 1)])
    return f


def kinds(commands: list[object]) -> list[str]:
    return [type(c).__name__ for c in commands]


# -- launch specs --------------------------------------------------------------------


def test_start_carries_the_whole_launch_spec() -> None:
    m = model(
        "qwen",
        1,
        engine="vllm",
        model="Qwen/Qwen2.5-72B-Instruct",
        tensor_parallel=4,
        gpu_memory_gib=70,
        args=("--max-model-len", "32768"),
        env={"HF_HOME": "/models"},
    )
    f = fleet_with(m, nodes=1)
    (start,) = f.starts()
    assert start == StartShard(
        "n1",
        LaunchSpec(
            replica_id="qwen-a-1",
            model_name="qwen",
            engine="vllm",
            hf_model="Qwen/Qwen2.5-72B-Instruct",
            args=("--max-model-len", "32768"),
            env={"HF_HOME": "/models"},
            tensor_parallel=4,
            pipeline_parallel=1,
            rank=0,
            nodes=("n1",),
            gpu_indices=(0, 1, 2, 3),
            head_address=gpu_node("n1").address,
            port=20000,
            dist_port=20001,
            attempt=0,
            api_key="key-1",
        ),
    )
    assert f.last_step.placements or f.cp.view().replicas[0].kept


def test_a_multi_node_replica_gets_ranks_and_the_head_address() -> None:
    f = Fleet(FAST, catalog(model("big", 1, tensor_parallel=8, pipeline_parallel=2)))
    f.join(gpu_node("n1", fabric=POD_A), gpu_node("n2", fabric=POD_A))
    specs = sorted((c.spec for c in f.starts()), key=lambda s: s.rank)
    assert [(s.rank, s.node, s.nnodes, s.gpu_indices) for s in specs] == [
        (0, "n1", 2, tuple(range(8))),
        (1, "n2", 2, tuple(range(8))),
    ]
    assert {(s.head_address, s.port, s.dist_port) for s in specs} == {
        (gpu_node("n1").address, 20000, 20001)
    }
    f.ready_all()
    (replica,) = f.cp.view().replicas
    assert replica.serving and [e.url for e in f.cp.serving()["big"]] == [replica.url]


def test_ports_are_unique_on_every_node_of_a_replica() -> None:
    f = fleet_with(model("a", 2, tensor_parallel=2), nodes=1)
    assert sorted(c.spec.port for c in f.starts()) == [20000, 20002]


# -- adoption ------------------------------------------------------------------------


def test_a_restarted_control_plane_adopts_running_engines() -> None:
    settings = ControlSection(reconcile_interval_s=0)  # the real settle time after a start
    f = Fleet(settings, catalog(model("a", 2, tensor_parallel=4), model("b", 1, tensor_parallel=8)))
    f.join(gpu_node("n1"), gpu_node("n2"))
    f.advance(40)
    f.ready_all()
    before = {s.spec.replica_id for _, s in f.shards()}
    assert len(before) == 3
    f.commands.clear()
    f.restart_control_plane(instance="b", order=["n2", "n1"])
    f.advance(300)
    assert f.commands == []
    assert {s.spec.replica_id for _, s in f.shards(READY)} == before
    view = f.cp.view()
    assert all(r.kept and r.serving for r in view.replicas)
    assert any("reports replica" in note for note in f.notes)


def test_placement_waits_for_re_registering_agents_after_a_start() -> None:
    settings = ControlSection(settle_after_start_s=30, reconcile_interval_s=0)
    f = Fleet(settings, catalog(model("a", 2, tensor_parallel=8)))
    f.join(gpu_node("n1"), gpu_node("n2"))
    f.advance(31)
    f.ready_all()
    f.silence("n2")
    f.restart_control_plane(instance="b")  # n2 comes back only after 20 s
    f.advance(10)
    assert f.cp.view().unplaced["a"].waiting is not None
    f.register("n2")
    f.advance(60)
    assert not f.starts()[2:]  # nothing beyond the first two starts, before the restart
    assert f.cp.view().unplaced == {}


def test_a_multi_node_replica_waits_for_its_late_ranks_then_gives_up_on_them() -> None:
    settings = ControlSection(settle_after_start_s=0, lost_after_s=120, reconcile_interval_s=0)
    f = Fleet(settings, catalog(model("big", 1, tensor_parallel=8, pipeline_parallel=2)))
    f.join(gpu_node("n1", fabric=POD_A), gpu_node("n2", fabric=POD_A))
    f.ready_all()
    f.silence("n2")
    f.commands.clear()
    f.restart_control_plane(instance="b")
    f.advance(100)
    assert f.commands == []  # rank 1's node may still register: nothing is stopped yet
    f.advance(25)
    assert kinds(f.commands) == ["StopShard"]  # 120 s after the start it is broken
    assert f.cp.view().unplaced["big"].explanation.text.startswith("0 of 1 nodes fit 16 GPUs")


def test_surplus_and_unknown_shards_are_drained_then_stopped() -> None:
    f = fleet_with(model("a", 2, tensor_parallel=2), model("gone", 1), nodes=1)
    f.ready_all()
    f.commands.clear()
    f.settings = FAST
    f.catalog = catalog(model("a", 1, tensor_parallel=2))
    f.restart_control_plane(instance="b")
    assert kinds(f.commands) == ["DrainShard", "DrainShard"]
    drained = {c.replica_id for c in f.commands if isinstance(c, DrainShard)}
    assert len(drained) == 2 and any(r.startswith("gone") for r in drained)
    f.advance(FAST.drain_timeout_s - 5)
    assert kinds(f.commands) == ["DrainShard", "DrainShard"]
    f.advance(5)
    assert kinds(f.commands)[2:] == ["StopShard", "StopShard"]
    assert len(f.replicas("a")) == 1 and not f.replicas("gone")


def test_scaling_down_drains_first_and_stops_once_the_router_says_drained() -> None:
    f = fleet_with(model("a", 2), nodes=1)
    f.ready_all()
    f.commands.clear()
    f.set_catalog(catalog(model("a", 1)))
    (drain,) = f.commands
    assert isinstance(drain, DrainShard)
    (retiring,) = [r for r in f.cp.view().replicas if not r.kept]
    assert retiring.phase is Phase.RETIRING and not retiring.serving
    f.feed(f.cp.replica_drained(drain.replica_id, f.now))
    assert f.commands[1:] == [StopShard("n1", drain.replica_id, 0)]
    assert len(f.cp.view().replicas) == 1


def test_a_model_added_to_a_running_reconciler_is_placed_and_explained_at_once() -> None:
    """A reload that adds a profiled model: it is placed as a change of replicas from 0
    would be, served once ready, and explained from the moment the catalog names it."""
    f = fleet_with(model("a", 1), nodes=1)
    f.ready_all()
    f.commands.clear()
    assert f.cp.explain("huge") is None and "huge" not in f.cp.serving()
    f.set_catalog(catalog(model("a", 1), model("huge", 2, tensor_parallel=2)))
    why = f.cp.explain("huge")
    assert why is not None and why.placeable
    assert f.cp.serving()["huge"] == ()  # named at once: routers answer 503, not 404
    starts = [c for c in f.commands if isinstance(c, StartShard)]
    assert [c.spec.model_name for c in starts] == ["huge", "huge"]
    assert not any(isinstance(c, DrainShard | StopShard) for c in f.commands)  # "a" untouched
    f.ready_all()
    assert len(f.cp.serving()["huge"]) == 2 and len(f.cp.serving()["a"]) == 1


def test_a_model_removed_from_a_running_reconciler_is_drained_then_stopped() -> None:
    f = fleet_with(model("a", 1), model("gone", 2), nodes=1)
    f.ready_all()
    f.commands.clear()
    f.set_catalog(catalog(model("a", 1)))
    assert kinds(f.commands) == ["DrainShard", "DrainShard"]  # drained first, nothing stopped
    assert {c.replica_id for c in f.commands if isinstance(c, DrainShard)} == f.replicas("gone")
    assert "gone" not in f.cp.serving() and f.cp.explain("gone") is None
    retiring = [r for r in f.cp.view().replicas if r.model == "gone"]
    assert len(retiring) == 2 and all(r.phase is Phase.RETIRING for r in retiring)
    first, _ = sorted(f.replicas("gone"))
    f.feed(f.cp.replica_drained(first, f.now))  # the routers have nothing in flight there
    assert f.commands[2:] == [StopShard("n1", first, 0)]
    f.advance(FAST.drain_timeout_s)  # the other: stopped once the drain times out
    assert kinds(f.commands)[3:] == ["StopShard"]
    assert not f.replicas("gone") and len(f.replicas("a")) == 1
    assert [m.name for m in f.cp.view().models] == ["a"]


def test_a_model_removed_before_it_was_placed_is_placed_no_more() -> None:
    """Found by the state machine: a removed model with no replica yet but one to place
    was never judged again, and the next placement looked up its profile (KeyError)."""
    f = fleet_with(model("a", 1), model("big", 1, tensor_parallel=8, gpu_memory_gib=90), nodes=1)
    assert set(f.cp.view().unplaced) == {"big"}
    f.set_catalog(catalog(model("a", 1)))
    assert f.cp.view().unplaced == {}
    f.join(gpu_node("n2", 8, fabric=POD_A))  # room appears: placement runs again
    f.advance(FAST.reconcile_interval_s + 1)
    assert not f.replicas("big") and len(f.replicas("a")) == 1


# -- failures ------------------------------------------------------------------------


def test_a_failed_replica_restarts_with_backoff_and_a_crash_loop_shows() -> None:
    f = fleet_with(model("a", 1), nodes=1)
    (start,) = f.starts()
    rid = start.spec.replica_id
    delays = []
    for attempt in range(7):
        f.report("n1", rid, 0, FAILED, "exit status 1: CUDA out of memory")
        failed_at = f.now
        count = len(f.starts())
        while len(f.starts()) == count:
            f.advance(1)
        delays.append(f.now - failed_at)
        restart = f.starts()[-1].spec
        assert restart.attempt == attempt + 1 and restart.gpu_indices == start.spec.gpu_indices
        assert restart.port == start.spec.port + 2 * (attempt + 1)
        if attempt == 2:
            (r,) = f.cp.view().replicas
            assert r.crash_loop and r.failures == 3
    assert delays == [10, 20, 40, 80, 160, 300, 300]
    assert any("(crash loop): exit status 1: CUDA out of memory" in n for n in f.notes)
    # Serving for the longest backoff forgives the past.
    f.ready_all()
    f.advance(300)
    assert not f.cp.view().replicas[0].crash_loop
    f.report("n1", rid, 0, FAILED, "segfault")
    assert f.notes[-1].endswith("segfault; restart in 10 s")


def test_each_failure_is_counted_once_whichever_way_it_is_heard_of() -> None:
    """A failure reported on the stream, and one that happened while the stream was down
    (the agent's next registration carries it, without the update that was lost), each
    counted once (llmgw_engine_failures_total): a registration repeating a failure already
    heard of adds none."""
    f = fleet_with(model("a", 1), nodes=1)
    (start,) = f.starts()
    rid = start.spec.replica_id
    f.ready_all()
    f.report("n1", rid, 0, FAILED, "exit status 1")
    f.report("n1", rid, 0, FAILED, "exit status 1, and its output tail read")
    assert f.failed == ["a"]
    f.silence("n1", tell=True)
    f.register("n1")
    assert f.failed == ["a"]
    while len(f.starts()) == 1:
        f.advance(1)
    f.ready_all()
    f.silence("n1")
    f.report("n1", rid, 0, FAILED, "exit status 1")  # while away: the update is lost
    assert f.failed == ["a"]
    f.register("n1")
    assert f.failed == ["a", "a"]
    assert f.notes[-1].endswith("exit status 1; restart in 20 s"), f.notes
    f.register("n1")
    assert f.failed == ["a", "a"]
    # A new control plane process counts afresh: what its agents report failed is new to it.
    f.restart_control_plane(instance="b")
    assert f.failed == ["a", "a", "a"]


def test_a_failed_rank_restarts_the_whole_replica() -> None:
    f = Fleet(FAST, catalog(model("big", 1, tensor_parallel=8, pipeline_parallel=2)))
    f.join(gpu_node("n1", fabric=POD_A), gpu_node("n2", fabric=POD_A))
    f.ready_all()
    rid = f.starts()[0].spec.replica_id
    f.commands.clear()
    f.report("n2", rid, 1, FAILED, "NCCL timeout")
    assert f.commands == [StopShard("n1", rid, 0)]
    f.advance(10)
    assert sorted((c.node, c.spec.rank, c.spec.attempt) for c in f.starts()) == [
        ("n1", 0, 1),
        ("n2", 1, 1),
    ]


# -- nodes going away ----------------------------------------------------------------


def test_replicas_on_unreachable_nodes_stay_and_on_lost_nodes_move() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=3)
    f.ready_all()
    (home,) = {c.node for c in f.starts()}
    f.silence(home)
    f.advance(100)
    statuses = {n.name: n.status for n in f.cp.view().nodes}
    assert statuses[home] is NodeStatus.UNREACHABLE
    assert len(f.starts()) == 1
    f.advance(25)
    assert {n.name: n.status for n in f.cp.view().nodes}[home] is NodeStatus.LOST
    (moved,) = f.starts()[1:]
    assert moved.node != home
    f.ready_all()
    # The lost node comes back with its engine still up: one replica too many.
    f.commands.clear()
    f.register(home)
    (drain,) = f.commands
    assert isinstance(drain, DrainShard)
    assert len(f.replicas("a", READY)) == 1 and len(f.cp.view().replicas) == 2


def test_the_mass_loss_guard_keeps_replicas_where_they_are() -> None:
    f = fleet_with(model("a", 4, tensor_parallel=8), nodes=4)
    f.ready_all()
    for name in ("n1", "n2", "n3"):
        f.silence(name)
    f.advance(600)
    view = f.cp.view()
    assert view.guard is not None and view.guard.startswith("3 of 4 nodes turned unreachable")
    assert [n.status for n in view.nodes].count(NodeStatus.UNREACHABLE) == 3
    assert len(f.starts()) == 4 and any(n.startswith("mass-loss guard holds") for n in f.notes)
    f.register("n1")
    f.advance(5)
    assert f.cp.view().guard is None
    # The release gives the stragglers a fresh lost_after (120 s) to come back in.
    f.advance(110)
    assert [n.status for n in f.cp.view().nodes].count(NodeStatus.LOST) == 0
    assert len(f.starts()) == 4
    f.advance(10)
    assert [n.status for n in f.cp.view().nodes].count(NodeStatus.LOST) == 2


# -- a registration that leaves a running shard out (issue 34, finding 6) ----------------


def served(f: Fleet, model_name: str = "a") -> list[str]:
    return [e.url for e in f.cp.serving().get(model_name, ())]


def test_a_registration_without_a_ready_shard_keeps_its_route_until_lost_after() -> None:
    """A second machine under the node's name (a cloned image), or an agent that lost its
    state, registers with 0 shards while the replica serves: its route stays, its GPUs and
    ports stay held (a replacement there would find them in use), and nothing is started,
    until lost_after_s without the shard being reported. Then it is gone, as the ranks of a
    node that has not registered are: replaced."""
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (start,) = f.starts()
    home, rid = start.node, start.spec.replica_id
    url = start.spec.url
    assert served(f) == [url]
    f.agents[home].shards.clear()  # its registration says nothing of the replica
    f.register(home)
    assert served(f) == [url]
    assert len(f.starts()) == 1
    (replica,) = f.cp.view().replicas
    assert replica.serving and [s.unconfirmed for s in replica.shards] == [True]
    assert any(f"node {home} registered without replica {rid} rank 0" in n for n in f.notes)
    f.register(home)  # another one does not move the deadline on
    f.advance(FAST.lost_after_s - 5)
    assert served(f) == [url] and len(f.starts()) == 1
    f.advance(5)
    assert served(f) == []
    assert any(f"replica {rid} rank 0 since it registered without it" in n for n in f.notes)
    (replacement,) = f.starts()[1:]
    assert replacement.spec.replica_id != rid


def test_a_shard_reported_again_is_confirmed() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (start,) = f.starts()
    kept = dict(f.agents[start.node].shards)
    f.agents[start.node].shards.clear()
    f.register(start.node)
    f.agents[start.node].shards.update(kept)  # the agent that runs it registers again
    f.register(start.node)
    assert not any(s.unconfirmed for r in f.cp.view().replicas for s in r.shards)
    f.advance(2 * FAST.lost_after_s)
    assert served(f) == [start.spec.url] and len(f.starts()) == 1
    # Confirmed by an update on the stream as well.
    f.agents[start.node].shards.clear()
    f.register(start.node)
    f.agents[start.node].shards.update(kept)
    f.report(start.node, start.spec.replica_id, 0, READY)
    f.advance(2 * FAST.lost_after_s)
    assert served(f) == [start.spec.url] and len(f.starts()) == 1


def test_a_start_that_never_reached_the_agent_is_placed_again_at_once() -> None:
    """Only a shard the node reported running is awaited: a start sent into a stream that
    broke before the agent read it is not, and its replica is placed again at once."""
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=1)
    assert len(f.starts()) == 1
    f.agents["n1"].shards.clear()  # pending, as the control plane knows it: never started
    f.register("n1")
    assert len(f.starts()) == 2


def test_a_stream_that_closes_makes_its_node_unreachable_at_once() -> None:
    f = fleet_with(model("a", 1), nodes=2)
    f.silence("n1", tell=True)
    assert f.cp.view().nodes[0].status is NodeStatus.UNREACHABLE


# -- operators and the catalog -----------------------------------------------------------


def test_cordon_stops_new_placements_and_survives_a_restart() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=1)
    f.feed(f.cp.cordon("n1", True, f.now))
    assert f.commands[-1] == MarkNode("n1", cordoned=True, draining=False)
    f.set_catalog(catalog(model("a", 2, tensor_parallel=8)))
    assert len(f.starts()) == 1
    assert "1 cordoned (n1)" in f.cp.view().unplaced["a"].explanation.text
    f.restart_control_plane(instance="b")
    assert f.cp.view().nodes[0].cordoned
    with pytest.raises(KeyError):
        f.cp.cordon("nope", True, f.now)


def test_draining_a_node_moves_its_replicas() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (home,) = {c.node for c in f.starts()}
    f.commands.clear()
    f.feed(f.cp.drain_node(home, True, f.now))
    assert kinds(f.commands) == ["MarkNode", "StartShard"]  # no drain before the replacement
    replacement = f.commands[1]
    assert isinstance(replacement, StartShard) and replacement.node != home


def test_a_changed_profile_replaces_its_replicas() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=4), nodes=1)
    f.ready_all()
    old = f.starts()[0].spec
    f.commands.clear()
    f.set_catalog(catalog(model("a", 1, tensor_parallel=4, args=("--max-model-len", "8192"))))
    (start,) = f.commands  # make before break: the old replica serves on
    assert isinstance(start, StartShard) and start.spec.args == ("--max-model-len", "8192")
    assert start.spec.gpu_indices == (4, 5, 6, 7)  # the old replica still holds its GPUs
    f.commands.clear()
    f.ready_all()
    assert f.commands == [DrainShard("n1", old.replica_id, 0)]


def test_a_changed_max_model_len_replaces_its_replicas_and_reaches_the_spec() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=4), nodes=1)
    f.ready_all()
    assert f.starts()[0].spec.max_model_len is None
    f.commands.clear()
    f.set_catalog(catalog(model("a", 1, tensor_parallel=4, max_model_len=2048)))
    (start,) = f.commands
    assert isinstance(start, StartShard) and start.spec.max_model_len == 2048
    f.commands.clear()
    f.ready_all()
    f.set_catalog(catalog(model("a", 1, tensor_parallel=4, max_model_len=2048)))
    assert not any(isinstance(c, StartShard) for c in f.commands)  # unchanged: no roll


def test_changed_lora_adapters_replace_their_replicas_and_reach_the_spec() -> None:
    sql, chat = LoraAdapter("a-sql", "/lora/sql"), LoraAdapter("a-chat", "/lora/chat")
    f = fleet_with(model("a", 1, tensor_parallel=4, lora=(sql,)), nodes=1)
    f.ready_all()
    (first,) = f.starts()
    assert (first.spec.lora, first.spec.max_lora_rank) == ((sql,), None)
    assert f.cp.catalog.adapters == {"a-sql": "a"}
    for lora, rank in [((sql, chat), None), ((sql, chat), 32), ((chat,), 32)]:
        f.commands.clear()
        f.set_catalog(catalog(model("a", 1, tensor_parallel=4, lora=lora, max_lora_rank=rank)))
        (start,) = f.commands  # each change rolls the replica, make before break
        assert isinstance(start, StartShard)
        assert (start.spec.lora, start.spec.max_lora_rank) == (lora, rank)
        f.commands.clear()
        f.ready_all()
        (drain,) = f.commands  # the old one, once the new one serves
        assert isinstance(drain, DrainShard)
        f.feed(f.cp.replica_drained(drain.replica_id, f.now))
    f.commands.clear()
    f.set_catalog(catalog(model("a", 1, tensor_parallel=4, lora=(chat,), max_lora_rank=32)))
    assert not any(isinstance(c, StartShard) for c in f.commands)  # unchanged: no roll


def test_unplaceable_models_are_explained() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8, gpu_memory_gib=90), nodes=2)
    (unplaced,) = f.cp.view().unplaced.values()
    assert unplaced.count == 1 and unplaced.waiting is None
    assert unplaced.explanation.text == (
        "0 of 2 nodes fit: 2 lack 90 GiB free per GPU (n1: 80 GiB, n2: 80 GiB)"
    )
    why = f.cp.explain("a")
    assert why is not None and why.text == unplaced.explanation.text
    assert f.cp.explain("nope") is None


def test_forgetting_a_lost_node() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.silence("n2")
    with pytest.raises(ValueError, match="not lost"):
        f.cp.forget_node("n2", f.now)
    f.advance(200)
    f.feed(f.cp.forget_node("n2", f.now))
    assert [n.name for n in f.cp.view().nodes] == ["n1"]


def test_a_clock_that_steps_back_does_not_undo_time() -> None:
    f = fleet_with(model("a", 1), nodes=1)
    step = f.cp.tick(f.now - 100)
    assert step.commands == ()
    assert attrs.evolve(f.cp.view().nodes[0]).status is NodeStatus.REACHABLE


def test_a_burst_of_events_is_batched_into_one_reconcile() -> None:
    settings = ControlSection(settle_after_start_s=0, reconcile_interval_s=0.2)
    f = Fleet(settings, catalog(model("a", 4, tensor_parallel=8)))
    f.join(gpu_node("n1"))
    assert len(f.starts()) == 1  # the first event after a quiet spell reconciles at once
    for i in range(2, 5):
        f.join(gpu_node(f"n{i}"))
    assert len(f.starts()) == 1 and f.last_step.wake_at == f.now + 0.2
    assert not f.last_step.reconciled
    f.now += 0.2
    step = f.cp.tick(f.now)
    assert step.reconciled and len(step.commands) == 3


def test_flags_set_while_a_node_is_away_reach_it_when_it_comes_back() -> None:
    f = fleet_with(model("a", 1), nodes=2)
    f.silence("n1")
    f.advance(20)
    f.feed(f.cp.drain_node("n1", True, f.now))
    assert not any(isinstance(c, MarkNode) for c in f.commands)
    f.agents["n1"].connected = True
    f.heartbeats()
    assert MarkNode("n1", cordoned=False, draining=True) in f.commands
    assert f.agents["n1"].draining


def test_nodes_that_share_an_address_share_one_port_space() -> None:
    # Simulated nodes on one machine (the demo, the end-to-end tests) all answer on 127.0.0.1.
    f = Fleet(FAST, catalog(model("m", 2, tensor_parallel=8)))
    f.join(*[attrs.evolve(gpu_node(name, 8), address="127.0.0.1") for name in ("n1", "n2")])
    ports = sorted(s.spec.port for s in f.starts())
    assert len(ports) == 2 and ports[1] - ports[0] >= 2  # two pairs, no overlap


def test_a_replica_given_up_with_its_lost_node_is_retired_when_the_node_returns() -> None:
    f = fleet_with(model("m", 1, tensor_parallel=8))
    (first,) = f.starts()
    f.ready_all()
    f.silence(first.node)  # its engine keeps running, out of sight
    f.advance(FAST.lost_after_s + FAST.unreachable_after_s + 10)
    assert f.cp.lifecycle.nodes[first.node].status is NodeStatus.LOST
    replacement = f.starts()[-1]
    assert replacement.node != first.node
    f.ready_all()
    f.commands.clear()
    f.agents[first.node].connected = True
    f.register(first.node)  # it comes back, still running the old shard
    f.advance(FAST.drain_timeout_s + 1)
    stopped = [c for c in f.commands if isinstance(c, DrainShard | StopShard)]
    assert stopped and all(c.replica_id == first.spec.replica_id for c in stopped)
    assert f.replicas("m", READY) == {replacement.spec.replica_id}


# -- drain: make before break ----------------------------------------------------------


def serving_nodes(f: Fleet, model_name: str) -> list[str]:
    return sorted(
        r.shards[0].node for r in f.cp.view().replicas if r.model == model_name and r.serving
    )


def test_a_drain_serves_from_the_old_replicas_until_their_replacements_serve() -> None:
    f = fleet_with(model("a", 2, tensor_parallel=4), nodes=2)
    f.ready_all()
    old = {c.spec.replica_id for c in f.starts()}
    (home,) = {c.node for c in f.starts()}  # best fit: both replicas on one node
    f.commands.clear()
    f.feed(f.cp.drain_node(home, True, f.now))
    assert kinds(f.commands) == ["MarkNode", "StartShard", "StartShard"]
    assert any(f"draining {home}: 2 replicas move before they stop" in n for n in f.notes)
    assert serving_nodes(f, "a") == [home, home]
    moving = [r for r in f.cp.view().replicas if r.replica_id in old]
    assert all(r.moving and r.serving and not r.kept for r in moving)
    assert f.cp.view().models[0].kept == 2  # the replacements count; the old ones serve
    new = [c.spec for c in f.starts()]
    f.advance(FAST.drain_timeout_s * 2)  # replacements that take their time to load
    assert kinds(f.commands)[3:] == [] and serving_nodes(f, "a") == [home, home]
    # One replacement serves: one old replica leaves the router and drains.
    f.report(new[0].node, new[0].replica_id, 0, STARTING)
    f.report(new[0].node, new[0].replica_id, 0, READY)
    (drain,) = f.commands[3:]
    assert isinstance(drain, DrainShard) and drain.replica_id in old
    assert serving_nodes(f, "a") == sorted([home, new[0].node])
    assert any("its replacement serves" in n for n in f.notes)
    f.feed(f.cp.replica_drained(drain.replica_id, f.now))
    assert f.commands[4:] == [StopShard(home, drain.replica_id, 0)]
    f.ready_all()
    assert kinds(f.commands)[5:] == ["DrainShard"]
    assert serving_nodes(f, "a") == sorted([new[0].node, new[1].node])
    f.advance(FAST.drain_timeout_s)
    assert not f.agents[home].shards and len(f.replicas("a", READY)) == 2


def test_a_drain_that_would_take_a_replica_offline_is_refused_unless_forced() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=6), model("b", 1, tensor_parallel=2), nodes=1)
    f.join(gpu_node("n2", 4, fabric=POD_A))  # room for b, not for a
    assert {c.node for c in f.starts()} == {"n1"}
    f.ready_all()
    before = f.cp.view()
    f.commands.clear()
    with pytest.raises(DrainRefused) as refused:
        f.cp.request_drain("n1", f.now)
    (stuck,) = refused.value.stuck
    assert stuck.model == "a" and stuck.replica_id.startswith("a-")
    assert stuck.explanation.text == (
        # Against the other nodes as they would be once b moved to n2; n1, the node
        # asked about, is not counted as one already draining.
        "0 of 1 nodes fit: 1 has too few free GPUs (n2 has 2, need 6)"
    )
    assert str(refused.value).startswith("draining n1 would take replicas offline: replica a-")
    assert f.cp.view() == before and f.commands == []
    # Forced: b moves (make before break), a stops at once: nothing could replace it.
    f.feed(f.cp.request_drain("n1", f.now, force=True))
    assert kinds(f.commands) == ["MarkNode", "DrainShard", "StartShard"]
    drain, start = f.commands[1:]
    assert isinstance(drain, DrainShard) and drain.replica_id == stuck.replica_id
    assert isinstance(start, StartShard) and start.spec.model_name == "b" and start.node == "n2"
    assert any("fits nowhere else and stops without a replacement" in n for n in f.notes)
    assert serving_nodes(f, "a") == [] and serving_nodes(f, "b") == ["n1"]
    f.ready_all()
    assert serving_nodes(f, "b") == ["n2"]
    f.advance(FAST.drain_timeout_s)
    assert not f.agents["n1"].shards
    assert f.cp.view().unplaced["a"].explanation.text.startswith("0 of 2 nodes fit")


def test_a_forced_drain_still_moves_what_can_move_before_stopping_it() -> None:
    f = fleet_with(model("a", 2, tensor_parallel=4), nodes=1)
    f.join(gpu_node("n2", 4, fabric=POD_A))  # room for one of the two
    f.ready_all()
    f.commands.clear()
    with pytest.raises(DrainRefused) as refused:
        f.cp.request_drain("n1", f.now)
    assert len(refused.value.stuck) == 1  # one of the two fits; checked together
    f.feed(f.cp.request_drain("n1", f.now, force=True))
    assert kinds(f.commands) == ["MarkNode", "DrainShard", "StartShard"]
    assert serving_nodes(f, "a") == ["n1"]  # the other one serves until its replacement does
    f.ready_all()
    assert kinds(f.commands)[3:] == ["DrainShard"] and serving_nodes(f, "a") == ["n2"]


def lose_the_replacement_of_a_drain(*, force: bool) -> tuple[Fleet, StartShard, StartShard]:
    """One replica, two nodes: drain its node (room on the other, so not refused); the
    replacement starts, then its node goes silent and is declared lost before it serves."""
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (old,) = f.starts()
    f.feed(f.cp.request_drain(old.node, f.now, force=force))
    (_, new) = f.starts()
    f.report(new.node, new.spec.replica_id, 0, STARTING)
    f.commands.clear()
    f.silence(new.node)
    f.advance(FAST.lost_after_s + FAST.drain_timeout_s + 5)
    assert f.cp.lifecycle.nodes[new.node].status is NodeStatus.LOST
    return f, old, new


def test_a_drain_not_forced_never_takes_a_model_offline_when_its_replacement_is_lost() -> None:
    f, old, new = lose_the_replacement_of_a_drain(force=False)
    assert [c for c in f.commands if isinstance(c, DrainShard | StopShard)] == []
    assert serving_nodes(f, "a") == [old.node]  # still in the router
    view = f.cp.view()
    (moving,) = [r for r in view.replicas if r.replica_id == old.spec.replica_id]
    assert moving.moving and moving.serving and not moving.kept
    why = view.unplaced["a"]  # the operator is told why the drain does not end
    assert why.count == 1 and why.waiting is None
    assert why.explanation.text == f"0 of 2 nodes fit: 1 lost ({new.node}); 1 draining ({old.node})"
    # The node comes back: the move resumes, and the old replica leaves once one serves.
    f.agents[new.node].connected = True
    f.register(new.node)
    f.ready_all()
    assert serving_nodes(f, "a") == [new.node]
    f.advance(FAST.drain_timeout_s + 1)
    assert not f.agents[old.node].shards and "a" not in f.cp.view().unplaced


def test_a_forced_drain_stops_a_replica_whose_replacement_is_lost() -> None:
    f, old, _ = lose_the_replacement_of_a_drain(force=True)
    assert DrainShard(old.node, old.spec.replica_id, 0) in f.commands
    assert any(f"the drain of node {old.node} is forced and it fits nowhere" in n for n in f.notes)
    assert serving_nodes(f, "a") == [] and not f.agents[old.node].shards


def test_forcing_a_drain_under_way_stops_what_fits_nowhere_else() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=1)
    f.ready_all()
    (old,) = f.starts()
    f.feed(f.cp.drain_node("n1", True, f.now))  # not forced, not asked: it serves on
    assert any("fits nowhere else and serves on there until" in n for n in f.notes)
    f.advance(60)
    assert serving_nodes(f, "a") == ["n1"] and not f.cp.view().nodes[0].drain_forced
    f.feed(f.cp.request_drain("n1", f.now))  # asked again without force: nothing changes
    assert serving_nodes(f, "a") == ["n1"]
    f.commands.clear()
    f.feed(f.cp.request_drain("n1", f.now, force=True))
    assert any("draining n1 is forced now" in n for n in f.notes)
    assert DrainShard("n1", old.spec.replica_id, 0) in f.commands
    assert f.cp.view().nodes[0].drain_forced
    # Undrained, then drained again: the new drain is not forced.
    f.feed(f.cp.drain_node("n1", False, f.now))
    f.feed(f.cp.drain_node("n1", True, f.now))
    assert f.cp.view().nodes[0].draining and not f.cp.view().nodes[0].drain_forced


def test_a_forced_drain_goes_on_unforced_after_a_control_plane_restart() -> None:
    # Agents keep `draining`, not whether it was forced: the restarted control plane errs
    # on the side that keeps models serving, and the operator forces again.
    f = fleet_with(model("a", 1, tensor_parallel=4), model("b", 1, tensor_parallel=4), nodes=1)
    f.ready_all()
    f.join(gpu_node("n2", 4, fabric=POD_A))
    f.feed(f.cp.request_drain("n1", f.now, force=True))
    (start,) = f.starts()[2:]  # one of the two moves; the other stops
    (gone,) = {c.replica_id for c in f.commands if isinstance(c, DrainShard)}
    f.restart_control_plane(instance="b")
    assert f.cp.lifecycle.nodes["n1"].draining and not f.cp.lifecycle.nodes["n1"].drain_forced
    f.advance(FAST.drain_timeout_s + 1)  # what a forced drain began still stops
    assert gone not in f.replicas(f.catalog.profiled[0].name) | f.replicas("b")
    f.ready_all()
    assert serving_nodes(f, start.spec.model_name) == ["n2"]


def test_a_drain_checks_placement_once() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    checks = 0
    check = f.cp.drain_check

    def counted(node: str) -> list[Stuck]:
        nonlocal checks
        checks += 1
        return check(node)

    f.cp.drain_check = counted  # type: ignore[method-assign]  # a probe that counts the calls
    f.feed(f.cp.request_drain(f.starts()[0].node, f.now))
    assert checks == 1 and len(f.starts()) == 2


def test_a_refusal_names_the_stuck_replicas_of_a_model_once_with_the_explanation() -> None:
    f = fleet_with(model("a", 2, tensor_parallel=4), nodes=1)
    with pytest.raises(DrainRefused) as refused:
        f.cp.request_drain("n1", f.now)
    assert str(refused.value) == (
        "draining n1 would take replicas offline: replicas a-a-1, a-a-2 of a fit nowhere "
        "else: there is no other node"
    )


def test_a_refusal_counts_as_draining_only_the_nodes_that_are() -> None:
    """The node asked about is not 'already draining' in the explanation (issue 18)."""
    f = fleet_with(model("a", 1, tensor_parallel=8), model("b", 1, tensor_parallel=8), nodes=3)
    f.ready_all()
    placed = {c.node for c in f.starts()}
    idle = ({"n1", "n2", "n3"} - placed).pop()
    f.cp.request_drain(idle, f.now)  # empty: drained at once, and stays draining
    asked = sorted(placed)[0]
    with pytest.raises(DrainRefused) as refused:
        f.cp.request_drain(asked, f.now)
    (stuck,) = refused.value.stuck
    assert stuck.explanation.text.startswith(f"0 of 2 nodes fit: 1 draining ({idle}); ")
    assert asked not in stuck.explanation.text


def test_a_replica_failing_on_a_draining_node_is_stopped_not_restarted_there() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (home,) = {c.node for c in f.starts()}
    rid = f.starts()[0].spec.replica_id
    f.feed(f.cp.drain_node(home, True, f.now))
    f.commands.clear()
    f.report(home, rid, 0, FAILED, "segfault")
    f.advance(60)
    assert [c for c in f.commands if isinstance(c, StartShard)] == []
    assert f.commands == [StopShard(home, rid, 0)]


def test_undrain_during_a_move_keeps_the_old_replica_and_drops_the_replacement() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (old,) = f.starts()
    f.feed(f.cp.drain_node(old.node, True, f.now))
    (_, new) = f.starts()
    f.commands.clear()
    f.feed(f.cp.drain_node(old.node, False, f.now))
    assert f.commands == [
        MarkNode(old.node, cordoned=False, draining=False),
        StopShard(new.node, new.spec.replica_id, 0),  # starting, never served: stopped
    ]
    assert f.replicas("a", READY) == {old.spec.replica_id}


def test_draining_a_draining_node_again_is_not_checked_again() -> None:
    f = fleet_with(model("a", 1, tensor_parallel=8), nodes=2)
    f.ready_all()
    (home,) = {c.node for c in f.starts()}
    f.feed(f.cp.request_drain(home, f.now))
    # The replacement holds the other node's GPUs: a second check would find no room.
    f.feed(f.cp.request_drain(home, f.now))
    assert len(f.starts()) == 2
    with pytest.raises(KeyError):
        f.cp.request_drain("nope", f.now)


def test_a_drain_during_the_settle_time_after_a_restart_holds_until_placement_resumes() -> None:
    settings = ControlSection(settle_after_start_s=30, reconcile_interval_s=0)
    f = keyed(Fleet(settings, catalog(model("a", 1, tensor_parallel=8))))
    f.join(gpu_node("n1", fabric=POD_A), gpu_node("n2", fabric=POD_A))
    f.advance(35)
    f.ready_all()
    (old,) = f.starts()
    f.restart_control_plane(instance="b")
    f.commands.clear()
    f.feed(f.cp.request_drain(old.node, f.now))
    f.advance(25)  # placement waits for re-registering agents: the old replica serves on
    assert kinds(f.commands) == ["MarkNode"] and serving_nodes(f, "a") == [old.node]
    f.advance(10)
    (start,) = f.starts()
    assert start.node != old.node and serving_nodes(f, "a") == [old.node]
    f.ready_all()
    assert serving_nodes(f, "a") == [start.node]
    assert DrainShard(old.node, old.spec.replica_id, 0) in f.commands


# -- engine keys ---------------------------------------------------------------------


def test_each_replica_has_its_own_engine_key_on_every_shard() -> None:
    f = keyed(Fleet(FAST, catalog(model("big", 1, tensor_parallel=8, pipeline_parallel=2))))
    f.join(gpu_node("n1", fabric=POD_A), gpu_node("n2", fabric=POD_A), gpu_node("n3"))
    f.set_catalog(
        catalog(model("big", 1, tensor_parallel=8, pipeline_parallel=2), model("small", 1))
    )
    keys = {(c.spec.model_name, c.spec.rank): c.spec.api_key for c in f.starts()}
    assert keys == {("big", 0): "key-1", ("big", 1): "key-1", ("small", 0): "key-2"}
    f.ready_all()
    serving = f.cp.serving()
    assert [e.api_key for e in serving["big"]] == ["key-1"]
    assert [e.api_key for e in serving["small"]] == ["key-2"]
    url = f.cp.view().replicas[0].url
    assert serving["big"][0] == Endpoint(url.split("//")[1].split(":")[0], 20000, api_key="key-1")
    # A restart after a failure keeps the replica's key.
    small = next(c.spec for c in f.starts() if c.spec.model_name == "small")
    f.report(small.node, small.replica_id, 0, FAILED, "oom")
    f.advance(15)
    assert f.starts()[-1].spec.attempt == 1 and f.starts()[-1].spec.api_key == "key-2"


def test_a_restarted_control_plane_learns_the_keys_back_from_the_agents() -> None:
    settings = ControlSection(reconcile_interval_s=0)
    f = keyed(Fleet(settings, catalog(model("a", 2, tensor_parallel=4))))
    f.join(gpu_node("n1"), gpu_node("n2"))
    f.advance(40)
    f.ready_all()
    before = f.cp.serving()
    assert sorted(e.api_key for e in before["a"]) == ["key-1", "key-2"]
    f.commands.clear()

    def no_new_keys() -> str:
        raise AssertionError("adoption must not make new keys")

    keyed(f, no_new_keys, instance="b")
    for name in f.agents:
        f.register(name)
    f.advance(300)
    assert f.commands == [] and f.cp.serving() == before
    (rid, *_) = sorted(f.replicas("a"))
    found = f.cp.endpoint(rid)
    assert found is not None and found[1].api_key in ("key-1", "key-2")


def test_engine_keys_never_show_in_views_notes_commands_or_the_status_api() -> None:
    f = fleet_with(model("a", 2, tensor_parallel=4), model("b", 1, gpu_memory_gib=99), nodes=2)
    f.ready_all()
    (home,) = {c.node for c in f.starts()}
    f.feed(f.cp.drain_node(home, True, f.now))
    keys = {c.spec.api_key for c in f.starts()}
    assert keys == {"key-1", "key-2", "key-3", "key-4"}
    view = f.cp.view()
    shown = [
        repr(view),
        repr(f.commands),
        repr(f.cp.serving()),
        " ".join(str(e) for e in f.cp.serving()["a"]),
        "\n".join(f.notes),
        json.dumps(to_json(status_doc(view, {}, f.now))),
        repr(f.cp.explain("b")),
    ]
    for text in shown:
        assert not any(key in text for key in keys), text
