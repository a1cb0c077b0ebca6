"""The control machine's random histories, with failovers to a new leader restored from
the old one's store (issue 35) in place of plain restarts, and an autoscaled model.

A failover: leader A's state is snapshot (control.persisted) and it dies; some nodes die
with it; a new reconciler B, another instance, is restored from the snapshot; every
still-alive node registers with B, one by one, time passing between them. Throughout:
B places no replica twice (nothing for a replica still running on a node that has not
registered yet), places nothing during the settle time while a stored node has not
registered, and ends the settle time as soon as every stored node has; B keeps A's
cordons and drains (and tells an agent that missed one) and A's autoscaler counts and
windows. Between failovers, every rule and invariant of the control machine holds.
"""

from __future__ import annotations

import json
from collections import Counter

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_control_machine import MODELS, SETTINGS, ControlMachine

from hypothesis_profiles import profile_times
from llmgw_core.autoscaling import Autoscale
from llmgw_core.catalog import Catalog
from llmgw_server.control.autoscale import ModelLoad
from llmgw_server.control.commands import DrainShard, StartShard, StopShard
from llmgw_server.control.persisted import Keeper, replica_key, snapshot, window_step
from llmgw_server.control.reconciler import Reconciler, Step

AUTO = "one"  # the control machine's single-GPU model, autoscaled here
AUTOSCALE = Autoscale(
    min=0, max=3, target_in_flight=1.0, scale_down_after_s=30.0, idle_to_zero_s=60.0
)
WALL = 1_780_000_000.0  # wall clock minus the machine's clock


