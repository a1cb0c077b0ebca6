"""The reconciler, the lifecycle and placement driven together through random histories.

Nodes join, heartbeat, go silent, come back and reboot; shards progress, fail
and exit; the catalog and the operator's flags change; the control plane
restarts; time moves. The invariants of the issue are checked after every step,
and liveness (every desired replica placed once events stop, capacity allowing)
at the end of every history.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fleetsim import A100, H100, LIVE, Fleet, Shell, gpu_node, model
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hypothesis_profiles import profile_times
from llmgw_core.catalog import Catalog, ModelEntry, Profile
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import Inventory, ShardState
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.shards import Phase
from llmgw_server.control.views import ControlView

SETTINGS = ControlSection(
    unreachable_after_s=15,
    lost_after_s=60,
    mass_loss_window_s=30,
    restart_backoff_s=10,
    restart_backoff_max_s=40,
    drain_timeout_s=20,
    settle_after_start_s=10,
    reconcile_interval_s=0,
)
A, B = {"ib_domain": "pod-a"}, {"ib_domain": "pod-b"}
POOL: dict[str, Inventory] = {
    "n1": gpu_node("n1", 4, fabric=A),
    "n2": gpu_node("n2", 2, fabric=A),
    "n3": gpu_node("n3", 2, fabric=A),
    "n4": gpu_node("n4", 2, fabric=B),
    "n5": gpu_node("n5", 2, fabric=B),
    "n6": gpu_node("n6", 4, fabric=B, gpu_name=A100, total_gib=40),
    "n7": gpu_node("n7", 2, labels={"pool": "dev"}),
}
MODELS: dict[str, dict[str, Any]] = {  # a Profile's fields beyond engine and model
    "one": {"tensor_parallel": 1},
    "four": {"tensor_parallel": 4, "gpu_memory_gib": 60, "gpu_model": "H100"},
    "pipe": {"tensor_parallel": 2, "pipeline_parallel": 2},
}
R, U, L = NodeStatus.REACHABLE, NodeStatus.UNREACHABLE, NodeStatus.LOST


class ControlMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.replicas = {"one": 1, "four": 1, "pipe": 1}
        self.args: dict[str, tuple[str, ...]] = {name: () for name in MODELS}
        self.present = set(MODELS)  # the models in the catalog (a reload adds or removes)
        self.fleet = Fleet(SETTINGS, self.catalog(), now=1000.0, instance="i0")
        self.fleet.shell = Shell()  # every step carries what the shell needs
        self.restarts = 0
        self.seen_lost = 0

    def catalog(self) -> Catalog:
        return Catalog(
            tuple(
                model(name, self.replicas[name], args=self.args[name], **kw)
                for name, kw in MODELS.items()
                if name in self.present
            )
        )

    # -- nodes ---------------------------------------------------------------------

    @initialize(names=st.sets(st.sampled_from(sorted(POOL)), min_size=3))
    def a_fleet_runs(self, names: set[str]) -> None:
        for name in sorted(names):
            self.fleet.join(POOL[name])
        self.fleet.advance(SETTINGS.settle_after_start_s)
        self.fleet.ready_all()

    @rule(name=st.sampled_from(sorted(POOL)))
    def join(self, name: str) -> None:
        if name in self.fleet.agents:
            self.fleet.register(name)  # the agent reconnects, or registers again
        else:
            self.fleet.join(POOL[name])

    @precondition(lambda self: self.fleet.agents)
    @rule(data=st.data(), tell=st.booleans())
    def go_silent(self, data: st.DataObject, tell: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.fleet.agents)))
        self.fleet.silence(name, tell=tell)

    @precondition(lambda self: self.fleet.agents)
    @rule(data=st.data(), keep_engines=st.booleans())
    def agent_restarts(self, data: st.DataObject, keep_engines: bool) -> None:
        """The agent process restarts; a reboot takes its engines with it (and its state:
        its registration leaves them out, as a second machine under its name would)."""
        name = data.draw(st.sampled_from(sorted(self.fleet.agents)))
        if not keep_engines:
            self.fleet.agents[name].shards.clear()
        serving = self.serving_from(name)
        self.fleet.register(name)
        self.a_registration_withdraws_no_route(serving)

    def serving_from(self, name: str) -> set[tuple[str, str]]:
        """(model, URL) of each replica that serves with a ready shard on `name` which the
        node's next registration leaves out or reports ready (not failed, say)."""
        cp = self.fleet.cp
        urls = {(m, e.url) for m, endpoints in cp.serving().items() for e in endpoints}
        reported = {
            (r.spec.replica_id, r.spec.rank): r.state for r in self.fleet.agents[name].reports()
        }
        return {
            (r.model, r.url)
            for r in cp.view([name]).replicas
            if r.serving
            and (r.model, r.url) in urls
            and any(
                s.node == name
                and reported.get((r.replica_id, s.rank), ShardState.READY) is ShardState.READY
                for s in r.shards
            )
        }

    def a_registration_withdraws_no_route(self, serving: set[tuple[str, str]]) -> None:
        """Issue 34, finding 6: whatever a registration leaves out, a replica that served
        from the node keeps its route until the control plane decides (lost_after_s) that
        the shard is gone. Time does not move in a registration."""
        after = {(m, e.url) for m, endpoints in self.fleet.cp.serving().items() for e in endpoints}
        assert serving <= after, serving - after

    @rule(dt=st.sampled_from([1.0, 5.0, 12.0, 30.0, 65.0]))
    def time_passes(self, dt: float) -> None:
        self.fleet.advance(dt)

    @rule(dt=st.sampled_from([16.0, 70.0]))
    def nobody_heard_for_a_while(self, dt: float) -> None:
        """The control plane hears nothing: its own network, or a stalled process."""
        self.fleet.advance(dt, beat=False)

    @precondition(lambda self: self.fleet.cp.lifecycle.nodes)
    @rule(
        data=st.data(), on=st.booleans(), flag=st.sampled_from(["cordon", "drain", "force-drain"])
    )
    def operator_flags(self, data: st.DataObject, on: bool, flag: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.fleet.cp.lifecycle.nodes)))
        cp, now = self.fleet.cp, self.fleet.now
        if flag == "cordon":
            self.fleet.feed(cp.cordon(name, on, now))
        else:
            self.fleet.feed(cp.drain_node(name, on, now, force=flag == "force-drain"))

    @rule(data=st.data())
    def control_plane_restarts(self, data: st.DataObject) -> None:
        order = data.draw(st.permutations(sorted(self.fleet.agents)))
        self.restarts += 1
        self.fleet.restart_control_plane(instance=f"i{self.restarts}", order=order)

    # -- shards --------------------------------------------------------------------------

    def pick_shard(
        self, data: st.DataObject, states: tuple[ShardState, ...]
    ) -> tuple[str, str, int]:
        shards = sorted(
            (name, s.spec.replica_id, s.spec.rank)
            for name, s in self.fleet.shards()
            if s.state in states
        )
        return data.draw(st.sampled_from(shards)) if shards else ("", "", 0)

    @rule(data=st.data())
    def shard_progresses(self, data: st.DataObject) -> None:
        name, rid, rank = self.pick_shard(data, (ShardState.PENDING, ShardState.STARTING))
        if name:
            shard = self.fleet.agents[name].shards[(rid, rank)]
            nxt = ShardState.STARTING if shard.state is ShardState.PENDING else ShardState.READY
            self.fleet.report(name, rid, rank, nxt)

    @rule(data=st.data())
    def shard_fails(self, data: st.DataObject) -> None:
        name, rid, rank = self.pick_shard(data, LIVE)
        if name:
            self.fleet.report(name, rid, rank, ShardState.FAILED, "engine exited with status 1")

    @rule(data=st.data())
    def shard_exits_cleanly(self, data: st.DataObject) -> None:
        name, rid, rank = self.pick_shard(data, LIVE)
        if name:
            self.fleet.report(name, rid, rank, ShardState.STOPPED)
            del self.fleet.agents[name].shards[(rid, rank)]

    @rule(data=st.data())
    def router_reports_drained(self, data: st.DataObject) -> None:
        rids = sorted({s.spec.replica_id for _, s in self.fleet.shards(ShardState.DRAINING)})
        if rids:
            rid = data.draw(st.sampled_from(rids))
            self.fleet.feed(self.fleet.cp.replica_drained(rid, self.fleet.now))

    # -- the catalog ------------------------------------------------------------------------

    @rule(name=st.sampled_from(sorted(MODELS)), n=st.integers(0, 3))
    def scale(self, name: str, n: int) -> None:
        self.replicas[name] = n
        self.fleet.set_catalog(self.catalog())

    @rule(name=st.sampled_from(sorted(MODELS)))
    def change_args(self, name: str) -> None:
        self.args[name] = () if self.args[name] else ("--max-model-len", "4096")
        self.fleet.set_catalog(self.catalog())

    @rule(name=st.sampled_from(sorted(MODELS)))
    def add_or_remove_model(self, name: str) -> None:
        """A reload adds the model to the catalog, or removes it (its replicas drain)."""
        self.present ^= {name}
        self.fleet.set_catalog(self.catalog())

    def desired(self, name: str) -> int:
        return self.replicas[name] if name in self.present else 0

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def the_invariants_hold(self) -> None:
        """Each check below, after every step, over one view: a view costs O(fleet) and
        the explanations of unplaced models; built once per step, not once per check."""
        view = self.fleet.cp.view()
        self.no_gpu_is_assigned_twice(view)
        self.no_more_replicas_than_desired_run_on_reachable_nodes(view)
        self.multi_node_replicas_stay_in_one_fabric_domain()
        self.every_unplaced_replica_is_explained_node_by_node(view)
        self.nothing_is_lost_early_and_the_mass_loss_guard_holds(view)

    def no_gpu_is_assigned_twice(self, view: ControlView) -> None:
        for agent in self.fleet.agents.values():
            gpus = agent.live_gpus()
            assert len(gpus) == len(set(gpus)), (agent.name, gpus)
        held: set[tuple[str, int]] = set()
        for replica in view.replicas:
            for shard in replica.shards:
                if shard.state is not ShardState.STOPPED:
                    for i in shard.gpus:
                        assert (shard.node, i) not in held, (shard.node, i)
                        held.add((shard.node, i))

    def no_more_replicas_than_desired_run_on_reachable_nodes(self, view: ControlView) -> None:
        status = {n.name: n.status for n in view.nodes}
        running: dict[str, int] = defaultdict(int)
        for replica in view.replicas:
            if any(s.retiring for s in replica.shards):
                continue
            if any(
                s.state in (ShardState.PENDING, ShardState.STARTING, ShardState.READY)
                and status[s.node] is R
                for s in replica.shards
            ):
                running[replica.model] += 1
        for name, n in running.items():
            assert n <= self.desired(name), (name, n)
        for m in view.models:
            assert m.kept <= m.desired

    def multi_node_replicas_stay_in_one_fabric_domain(self) -> None:
        specs = [s.spec for _, s in self.fleet.shards()]
        for spec in specs:
            p = Profile(engine="mock", model="x", **MODELS[spec.model_name])
            inventories = [POOL[n] for n in spec.nodes]
            if spec.nnodes == 1:
                assert len(spec.gpu_indices) == p.gpus
                continue
            assert spec.nnodes == p.pipeline_parallel
            assert len(spec.gpu_indices) == p.tensor_parallel
            domains = {i.fabric.get("ib_domain") for i in inventories}
            assert len(domains) == 1 and None not in domains, spec
            assert len({i.gpus[0].name for i in inventories}) == 1

    def every_unplaced_replica_is_explained_node_by_node(self, view: ControlView) -> None:
        names = {n.name for n in view.nodes}
        for m in view.models:
            unplaced = view.unplaced.get(m.name)
            if m.kept < m.desired:
                assert unplaced is not None and unplaced.count == m.desired - m.kept, m
                why = unplaced.explanation
                assert set(why.passed_over) | set(why.fitting) == names
                assert not set(why.passed_over) & set(why.fitting)
                assert all(name in why.text for name in names)
                if unplaced.waiting is None:
                    assert not why.placeable, why.text
            else:
                assert unplaced is None

    def nothing_is_lost_early_and_the_mass_loss_guard_holds(self, view: ControlView) -> None:
        f, s = self.fleet, SETTINGS
        for lost in f.lost[self.seen_lost :]:
            t = lost.transition
            assert t.at - lost.heard >= s.lost_after_s, t
            assert t.at - lost.started >= s.lost_after_s, t
            if lost.guarded:
                # Unreachable during a guard: lost no earlier than lost_after after its release.
                assert lost.released is not None, t
                assert t.at - lost.released >= s.lost_after_s, (t, lost.released)
        self.seen_lost = len(f.lost)
        nodes = f.cp.lifecycle.nodes
        live = [n for n in nodes if nodes[n].status is not L]
        unreachable = [n for n in live if nodes[n].status is U]
        limit = s.mass_loss_share * len(live)
        guard = view.guard
        if guard is not None:
            assert len(unreachable) > limit
        since = {n: f.closed.get(n, f.heard[n] + s.unreachable_after_s) for n in unreachable}
        if sum(1 for t in since.values() if t >= f.now - s.mass_loss_window_s) > limit:
            assert guard is not None
        for n in unreachable:
            quiet_since = max(f.heard[n], f.cp.started_at, f.released.get(n, f.heard[n]))
            if f.now - quiet_since >= s.lost_after_s:
                assert guard is not None, n

    @rule(data=st.data())
    def a_settled_fleet_survives_a_control_plane_restart(self, data: st.DataObject) -> None:
        """Adoption: once everything runs, a restart, whatever order agents come back in,
        changes nothing: no engine is started, drained or stopped."""
        self.settle_and_check_liveness()
        f = self.fleet
        before = {(name, s.spec) for name, s in f.shards()}
        sent = len(f.commands)
        self.control_plane_restarts(data)
        f.advance(SETTINGS.settle_after_start_s + SETTINGS.lost_after_s)
        assert f.commands[sent:] == []
        assert {(name, s.spec) for name, s in f.shards()} == before

    # -- liveness ----------------------------------------------------------------------------

    def teardown(self) -> None:
        self.settle_and_check_liveness()

    def settle_and_check_liveness(self) -> None:
        """Events stop: agents reconnect and engines load; within bounded time
        every desired replica runs, or no node or domain could take one more."""
        f = self.fleet
        for name, agent in f.agents.items():
            if not agent.connected:
                f.register(name)
        quiet = 0
        for _ in range(100):
            count = len(f.commands)
            f.ready_all()
            f.advance(10)
            view = f.cp.view()
            settled = (
                len(f.commands) == count
                and all(s.state is ShardState.READY for _, s in f.shards())
                and all(r.phase is Phase.LIVE and (r.kept or r.moving) for r in view.replicas)
                # A shard a registration left out is awaited for lost_after_s first.
                and not any(s.unconfirmed for r in view.replicas for s in r.shards)
                and all(u.waiting is None for u in view.unplaced.values())
            )
            quiet = quiet + 1 if settled else 0
            if quiet == 3:
                break
        else:
            raise AssertionError(f"no quiescence: {f.cp.view()}")
        view = f.cp.view()
        assert all(n.status is R for n in view.nodes)
        assert {m.name for m in view.models} <= self.present
        for name in set(MODELS) - self.present:  # a removed model: drained and stopped
            assert not f.replicas(name) and not any(r.model == name for r in view.replicas)
            assert name not in f.cp.serving() and f.cp.explain(name) is None
        nodes = f.cp.lifecycle.nodes
        for m in view.models:
            ids = {r.replica_id for r in view.replicas if r.model == m.name}
            # A drain not forced never takes a model offline: at rest, a replica stays on a
            # draining node only while its drain is not forced and nothing else could take it.
            held = [r for r in view.replicas if r.model == m.name and r.moving]
            for r in held:
                assert not any(nodes[s.node].drain_forced for s in r.shards), r
                assert not fits_one_more(f, self.catalog().get(m.name)), r
            assert len(ids) == m.kept + len(held) == len(f.replicas(m.name))
            assert all(r.serving for r in view.replicas if r.model == m.name)
            if m.kept < m.desired:
                assert not fits_one_more(f, self.catalog().get(m.name)), m.name


