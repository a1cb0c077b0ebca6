"""The reconciler: desired replicas from the catalog, actual shards from agents.

Events go in as method calls that carry the current time; each returns a Step:
the commands to deliver, the placements made, node transitions and lines to
log. Nothing here does I/O or reads a clock.

This is the front: events update what is known (`known.Known`) and say which
models they touched; the reconcile pass (`decide.Decider`) judges only those and
returns commands. The rules it follows (which replicas are kept, drains, rolls,
restarts, placement) and the tests that check each are written down in
docs/control-plane.md, "How the control core decides".
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Mapping, Sequence

import attrs

from llmgw_core.catalog import Catalog, Endpoint
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import Inventory, ShardReport, ShardState
from llmgw_server.control.autoscale import ModelLoad
from llmgw_server.control.commands import Command, DrainShard
from llmgw_server.control.decide import Decider, endpoint
from llmgw_server.control.drains import DrainRefused, Stuck, drain_notes, replicas_on, stuck
from llmgw_server.control.known import Change, Known
from llmgw_server.control.persisted import StoredReplica, Touched, read
from llmgw_server.control.placement import Assignment, Explanation, explain
from llmgw_server.control.scaling import Change as ScaleChange
from llmgw_server.control.scaling import Scaling
from llmgw_server.control.step import DrainHead, Routes, Step
from llmgw_server.control.views import ControlView, control_view
from llmgw_server.control.work import Work

__all__ = [
    "DrainHead",
    "DrainRefused",
    "Reconciler",
    "Routes",
    "Step",
    "Stuck",
    "random_engine_key",
]


_NOTHING = Touched()


def random_engine_key() -> str:
    return secrets.token_urlsafe(24)


class Reconciler:
    def __init__(
        self,
        settings: ControlSection,
        catalog: Catalog,
        *,
        now: float,
        instance: str,
        engine_keys: Callable[[], str] = random_engine_key,
    ) -> None:
        """`instance` goes into replica ids, so it must differ between control-plane
        starts (the shell passes a few random hex digits). `engine_keys` makes the key
        of each new replica's engines (tests pass a deterministic one)."""
        self.settings = settings
        # The catalog as written, and as the decider reads it: each autoscaled model's
        # replicas as its autoscaler decided (`scaling`).
        self.file_catalog = catalog
        self.scaling = Scaling()
        self.scaling.follow(catalog)
        self.catalog = catalog
        self.started_at = now
        self.work = Work()
        self.known = Known(settings, now, self.work)
        self.lifecycle = self.known.lifecycle
        self._decider = Decider(
            settings, self.known, started_at=now, instance=instance, engine_keys=engine_keys
        )
        self._now = now
        self._dirty: set[str] = set()  # models to judge at the next reconcile
        self._last_reconcile: float | None = None
        self._batch_at: float | None = None  # a burst of events is reconciled by then
        self._wake: float | None = None  # the last Step's wake_at, for steps that change nothing
        self._routes: Routes | None = None  # the last Step's routes: None, none carried yet
        self._catalog_changed = False  # since the last step: the routes' makings may differ
        self._forgotten: set[str] = set()  # replicas known no more since the last reconcile
        self._decider.hold(self.scaling.unstarted())
        # With no node and no shard yet this yields no command, only what is unplaced.
        self._decider.reconcile(catalog, [m.name for m in catalog.profiled], now)

    # -- events ------------------------------------------------------------

    def register(
        self,
        inventory: Inventory,
        shards: Sequence[ShardReport],
        now: float,
        *,
        cordoned: bool = False,
        draining: bool = False,
        heartbeat_interval_s: float | None = None,
    ) -> Step:
        """A node's agent (re)connected with its inventory, its shards and its flags, and
        was given `heartbeat_interval_s` (heartbeat_pace; None: the configured one)."""
        now = self._clock(now)
        change = self.known.register(
            inventory,
            shards,
            now,
            cordoned=cordoned,
            draining=draining,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        models, notes = self._decider.registered(inventory.name, now)
        if models or notes:
            change = attrs.evolve(
                change, models=change.models | models, notes=(*change.notes, *notes)
            )
        return self._step(now, change)

    def restore(self, stored: Mapping[str, bytes], now: float, wall_minus_monotonic: float) -> Step:
        """A new leader, before any agent registered, takes up what its store keeps
        (control.persisted): the replicas' placement (placement waits for exactly their
        nodes, and replaces a replica only once its nodes stayed away for lost_after_s),
        the operator's flags (they win over what agents report) and the autoscalers'
        counts and windows. A value that cannot be read is left out with a note."""
        if self.lifecycle.nodes or self.known.store.models():
            raise RuntimeError("restore a reconciler before any node registers")
        now = self._clock(now)
        restored = read(stored, now, wall_minus_monotonic)
        notes = list(restored.notes)
        models = {m.name for m in self.catalog.models}
        if restored.found:
            self.known.restore_flags(restored.nodes, restored.unreadable_nodes)
            notes += self._decider.await_replicas(restored.replicas, now)
            models |= {r.model for r in restored.replicas.values()}
            for name, m in sorted(restored.models.items()):
                if not self.scaling.resume(
                    name, m.desired, m.changed_at, m.idle_since, m.window, m.last_change
                ):
                    notes.append(f"stored autoscaler of {name} skipped: not autoscaled now")
            self._scaled()
        return self._step(now, Change(frozenset(models), notes=tuple(notes)))

    @property
    def settle_until(self) -> float:
        """Until then no new replica is placed: the settle time after the start, or less
        once every node a store named registered (`restore`)."""
        return self._decider.shortfall.settle_until

    def awaited_replicas(self) -> list[str]:
        """The replicas a store named whose nodes have not registered. O(those)."""
        return list(self._decider.awaited)

    @property
    def awaiting(self) -> bool:
        """Whether a replica a store named still waits for its nodes: until then what
        serves is not known whole. O(1)."""
        return bool(self._decider.awaited)

    def awaited_replica(self, replica_id: str) -> StoredReplica | None:
        return self._decider.awaited.get(replica_id)

    def heartbeat(self, node: str, now: float) -> Step:
        """O(1) when nothing changes: no reconcile unless the node comes back."""
        change = self.known.heartbeat(node, self._clock(now))
        return self._quiet() if change is None else self._step(self._now, change)

    def paced(self, node: str, heartbeat_interval_s: float) -> Step:
        """The node's agent was told a new heartbeat interval: O(log nodes), no reconcile."""
        self.known.pace(node, heartbeat_interval_s)
        return self._quiet()

    def disconnected(self, node: str, now: float) -> Step:
        now = self._clock(now)
        return self._step(now, self.known.disconnected(node, now))

    def shard_status(
        self, node: str, replica_id: str, rank: int, state: ShardState, now: float, detail: str = ""
    ) -> Step:
        now = self._clock(now)
        change = self.known.shard_status(node, replica_id, rank, state, now, detail)
        if change is None or not change.models:
            if replica_id not in self.known.store:  # a shard no record names: nothing kept of it
                self._forgotten.add(replica_id)
            return self._quiet(change.notes if change else ())
        return self._step(now, change)

    def replica_drained(self, replica_id: str, now: float) -> Step:
        """The router has no request in flight on a draining replica: stop it now."""
        now = self._clock(now)
        return self._step(now, self.known.replica_drained(replica_id))

    def set_catalog(self, catalog: Catalog, now: float) -> Step:
        """O(models and replicas): every model is judged again."""
        now = self._clock(now)
        self.file_catalog = catalog
        self.scaling.follow(catalog)
        self._scaled()
        # A model gone from the catalog is judged too, with replicas or without: its
        # replicas retire, and what it lacked is placed no more.
        models = {m.name for m in catalog.models} | set(self.known.store.models())
        models |= set(self._decider.models)
        return self._step(now, Change(frozenset(models)))

    def autoscale(self, loads: Mapping[str, ModelLoad], now: float) -> Step:
        """One autoscaling cycle on the routers' merged loads (control.scaling): each
        autoscaled model whose count changes is judged again."""
        now = self._clock(now)
        changes = self.scaling.decide(loads, self._decider.kept(), now)
        return self._rescaled(changes, now)

    def wake(self, model: str, now: float, held: int = 1) -> Step:
        """Routers hold `held` requests for `model`, scaled to zero: replicas now."""
        now = self._clock(now)
        change = self.scaling.wake(model, now, held)
        return self._rescaled([change] if change else [], now)

    def _rescaled(self, changes: Sequence[ScaleChange], now: float) -> Step:
        self._scaled()
        notes = tuple(
            f"scaling {c.model} from {c.before} to {c.after} replicas: {c.decision.detail}"
            for c in changes
        )
        return self._step(now, Change(frozenset(c.model for c in changes), notes=notes))

    def _scaled(self) -> None:
        """The decider's catalog: the file's, with the autoscalers' counts."""
        counts = self.scaling.counts()
        models = tuple(
            attrs.evolve(m, replicas=counts[m.name]) if m.name in counts else m
            for m in self.file_catalog.models
        )
        self.catalog = attrs.evolve(self.file_catalog, models=models)
        self._catalog_changed = True
        self._decider.hold(self.scaling.unstarted())

    def cordon(self, node: str, on: bool, now: float) -> Step:
        """No new placements on the node (raises KeyError for an unknown node)."""
        now = self._clock(now)
        return self._step(now, self.known.mark(node, cordoned=on, now=now))

    def request_drain(self, node: str, now: float, *, force: bool = False) -> Step:
        """An operator's drain: refused with DrainRefused when a replica on the node fits
        nowhere else, unless `force` (raises KeyError for an unknown node). Asked again
        with `force`, a drain under way becomes forced."""
        found = self.drain_check(node)
        if found and not force:
            raise DrainRefused(node, found)
        return self._drain(node, now, force=force, stuck=found)

    def drain_node(self, node: str, on: bool, now: float, *, force: bool = False) -> Step:
        """Move every replica off the node, each one retired once its replacement serves
        (raises KeyError for an unknown node). Unless `force`, a replica that fits nowhere
        else serves on there; `request_drain` refuses such a drain first."""
        if not on:
            now = self._clock(now)
            return self._step(
                now, self.known.mark(node, draining=False, drain_forced=False, now=now)
            )
        return self._drain(node, now, force=force, stuck=self.drain_check(node))

    def _drain(self, node: str, now: float, *, force: bool, stuck: Sequence[Stuck]) -> Step:
        """Drain `node`; `stuck` is `drain_check(node)`, made once by the caller."""
        now = self._clock(now)
        known = self.lifecycle.nodes[node]
        notes = drain_notes(
            node,
            replicas_on(node, self.known.store, self._decider.status) if not known.draining else {},
            stuck,
            force=force,
            draining=known.draining,
            forced=known.drain_forced,
        )
        forced = known.drain_forced or force
        change = self.known.mark(node, draining=True, drain_forced=forced, now=now)
        return self._step(now, attrs.evolve(change, notes=tuple(notes)))

    def drain_check(self, node: str) -> list[Stuck]:
        """The replicas on `node` that could not be placed elsewhere, were it draining
        (none for a node already draining: its replacements are placed already). O(nodes)."""
        if self.lifecycle.nodes[node].draining:
            return []
        capacities = self.known.capacities(None)
        return stuck(
            node,
            replicas_on(node, self.known.store, self._decider.status),
            capacities,
            self.catalog,
            self.settings,
        )

    def forget_node(self, node: str, now: float) -> Step:
        """Drop a lost node and its shards, such as a decommissioned machine."""
        now = self._clock(now)
        return self._step(now, self.known.forget(node))

    def tick(self, now: float) -> Step:
        return self._step(self._clock(now), Change())

    # -- reading -------------------------------------------------------------

    def view(self, nodes: Collection[str] | None = None) -> ControlView:
        """O(nodes, shards and the unplaced models' explanations); with `nodes`, just
        those and the replicas on them."""
        d = self._decider
        return control_view(
            self.known,
            d.status,
            d.kept(),
            d.short(),
            self.catalog,
            self.explain,
            nodes,
            self.scaling.view,
        )

    def node_names(self) -> list[str]:
        """Every node's name, in no order. O(nodes)."""
        return list(self.known.lifecycle.nodes)

    def serving(self) -> dict[str, tuple[Endpoint, ...]]:
        """Where the router should send each model's requests, with each engine's key.
        O(models): kept as each model is judged."""
        serving = self._decider.serving
        return {m.name: serving(m.name) for m in self.catalog.profiled}

    def knows_replica(self, replica_id: str) -> bool:
        """Whether any shard of the replica is recorded. O(1)."""
        return replica_id in self.known.store

    def endpoint(self, replica_id: str) -> tuple[str, Endpoint] | None:
        """A replica's model and the endpoint of its head, carrying the engine key."""
        spec = self.known.store.head(replica_id)
        return None if spec is None else (spec.model_name, endpoint(spec))

    def explain(self, model: str) -> Explanation | None:
        """Why one more replica of `model` could or could not be placed now. O(nodes)."""
        entry = self.catalog.get(model)
        if entry is None or entry.profile is None:
            return None
        capacities = self.known.capacities(None)
        return explain(model, entry.profile, capacities, fabric_key=self.settings.fabric_key)

    # -- the step ----------------------------------------------------------------

    def _clock(self, now: float) -> float:
        # A clock that steps back must not undo a timeout that already fired.
        self._now = max(self._now, now)
        return self._now

    def _quiet(self, notes: tuple[str, ...] = ()) -> Step:
        """A step that changes nothing the shell acts on but what it logs."""
        return Step(notes=notes, wake_at=self._wake, guard=self.lifecycle.guard)

    def _step(self, now: float, change: Change) -> Step:
        """Time passes, then whatever changed is reconciled (batched within
        `reconcile_interval_s`). O(what changed and the nodes whose deadline came)."""
        notes = [*self._decider.shortfall.settle_notes(now), *change.notes]
        guard = self.lifecycle.guard
        timed = self.known.advance(now)
        transitions = [*change.transitions, *timed.transitions]
        if self.lifecycle.guard != guard:
            notes.append(
                f"mass-loss guard holds: {self.lifecycle.guard}"
                if self.lifecycle.guard
                else "mass-loss guard released: unreachable nodes may be declared lost again"
            )
        notes += [f"node {t.node}: {t.old} -> {t.new} ({t.reason})" for t in transitions if t.old]
        commands: list[Command] = list(self.known.marks_due())
        decider = self._decider
        decider.forget(change.gone)
        self._dirty |= change.models | timed.models
        decider.grew(change.grown | timed.grown)
        due = decider.due(now)
        self._dirty |= due
        placements: tuple[Assignment, ...] = ()
        ran = False
        if self._dirty or (decider.shortfall.grown and decider.missing):
            last, interval = self._last_reconcile, self.settings.reconcile_interval_s
            batch_due = self._batch_at is not None and now >= self._batch_at
            if due or batch_due or last is None or now - last >= interval:
                decided = decider.reconcile(self.catalog, self._dirty, now)
                self._dirty, self._batch_at, self._last_reconcile = set(), None, now
                commands += decided.commands
                placements, ran = decided.placements, True
                notes += decided.notes
            else:
                # Batch a burst of events (a registration storm) into one reconcile.
                soon = last + interval
                self._batch_at = soon if self._batch_at is None else min(self._batch_at, soon)
        times = (self._batch_at, decider.next_due(), self.lifecycle.next_deadline())
        self._wake = min((t for t in times if t is not None), default=None)
        self._note_forgotten()
        forgotten = frozenset(self._forgotten) if ran else frozenset()
        if ran:
            self._forgotten.clear()
        return Step(
            tuple(commands),
            placements,
            tuple(transitions),
            tuple(notes),
            self._wake,
            ran,
            tuple(m for m in change.failed if self.catalog.get(m) is not None),
            self._touched(),
            self.lifecycle.guard,
            self._changed_routes(ran),
            self._drain_heads(commands),
            forgotten,
        )

    def _changed_routes(self, ran: bool) -> Routes | None:
        """The routes, when they may have changed and did. O(models) then, else O(1)."""
        last, awaiting = self._routes, bool(self._decider.awaited)
        if not (ran or self._catalog_changed or last is None or last.awaiting != awaiting):
            return None
        self._catalog_changed = False
        catalog = self.catalog
        specs = self.scaling.specs
        autoscaled = {m.name: m.replicas for m in catalog.models if m.name in specs}
        routes = Routes(self.serving(), dict(catalog.adapters), autoscaled, awaiting)
        if routes == last:
            return None
        self._routes = routes
        return routes

    def _drain_heads(self, commands: Sequence[Command]) -> tuple[DrainHead, ...]:
        """The head of each replica whose rank 0 `commands` drain. O(those)."""
        heads = []
        for c in commands:
            if isinstance(c, DrainShard) and c.rank == 0:
                found = self.endpoint(c.replica_id)
                if found is not None:
                    heads.append(DrainHead(c.replica_id, *found))
        return tuple(heads)

    def _note_forgotten(self) -> None:
        """The replicas whose records changed since the last step, known now or no more.
        O(those), before `_touched` takes them."""
        store, forgotten = self.known.store, self._forgotten
        for rid in store.touched:
            if rid in store:
                forgotten.discard(rid)
            else:
                forgotten.add(rid)

    def _touched(self) -> Touched:
        """What changed of what is stored since the last step; O(that)."""
        known, decider, scaling = self.known, self._decider, self.scaling
        if not (known.store.touched or known.touched_nodes or decider.touched or scaling.touched):
            return _NOTHING
        replicas, nodes = known.take_touched()
        touched = Touched(replicas | decider.take_touched(), nodes, frozenset(scaling.touched))
        scaling.touched.clear()
        return touched