class FailoverMachine(ControlMachine):
    def __init__(self) -> None:
        super().__init__()
        self.failovers = 0
        # The leader's copy of its store, written step by step (Keeper.step): after every
        # rule it is the full snapshot.
        self.keeper = Keeper({})
        self.keeper.everything(self.fleet.cp, WALL)
        feed = self.fleet.feed

        def kept_feed(step: Step) -> Step:
            self.keeper.step(self.fleet.cp, step.touched, WALL)
            return feed(step)

        self.fleet.feed = kept_feed  # type: ignore[method-assign]

    @invariant()
    def the_store_is_written_step_by_step(self) -> None:
        assert self.keeper.stored == snapshot(self.fleet.cp, WALL)

    def catalog(self) -> Catalog:
        cat = super().catalog()
        models = tuple(
            attrs.evolve(m, autoscale=AUTOSCALE, replicas=AUTOSCALE.min) if m.name == AUTO else m
            for m in cat.models
        )
        return attrs.evolve(cat, models=models)

    def desired(self, name: str) -> int:
        if name != AUTO or name not in self.present:
            return super().desired(name)
        # Until its autoscaler starts (a reload re-added it), what runs is kept up to max.
        return self.fleet.cp.scaling.counts().get(name, AUTOSCALE.max)

    @initialize()
    def the_autoscaler_starts(self) -> None:
        f = self.fleet
        f.feed(f.cp.autoscale({}, f.now))

    @rule(name=st.sampled_from(sorted(MODELS)))
    def add_or_remove_model(self, name: str) -> None:
        """As in the control machine; an autoscaled model added back starts its autoscaler
        at once (until then it keeps what runs up to max, beyond the count views show)."""
        super().add_or_remove_model(name)
        self.the_autoscaler_starts()

    # -- the autoscaled model ----------------------------------------------------------

    @rule(in_flight=st.integers(0, 4))
    def routers_report_load(self, in_flight: int) -> None:
        f = self.fleet
        load = ModelLoad(in_flight=in_flight, last_request_at=f.now if in_flight else None)
        f.feed(f.cp.autoscale({AUTO: load}, f.now))

    @rule(held=st.integers(1, 3))
    def a_request_is_held(self, held: int) -> None:
        f = self.fleet
        f.feed(f.cp.wake(AUTO, f.now, held))

    # -- failovers (in place of the control machine's plain restarts) ------------------

    def control_plane_restarts(self, data: st.DataObject) -> None:  # no longer a rule
        self.leader_fails_over(data)

    def a_settled_fleet_survives_a_control_plane_restart(self, data: st.DataObject) -> None:
        pass  # no longer a rule: a_settled_fleet_survives_a_failover checks more

    @rule(data=st.data())
    def leader_fails_over(self, data: st.DataObject) -> None:
        names = sorted(self.fleet.agents)
        dead = data.draw(st.sets(st.sampled_from(names)) if names else st.just(set[str]()))
        self.fail_over(data, dead)

    @rule(data=st.data())
    def a_settled_fleet_survives_a_failover(self, data: st.DataObject) -> None:
        """Once everything runs, a failover changes nothing: no engine is started,
        drained or stopped, at once or later, and the autoscaler's count holds."""
        self.settle_and_check_liveness()
        f = self.fleet
        before = {(name, s.spec) for name, s in f.shards()}
        counts = f.cp.scaling.counts()
        sent = len(f.commands)
        self.fail_over(data, set())
        f.advance(SETTINGS.settle_after_start_s + SETTINGS.lost_after_s)
        assert f.commands[sent:] == []
        assert {(name, s.spec) for name, s in f.shards()} == before
        assert f.cp.scaling.counts() == counts

    def fail_over(self, data: st.DataObject, dead: set[str]) -> None:
        f = self.fleet
        a = f.cp
        stored = snapshot(a, WALL)
        flags = {
            n.name: (n.cordoned, n.draining, n.draining and n.drain_forced)
            for n in a.lifecycle.nodes.values()
        }
        counts = a.scaling.counts()
        scalers = {name: (s.changed_at, s.window()) for name, s in a.scaling.autoscalers.items()}
        for name in sorted(dead):
            f.silence(name)
        # Every other agent registers with the new leader, those whose stream broke before
        # included: they all dial again.
        alive = [n for n in f.agents if n not in dead]
        order = data.draw(st.permutations(alive))
        gaps = data.draw(st.lists(st.sampled_from([0.0, 1.0, 4.0]), min_size=len(order)))
        # A's kept replicas (while they still run on a node that lives on), with each
        # rank's node as the store names it.
        kept = {
            (r.model, r.replica_id): tuple(
                rank["node"] for rank in json.loads(stored[replica_key(r.replica_id)])["ranks"]
            )
            for r in a.view().replicas
            if r.kept
        }
        stored_nodes = {
            node
            for key, value in stored.items()
            if key.startswith("replicas/")
            for node in (r["node"] for r in json.loads(value)["ranks"])
        }
        self.failovers += 1
        instance = f"f{self.failovers}"
        start, sent = f.now, len(f.commands)
        f.cp = b = Reconciler(f.settings, f.catalog, now=f.now, instance=instance)
        f.guard_held, f.guarded, f.released = False, set(), {}
        self.keeper = Keeper(stored)
        f.feed(b.restore(stored, f.now, WALL))
        self.keeper.everything(b, WALL)
        assert b.scaling.counts() == counts
        for name, (changed_at, window) in scalers.items():
            scaler = b.scaling.autoscalers[name]
            assert abs(scaler.changed_at - changed_at) < 1e-6
            holds_as_long(window, scaler.window(), window_step(scaler.spec.scale_down_after_s))
        unheard = set(stored_nodes)
        for name, gap in zip(order, gaps, strict=False):
            if gap:
                f.advance(gap)
                self.nothing_placed_twice_nor_early(instance, sent, kept, dead, unheard, start)
            f.register(name)
            unheard.discard(name)
            self.nothing_placed_twice_nor_early(instance, sent, kept, dead, unheard, start)
            node = b.lifecycle.nodes[name]
            if name in flags:  # the store's flags, and the agent is told
                assert (node.cordoned, node.draining, node.draining and node.drain_forced) == (
                    flags[name]
                )
            agent = f.agents[name]
            assert (agent.cordoned, agent.draining) == (node.cordoned, node.draining)
            if not unheard:
                assert b.settle_until <= f.now  # what runs is known: placement goes on now
        assert b.scaling.counts() == counts

    def nothing_placed_twice_nor_early(
        self,
        instance: str,
        sent: int,
        kept: dict[tuple[str, str], tuple[str, ...]],
        dead: set[str],
        unheard: set[str],
        start: float,
    ) -> None:
        f = self.fleet
        runs = {
            (name, s.spec.replica_id, s.spec.rank)
            for name, agent in f.agents.items()
            if name not in dead
            for s in agent.shards.values()
        }
        running = {rid for _, rid, _ in runs}

        def rank_gone(rid: str, nodes: tuple[str, ...]) -> bool:
            """A rank whose node has registered with B without it: A kept the replica
            (its start went to a node whose stream had broken unseen, or the rank ended
            unheard), but it no longer runs whole. B gives it up as broken ("missing a
            rank", docs/control-plane.md) and places a new one once the settle time is
            over, as A would have at that registration: not a replica placed twice."""
            return any(
                node not in dead and node not in unheard and (node, rid, rank) not in runs
                for rank, node in enumerate(nodes)
            )

        still = Counter(
            model
            for (model, rid), nodes in kept.items()
            if rid in running and not rank_gone(rid, nodes)
        )
        starts = [
            c.spec
            for c in f.commands[sent:]
            if isinstance(c, StartShard)
            and f"-{instance}-" in c.spec.replica_id
            and c.spec.rank == 0
            and c.spec.attempt == 0
        ]
        placed = Counter(spec.model_name for spec in starts)
        # A replica B placed and has since stopped or drained itself counts no more: it
        # was checked here when placed, beside what still ran then (this runs after every
        # registration and every gap). B retires its new replica as surplus when an agent
        # reports one the store does not name (the store behind what runs, judged like any
        # other: docs/high-availability.md), say a pipeline replica A forgot when its head
        # exited while the node of its other rank was silent; when that one proves broken
        # (its head's node registers without it), B places again: one more start, never
        # more replicas at once than desired.
        retired = {c.replica_id for c in f.commands[sent:] if isinstance(c, StopShard | DrainShard)}
        standing = Counter(s.model_name for s in starts if s.replica_id not in retired)
        for model, n in standing.items():
            entry = f.cp.catalog.get(model)
            desired = entry.replicas if entry is not None else 0
            assert still[model] + n <= desired, (model, still[model], n, desired)
        if unheard and f.now < start + SETTINGS.settle_after_start_s:
            assert not placed, (placed, unheard)


def holds_as_long(old: list[tuple[float, int]], new: list[tuple[float, int]], step: float) -> None:
    """The restored down window holds replicas as long as the old one did, and at most
    `step` longer (its times are stored rounded up): whatever a cut-off time, the most
    any reading after it needed is the same, or the same `step` later."""
    cutoffs = [t for t, _ in old] + [t for t, _ in new] + [t + step for t, _ in old]

    def most(readings: list[tuple[float, int]], since: float) -> int:
        return max((n for t, n in readings if t >= since - 1e-6), default=-1)

    for cut in cutoffs:
        assert most(new, cut) >= most(old, cut), (old, new, cut)
        assert most(new, cut + step) <= most(old, cut), (old, new, cut)


FailoverMachine.TestCase.settings = settings(
    max_examples=profile_times(1), stateful_step_count=40, deadline=None
)
TestFailoverMachine = FailoverMachine.TestCase