def fits_one_more(f: Fleet, entry: ModelEntry | None) -> bool:
    """A brute-force check, independent of placement: could one more replica go anywhere?"""
    assert entry is not None and entry.profile is not None
    p = entry.profile
    flags = {n.name: (n.cordoned or n.draining) for n in f.cp.view().nodes}
    free: dict[str, list[int]] = {}
    for name, agent in f.agents.items():
        if flags.get(name, True):
            continue
        used = set(agent.live_gpus())
        free[name] = [
            g.index
            for g in agent.inventory.gpus
            if g.index not in used
            and g.memory_free_mib >= p.gpu_memory_gib * 1024
            and (p.gpu_model is None or p.gpu_model.lower() in g.name.lower())
        ]
    if any(len(gpus) >= p.gpus for gpus in free.values()):
        return True
    if p.pipeline_parallel == 1:
        return False
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for name, gpus in free.items():
        inventory = POOL[name]
        domain = inventory.fabric.get("ib_domain")
        if domain is not None and len(gpus) >= p.tensor_parallel:
            groups[(domain, inventory.gpus[0].name)] += 1
    return any(n >= p.pipeline_parallel for n in groups.values())


ControlMachine.TestCase.settings = settings(
    max_examples=profile_times(2), stateful_step_count=50, deadline=None
)
TestControlMachine = ControlMachine.TestCase


def test_the_pool_mixes_gpu_models() -> None:
    assert POOL["n1"].gpus[0].name == H100 and POOL["n6"].gpus[0].name == A100
