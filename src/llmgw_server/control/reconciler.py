"""The reconciler: desired replicas from the catalog, actual shards from agents.

Events go in as method calls that carry the current time; each returns a Step:
the commands to deliver, the placements made, node transitions and lines to
log. Nothing here does I/O or reads a clock.

The control plane keeps nothing that agents and the catalog cannot give back:
shard records come from agents' reports (the launch spec travels with every
shard), node flags from the agents that keep them, and what is lost on a
restart (restart backoff, drain timers) only restarts a timer.

Decisions, per model with a profile:
- Replicas that are live or failed, run the current profile and sit on no
  draining node are candidates; the best `replicas` of them are kept (all
  nodes reachable, then ready before starting before pending before failed).
  A replica on an unreachable node is kept: it probably still serves.
- A drain makes before it breaks: a serving replica on a draining node moves,
  that is, it keeps serving while a replacement is placed elsewhere, and is
  retired only once enough replacements serve. A drain that was not forced
  never takes a model offline: a replica stays as long as no replacement serves,
  even when none can be placed (room may be gone since `request_drain` checked:
  the replacement's node lost, say), and the model's explanation says why. Only
  a forced drain retires a replica with no replacement on the way. Whether a
  drain was forced is not kept across a restart (agents keep only `draining`):
  it goes on unforced, which errs on the side that keeps models serving.
- Every other replica is retired: drained if it was serving, then stopped when
  the router reports it drained or `drain_timeout_s` passes.
- A replica on a lost node, or missing a rank, is broken: its other shards are
  stopped and it no longer counts, so a new one is placed.
- A kept failed replica is restarted whole, on the same GPUs, after a capped
  exponential backoff; its other shards are stopped first.
- Missing replicas are placed, except during `settle_after_start_s` after the
  start, while agents of a restarted control plane re-register. Each new
  replica gets an engine key from the injected key source, on every shard; a
  restarted control plane learns it back from the shards agents report.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Sequence

import attrs

from llmgw_core.catalog import Catalog, Endpoint, ModelEntry, parse_endpoint
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_server.control.commands import Command, DrainShard, MarkNode, StartShard, StopShard
from llmgw_server.control.launch import free_port, launch_specs
from llmgw_server.control.lifecycle import Lifecycle, NodeStatus, NodeTransition
from llmgw_server.control.placement import (
    Assignment,
    Explanation,
    NodeCapacity,
    PlacementRequest,
    explain,
    place,
)
from llmgw_server.control.shards import (
    Classified,
    Failure,
    Phase,
    ShardKey,
    ShardRecord,
    backoff,
    classify,
    matches,
)
from llmgw_server.control.views import ControlView, ModelView, NodeView, Unplaced, replica_view

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_LIVE_ORDER = {ShardState.READY: 0, ShardState.STARTING: 1, ShardState.PENDING: 2}


@attrs.frozen
class Step:
    commands: tuple[Command, ...] = ()
    placements: tuple[Assignment, ...] = ()  # new replicas; `key` is the replica id
    transitions: tuple[NodeTransition, ...] = ()
    notes: tuple[str, ...] = ()  # for the log: guard changes, failures, adoption
    # Call `tick` by then at the latest, even if no event comes.
    wake_at: float | None = None
    # A reconcile ran: which replicas serve may have changed even without a command.
    reconciled: bool = False


@attrs.define
class _Status:
    classified: Classified
    kept: bool = False
    moving: bool = False  # on a draining node, serving until a replacement serves


@attrs.frozen
class Stuck:
    """A replica on a node to drain that fits nowhere else."""

    replica_id: str
    model: str
    explanation: Explanation


class DrainRefused(Exception):
    """Draining the node would leave replicas nowhere to go (their models could go offline)."""

    def __init__(self, node: str, stuck: Sequence[Stuck]) -> None:
        self.node = node
        self.stuck = tuple(stuck)
        by_model: dict[str, list[Stuck]] = {}
        for s in self.stuck:
            by_model.setdefault(s.model, []).append(s)
        reasons = "; ".join(
            f"replica {group[0].replica_id} of {model} fits nowhere else: "
            f"{group[0].explanation.text}"
            if len(group) == 1
            else f"replicas {', '.join(s.replica_id for s in group)} of {model} fit nowhere "
            f"else: {group[-1].explanation.text}"
            for model, group in by_model.items()
        )
        super().__init__(f"draining {node} would take replicas offline: {reasons}")


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
        self.catalog = catalog
        self.started_at = now
        self.lifecycle = Lifecycle(settings, now)
        self._instance = instance
        self._engine_keys = engine_keys
        self._seq = 0
        self._now = now
        self._shards: dict[ShardKey, ShardRecord] = {}
        self._failures: dict[str, Failure] = {}
        self._drained: set[str] = set()
        # Replicas given up as broken in this run of the control plane (not kept across a
        # restart: then a returning replica and its replacement are alike, and one is retired).
        self._abandoned: set[str] = set()
        self._unmarked: set[str] = set()  # nodes whose agent has yet to hear of their flags
        self._status: dict[str, _Status] = {}
        self._short: dict[str, tuple[int, str | None]] = {}  # model -> unplaced, why waiting
        self._explained: dict[str, Explanation] = {}  # computed when read, until the next reconcile
        # What placement last fell short on, and the fleet it fell short on.
        self._failed_attempt: (
            tuple[dict[str, int], list[NodeCapacity], dict[str, tuple[int, str | None]]] | None
        ) = None
        self._kept: dict[str, int] = {}
        self._dirty = False
        self._last_reconcile: float | None = None
        self._timer: float | None = None  # when a decision falls due (backoff, drain, grace)
        self._wake: float | None = None  # the last Step's wake_at, for steps that change nothing
        # The settle time's start and end go to the log once each: "start", "end", "said".
        self._settle_said = "start" if settings.settle_after_start_s > 0 else "said"
        # With no node and no shard yet this yields no command, only what is unplaced.
        self._reconcile(now, [], [])

    # -- events ------------------------------------------------------------

    def register(
        self,
        inventory: Inventory,
        shards: Sequence[ShardReport],
        now: float,
        *,
        cordoned: bool = False,
        draining: bool = False,
    ) -> Step:
        """A node's agent (re)connected with its inventory, its shards and its flags."""
        now = self._clock(now)
        name = inventory.name
        known = name in self.lifecycle.nodes
        transitions = self.lifecycle.register(inventory, now)
        node = self.lifecycle.nodes[name]
        commands: list[Command] = []
        if not known:
            node.cordoned, node.draining = cordoned, draining
        elif (node.cordoned, node.draining) != (cordoned, draining):
            self._unmarked.add(name)  # this control plane's operator spoke last: tell the agent
        seen = {key[1] for key in self._shards}
        notes: list[str] = []
        for key in [k for k in self._shards if k[0] == name]:
            del self._shards[key]
        for report in shards:
            spec = report.spec
            record = ShardRecord(name, spec, report.state, report.detail)
            if report.state is ShardState.READY:
                record.ready_since = now
            elif report.state is ShardState.DRAINING:
                record.drain_at = now
            self._shards[record.key] = record
            if spec.replica_id not in seen:
                notes.append(
                    f"node {name} reports replica {spec.replica_id} of {spec.model_name} "
                    f"(rank {spec.rank}, {report.state})"
                )
            if report.state is ShardState.FAILED:
                notes += self._failed(record, now)
        self._dirty = True
        return self._step(now, transitions, commands, notes)

    def heartbeat(self, node: str, now: float) -> Step:
        """Cheap when nothing changes: no reconcile unless the node comes back."""
        now = self._clock(now)
        transitions = self.lifecycle.heartbeat(node, now)
        if not transitions:
            return Step(wake_at=self._wake)
        self._dirty = True
        return self._step(now, transitions)

    def disconnected(self, node: str, now: float) -> Step:
        now = self._clock(now)
        transitions = self.lifecycle.disconnected(node, now)
        self._dirty = self._dirty or bool(transitions)
        return self._step(now, transitions)

    def shard_status(
        self, node: str, replica_id: str, rank: int, state: ShardState, now: float, detail: str = ""
    ) -> Step:
        now = self._clock(now)
        record = self._shards.get((node, replica_id, rank))
        if record is None:
            # Not started by this control plane and not reported at registration:
            # the agent's next registration brings it with its spec.
            note = f"node {node} reports unknown shard {replica_id} rank {rank} ({state})"
            return Step(notes=(note,), wake_at=self._wake)
        if record.state is state and record.detail == detail:
            return Step(wake_at=self._wake)
        record.state, record.detail = state, detail
        notes: list[str] = []
        if state is ShardState.READY:
            record.ready_since = record.ready_since if record.ready_since is not None else now
        elif state is ShardState.DRAINING:
            record.drain_at = record.drain_at if record.drain_at is not None else now
        elif state is ShardState.FAILED:
            notes += self._failed(record, now)
        self._dirty = True
        return self._step(now, notes=notes)

    def replica_drained(self, replica_id: str, now: float) -> Step:
        """The router has no request in flight on a draining replica: stop it now."""
        now = self._clock(now)
        self._drained.add(replica_id)
        self._dirty = True
        return self._step(now)

    def set_catalog(self, catalog: Catalog, now: float) -> Step:
        now = self._clock(now)
        self.catalog = catalog
        self._dirty = True
        return self._step(now)

    def cordon(self, node: str, on: bool, now: float) -> Step:
        """No new placements on the node (raises KeyError for an unknown node)."""
        return self._mark(node, now, cordoned=on)

    def request_drain(self, node: str, now: float, *, force: bool = False) -> Step:
        """An operator's drain: refused with DrainRefused when a replica on the node fits
        nowhere else, unless `force` (raises KeyError for an unknown node). Asked again
        with `force`, a drain under way becomes forced."""
        stuck = self.drain_check(node)
        if stuck and not force:
            raise DrainRefused(node, stuck)
        return self._drain(node, now, force=force, stuck=stuck)

    def drain_node(self, node: str, on: bool, now: float, *, force: bool = False) -> Step:
        """Move every replica off the node, each one retired once its replacement serves
        (raises KeyError for an unknown node). Unless `force`, a replica that fits nowhere
        else serves on there; `request_drain` refuses such a drain first."""
        if not on:
            return self._mark(node, now, draining=False, drain_forced=False)
        return self._drain(node, now, force=force, stuck=self.drain_check(node))

    def _drain(self, node: str, now: float, *, force: bool, stuck: Sequence[Stuck]) -> Step:
        """Drain `node`; `stuck` is `drain_check(node)`, made once by the caller."""
        known = self.lifecycle.nodes[node]
        notes = []
        if not known.draining:
            moving = self._replicas_on(node)
            if moving:
                notes.append(
                    f"draining {node}: {len(moving)} replicas move before they stop "
                    f"({', '.join(moving)})"
                )
            leaves = (
                "stops without a replacement"
                if force
                else "serves on there until a replacement can be placed"
            )
            for s in stuck:
                notes.append(
                    f"draining {node}: replica {s.replica_id} of {s.model} fits nowhere else "
                    f"and {leaves} ({s.explanation.text})"
                )
        elif force and not known.drain_forced:
            notes.append(
                f"draining {node} is forced now: a replica that fits nowhere else stops "
                "without a replacement"
            )
        step = self._mark(node, now, draining=True, drain_forced=known.drain_forced or force)
        return attrs.evolve(step, notes=(*notes, *step.notes))

    def drain_check(self, node: str) -> list[Stuck]:
        """The replicas on `node` that could not be placed elsewhere, were it draining
        (none for a node already draining: its replacements are placed already)."""
        if self.lifecycle.nodes[node].draining:
            return []
        capacities = [
            attrs.evolve(c, draining=True) if c.name == node else c for c in self._capacities()
        ]
        requests = []
        for rid, model in self._replicas_on(node).items():
            entry = self.catalog.get(model)
            if entry is not None and entry.profile is not None:
                requests.append(PlacementRequest(rid, model, entry.profile))
        result = place(
            requests, capacities, fabric_key=self.settings.fabric_key, spread=self.settings.spread
        )
        return [
            Stuck(r.key, r.model, result.explanations[r.model])
            for r in sorted(result.unplaced, key=lambda r: r.key)
        ]

    def forget_node(self, node: str, now: float) -> Step:
        """Drop a lost node and its shards, such as a decommissioned machine."""
        now = self._clock(now)
        if self.lifecycle.nodes[node].status is not NodeStatus.LOST:
            raise ValueError(f"node {node} is not lost; only a lost node can be forgotten")
        del self.lifecycle.nodes[node]
        for key in [k for k in self._shards if k[0] == node]:
            del self._shards[key]
        self._dirty = True
        return self._step(now)

    def tick(self, now: float) -> Step:
        return self._step(self._clock(now))

    # -- reading -------------------------------------------------------------

    def view(self) -> ControlView:
        used = self._used_gpus()
        nodes = tuple(
            NodeView(
                n.name,
                n.status,
                n.cordoned,
                n.draining,
                n.draining and n.drain_forced,
                n.last_seen,
                n.inventory,
                tuple(sorted(used.get(n.name, ()))),
            )
            for n in self.lifecycle.nodes.values()
        )
        replicas = []
        for rid, records in self._by_replica().items():
            status = self._status.get(rid) or _Status(Classified(Phase.LIVE))
            view = replica_view(
                records,
                status.classified,
                kept=status.kept,
                moving=status.moving,
                failure=self._failures.get(rid),
                crash_loop_after=self.settings.crash_loop_after,
            )
            replicas.append(view)
        models = tuple(
            ModelView(m.name, m.replicas, self._kept.get(m.name, 0)) for m in self.catalog.profiled
        )
        unplaced = {
            name: Unplaced(name, count, self._explanation(name), waiting)
            for name, (count, waiting) in self._short.items()
        }
        return ControlView(nodes, tuple(replicas), models, unplaced, self.lifecycle.guard)

    def serving(self) -> dict[str, tuple[Endpoint, ...]]:
        """Where the router should send each model's requests, with each engine's key."""
        out: dict[str, list[Endpoint]] = {m.name: [] for m in self.catalog.profiled}
        heads = self._heads()
        for replica in self.view().replicas:
            if replica.serving and replica.model in out:
                out[replica.model].append(_endpoint(heads[replica.replica_id]))
        return {model: tuple(endpoints) for model, endpoints in out.items()}

    def endpoint(self, replica_id: str) -> tuple[str, Endpoint] | None:
        """A replica's model and the endpoint of its head, carrying the engine key."""
        spec = self._heads().get(replica_id)
        return None if spec is None else (spec.model_name, _endpoint(spec))

    def explain(self, model: str) -> Explanation | None:
        """Why one more replica of `model` could or could not be placed now."""
        entry = self.catalog.get(model)
        if entry is None or entry.profile is None:
            return None
        return explain(
            model, entry.profile, self._capacities(), fabric_key=self.settings.fabric_key
        )

    # -- the reconcile loop ----------------------------------------------------

    def _clock(self, now: float) -> float:
        # A clock that steps back must not undo a timeout that already fired.
        self._now = max(self._now, now)
        return self._now

    def _mark(
        self,
        name: str,
        now: float,
        *,
        cordoned: bool | None = None,
        draining: bool | None = None,
        drain_forced: bool | None = None,
    ) -> Step:
        now = self._clock(now)
        node = self.lifecycle.nodes[name]
        node.cordoned = node.cordoned if cordoned is None else cordoned
        node.draining = node.draining if draining is None else draining
        node.drain_forced = node.drain_forced if drain_forced is None else drain_forced
        # Unreachable, the node hears of it when it comes back: it keeps the flags
        # for the next control plane.
        self._unmarked.add(name)
        self._dirty = True
        return self._step(now)

    def _step(
        self,
        now: float,
        transitions: Iterable[NodeTransition] = (),
        commands: Iterable[Command] = (),
        notes: Iterable[str] = (),
    ) -> Step:
        transitions, commands, notes = list(transitions), list(commands), list(notes)
        notes[:0] = self._settle_notes(now)
        guard = self.lifecycle.guard
        transitions += self.lifecycle.advance(now)
        if self.lifecycle.guard != guard:
            notes.append(
                f"mass-loss guard holds: {self.lifecycle.guard}"
                if self.lifecycle.guard
                else "mass-loss guard released: unreachable nodes may be declared lost again"
            )
        for t in transitions:
            if t.old is not None:
                notes.append(f"node {t.node}: {t.old} -> {t.new} ({t.reason})")
        for name in sorted(self._unmarked):
            node = self.lifecycle.nodes.get(name)
            if node is None:
                self._unmarked.discard(name)
            elif node.status is NodeStatus.REACHABLE:
                self._unmarked.discard(name)
                commands.append(MarkNode(name, node.cordoned, node.draining))
        if transitions:
            self._dirty = True
        placements: list[Assignment] = []
        due = self._timer is not None and now >= self._timer
        ran = False
        if self._dirty or due:
            last = self._last_reconcile
            if due or last is None or now - last >= self.settings.reconcile_interval_s:
                self._dirty = False
                self._last_reconcile = now
                placements = self._reconcile(now, commands, notes)
                ran = True
            else:
                # Batch a burst of events (a registration storm) into one reconcile.
                soon = last + self.settings.reconcile_interval_s
                self._timer = soon if self._timer is None else min(self._timer, soon)
        deadline = self.lifecycle.next_deadline()
        self._wake = min((t for t in (self._timer, deadline) if t is not None), default=None)
        return Step(
            tuple(commands), tuple(placements), tuple(transitions), tuple(notes), self._wake, ran
        )

    def _settle_notes(self, now: float) -> list[str]:
        """One line when the first step sees the settle time, one when it has passed."""
        settle_s = self.settings.settle_after_start_s
        settle_until = self.started_at + settle_s
        if self._settle_said == "start" and now < settle_until:
            self._settle_said = "end"
            return [
                f"no new replica is placed for {settle_until - now:g} s after the start "
                f"(settle_after_start_s = {settle_s:g}), so that re-registering agents get "
                "their engines adopted"
            ]
        if self._settle_said != "said" and now >= settle_until:
            self._settle_said = "said"
            return [f"settle time of {settle_s:g} s over: missing replicas are placed from now on"]
        return []

    def _reconcile(self, now: float, commands: list[Command], notes: list[str]) -> list[Assignment]:
        times: list[float] = []
        wanted = {m.name: m for m in self.catalog.profiled if m.replicas > 0}
        nodes = self.lifecycle.nodes
        grace_until = self.started_at + self.settings.lost_after_s
        self._status = {}
        candidates: dict[str, list[tuple[str, list[ShardRecord]]]] = {m: [] for m in wanted}
        retire: list[tuple[str, list[ShardRecord], str]] = []
        for rid, records in self._by_replica().items():
            if not any(r.state is ShardState.FAILED for r in records):
                for r in [r for r in records if r.state is ShardState.STOPPED]:
                    del self._shards[r.key]
                records = [r for r in records if r.state is not ShardState.STOPPED]
                if not records:
                    self._failures.pop(rid, None)
                    self._drained.discard(rid)
                    continue
            c = classify(records, nodes, grace_until=grace_until, now=now)
            self._status[rid] = _Status(c)
            if c.wait_until is not None:
                times.append(c.wait_until)
            spec = records[0].spec
            if c.phase is Phase.BROKEN:
                # Once given up (a node lost, a rank gone), a replica stays given up: if its
                # node comes back, the replacement is kept and this one retired.
                self._abandoned.add(rid)
                if self._stop(records, commands):
                    notes.append(
                        f"replica {rid} of {spec.model_name} is broken ({c.reason}): "
                        "stopping what is left of it"
                    )
                continue
            why = self._unwanted(c, wanted.get(spec.model_name), records)
            if why is None:
                candidates[spec.model_name].append((rid, records))
            else:
                retire.append((rid, records, why))
        self._kept = {}
        deficits: dict[str, int] = {}
        moves: dict[str, tuple[list[tuple[str, list[ShardRecord]]], int, int]] = {}
        for name, cands in candidates.items():
            moving = [c for c in cands if self._on_draining_node(c[1])]
            staying = [c for c in cands if not self._on_draining_node(c[1])]
            staying.sort(key=lambda c: self._keep_order(c[0], c[1]))
            keep, surplus = staying[: wanted[name].replicas], staying[wanted[name].replicas :]
            retire += [(rid, records, "surplus") for rid, records in surplus]
            self._kept[name] = len(keep)
            deficits[name] = wanted[name].replicas - len(keep)
            for rid, records in keep:
                self._status[rid].kept = True
                self._drained.discard(rid)  # a drain the router reported is over
                if self._status[rid].classified.phase is Phase.FAILED:
                    self._restart(rid, records, now, commands, notes, times)
            ready = sum(self._serves(rid, records) for rid, records in keep)
            moves[name] = (moving, ready, len(keep))
        starts: list[Command] = []
        placements = self._place(wanted, deficits, now, starts, times)
        for name, (moving, ready, kept) in moves.items():
            placed = sum(a.model == name for a in placements)
            count, waiting = self._short.get(name, (0, None))
            deferred = count if waiting is not None else 0  # placed once the settle time ends
            underway = kept - ready + placed + deferred
            # Moving replicas serve until as many replacements serve; on a forced drain,
            # only while replacements are on their way.
            retire += self._hold(moving, wanted[name].replicas - ready, underway)
        for rid, records, why in retire:
            sent = len(commands)
            self._retire(rid, records, now, commands, times)
            if len(commands) > sent and why:
                verbs = sorted(
                    {type(c).__name__.removesuffix("Shard").lower() for c in commands[sent:]}
                )
                notes.append(
                    f"retiring replica {rid} of {records[0].spec.model_name} ({why}): "
                    + " and ".join(verbs)
                )
        commands += starts
        self._timer = min((t for t in times if t > now), default=None)
        self._explained = {}
        return placements

    def _unwanted(
        self, c: Classified, model: ModelEntry | None, records: list[ShardRecord]
    ) -> str | None:
        """Why a replica is not a candidate to keep ("" when it is already retiring)."""
        if c.phase is Phase.RETIRING:
            return ""
        name = records[0].spec.model_name
        if model is None or model.profile is None:
            entry = self.catalog.get(name)
            if entry is not None and entry.profile is not None:
                return "its model is scaled to 0 replicas"
            return f"no model {name!r} with a profile in the catalog"
        if not matches(records, model.profile, self.lifecycle.nodes):
            return "its profile changed"
        return None

    def _on_draining_node(self, records: list[ShardRecord]) -> bool:
        return any(self.lifecycle.nodes[r.node].draining for r in records)

    def _serves(self, rid: str, records: list[ShardRecord]) -> bool:
        return self._status[rid].classified.phase is Phase.LIVE and all(
            r.state is ShardState.READY for r in records
        )

    def _hold(
        self, moving: list[tuple[str, list[ShardRecord]]], budget: int, underway: int
    ) -> list[tuple[str, list[ShardRecord], str]]:
        """Keep up to `budget` serving replicas of a model that sit on draining nodes (as
        many as replacements do not serve yet); the others are retired (returned with why).

        A replica on a node whose drain was not forced stays whatever is `underway`: that
        drain never takes a model offline. One on a forced drain stays only while one of
        the `underway` replacements is its own. The unforced come first: they stay anyway.
        """
        nodes = self.lifecycle.nodes
        retire = []

        def forced(records: list[ShardRecord]) -> bool:
            return any(nodes[r.node].draining and nodes[r.node].drain_forced for r in records)

        for rid, records in sorted(
            moving, key=lambda c: (forced(c[1]), *self._keep_order(c[0], c[1]))
        ):
            draining = sorted({r.node for r in records if nodes[r.node].draining})
            serves, is_forced = self._serves(rid, records), forced(records)
            if serves and budget > 0 and (underway > 0 or not is_forced):
                self._status[rid].moving = True
                budget -= 1
                if is_forced:
                    underway -= 1
                continue
            why = f"node {draining[0]} is draining"
            if serves and budget > 0:
                node = next(n for n in draining if nodes[n].drain_forced)
                why = f"the drain of node {node} is forced and it fits nowhere else"
            elif serves:
                why += " and its replacement serves"
            retire.append((rid, records, why))
        return retire

    def _keep_order(self, rid: str, records: list[ShardRecord]) -> tuple[bool, bool, int, str]:
        nodes = self.lifecycle.nodes
        unreachable = any(nodes[r.node].status is not NodeStatus.REACHABLE for r in records)
        if self._status[rid].classified.phase is Phase.FAILED:
            rank = len(_LIVE_ORDER)
        else:
            rank = max(_LIVE_ORDER.get(r.state, len(_LIVE_ORDER)) for r in records)
        return (rid in self._abandoned, unreachable, rank, rid)

    def _reachable(self, record: ShardRecord) -> bool:
        return self.lifecycle.nodes[record.node].status is NodeStatus.REACHABLE

    def _stop(self, records: Iterable[ShardRecord], commands: list[Command]) -> bool:
        sent = False
        for r in records:
            if not r.stop_sent and r.state is not ShardState.STOPPED and self._reachable(r):
                r.stop_sent = sent = True
                commands.append(StopShard(r.node, r.spec.replica_id, r.spec.rank))
        return sent

    def _retire(
        self,
        rid: str,
        records: list[ShardRecord],
        now: float,
        commands: list[Command],
        times: list[float],
    ) -> None:
        serving = any(
            r.drain_at is not None or r.state in (ShardState.READY, ShardState.DRAINING)
            for r in records
        )
        if serving and rid not in self._drained:
            for r in records:
                if (
                    r.drain_at is None
                    and r.state not in (ShardState.FAILED, ShardState.STOPPED)
                    and self._reachable(r)
                ):
                    r.drain_at = now
                    if r.state is not ShardState.DRAINING:
                        commands.append(DrainShard(r.node, rid, r.spec.rank))
            started = [r.drain_at for r in records if r.drain_at is not None]
            if not started:
                return  # every shard is on an unreachable node: wait for one
            deadline = min(started) + self.settings.drain_timeout_s
            if now < deadline:
                times.append(deadline)
                return
        self._stop(records, commands)

    def _restart(
        self,
        rid: str,
        records: list[ShardRecord],
        now: float,
        commands: list[Command],
        notes: list[str],
        times: list[float],
    ) -> None:
        failed = next(r for r in records if r.state is ShardState.FAILED)
        failure = self._failures.get(rid)
        if failure is None or failure.attempt != failed.spec.attempt:
            notes += self._failed(failed, now)
            failure = self._failures[rid]
        # The whole replica restarts: ranks that still run cannot rejoin a new head.
        self._stop([r for r in records if r.state is not ShardState.FAILED], commands)
        spec = failed.spec
        if any(r.state not in (ShardState.FAILED, ShardState.STOPPED) for r in records):
            return
        if len(records) < spec.nnodes or not all(self._reachable(r) for r in records):
            return  # a rank is awaited, or a node is unreachable: its change triggers a reconcile
        if now < failure.restart_at:
            times.append(failure.restart_at)
            return
        port = self._free_port(spec.nodes, after=spec.port + 2, ignore=rid)
        for r in sorted(records, key=lambda r: r.spec.rank):
            new = attrs.evolve(r.spec, attempt=failure.count, port=port, dist_port=port + 1)
            del self._shards[r.key]
            record = ShardRecord(r.node, new, ShardState.PENDING)
            self._shards[record.key] = record
            commands.append(StartShard(r.node, new))
        notes.append(
            f"restarting replica {rid} of {spec.model_name} (failure {failure.count} in a row)"
        )

    def _failed(self, record: ShardRecord, now: float) -> list[str]:
        """Note a failure once per failed start and schedule the restart."""
        spec = record.spec
        previous = self._failures.get(spec.replica_id)
        if previous is not None and previous.attempt == spec.attempt:
            return []
        s = self.settings
        served_long = (
            record.ready_since is not None and now - record.ready_since >= s.restart_backoff_max_s
        )
        count = 1 if served_long else spec.attempt + 1
        delay = backoff(count, s.restart_backoff_s, s.restart_backoff_max_s)
        self._failures[spec.replica_id] = Failure(
            spec.attempt, count, now, now + delay, record.detail
        )
        loop = " (crash loop)" if count >= s.crash_loop_after else ""
        return [
            f"replica {spec.replica_id} of {spec.model_name} failed on {record.node}{loop}: "
            f"{record.detail or 'no detail'}; restart in {delay:g} s"
        ]

    def _place(
        self,
        wanted: dict[str, ModelEntry],
        deficits: dict[str, int],
        now: float,
        commands: list[Command],
        times: list[float],
    ) -> list[Assignment]:
        missing = {name: n for name, n in deficits.items() if n > 0}
        settle_until = self.started_at + self.settings.settle_after_start_s
        if missing and now < settle_until:
            times.append(settle_until)
            waiting = (
                f"placement waits {settle_until - now:g} s more after the control plane's "
                "start, so that re-registering agents get their engines adopted"
            )
            self._short = {name: (n, waiting) for name, n in missing.items()}
            return []
        if not missing:
            self._short = {}
            return []
        capacities = self._capacities()
        if self._failed_attempt is not None and self._failed_attempt[:2] == (missing, capacities):
            self._short = self._failed_attempt[2]
            return []  # nothing that could help has changed since placement last fell short
        requests = []
        for name, n in missing.items():
            profile = wanted[name].profile
            assert profile is not None
            requests += [PlacementRequest(f"{name}#{i}", name, profile) for i in range(n)]
        result = place(
            requests,
            capacities,
            fabric_key=self.settings.fabric_key,
            spread=self.settings.spread,
            explain_unplaced=False,  # explanations are made when someone reads them
        )
        self._short = {}
        for request in result.unplaced:
            count, _ = self._short.get(request.model, (0, None))
            self._short[request.model] = (count + 1, None)
        self._failed_attempt = (
            (missing, capacities, self._short) if not result.assignments else None
        )
        placed = []
        for a in result.assignments:
            profile = wanted[a.model].profile
            assert profile is not None
            rid = self._new_replica_id(a.model)
            nodes = [s.node for s in a.shards]
            port = self._free_port(nodes)
            head = self.lifecycle.nodes[nodes[0]].inventory.host
            key = self._engine_keys()
            for spec in launch_specs(rid, profile, a, head, port, api_key=key):
                record = ShardRecord(spec.node, spec, ShardState.PENDING)
                self._shards[record.key] = record
                commands.append(StartShard(spec.node, spec))
            self._status[rid] = _Status(Classified(Phase.LIVE), kept=True)
            self._kept[a.model] = self._kept.get(a.model, 0) + 1
            placed.append(attrs.evolve(a, key=rid))
        return placed

    # -- helpers -----------------------------------------------------------------

    def _explanation(self, model: str) -> Explanation:
        why = self._explained.get(model)
        if why is None:
            why = self.explain(model)
            assert why is not None
            self._explained[model] = why
        return why

    def _replicas_on(self, node: str) -> dict[str, str]:
        """The replicas with a shard on `node` that count for their model: id -> model."""
        out = {}
        for rid, records in self._by_replica().items():
            status = self._status.get(rid)
            if any(r.node == node for r in records) and (
                status is None or status.kept or status.moving
            ):
                out[rid] = records[0].spec.model_name
        return out

    def _heads(self) -> dict[str, LaunchSpec]:
        """Each replica's lowest-ranked shard spec: every shard carries the replica's key
        and its head's address."""
        heads: dict[str, LaunchSpec] = {}
        for record in self._shards.values():
            spec = record.spec
            known = heads.get(spec.replica_id)
            if known is None or spec.rank < known.rank:
                heads[spec.replica_id] = spec
        return heads

    def _by_replica(self) -> dict[str, list[ShardRecord]]:
        out: dict[str, list[ShardRecord]] = {}
        for record in self._shards.values():
            out.setdefault(record.spec.replica_id, []).append(record)
        return out

    def _used_gpus(self) -> dict[str, set[int]]:
        used: dict[str, set[int]] = {}
        for record in self._shards.values():
            used.setdefault(record.node, set()).update(record.spec.gpu_indices)
        return used

    def _capacities(self) -> list[NodeCapacity]:
        used = self._used_gpus()
        return [
            NodeCapacity(
                n.inventory, n.status, n.cordoned, n.draining, frozenset(used.get(name, ()))
            )
            for name, n in self.lifecycle.nodes.items()
        ]

    def _free_port(
        self, nodes: Sequence[str], *, after: int | None = None, ignore: str = ""
    ) -> int:
        """A port pair free on every node of a replica (`ignore`: the replica itself).

        Ports belong to an address, not a node name: several simulated nodes on
        one machine share one port space.
        """
        known = self.lifecycle.nodes

        def host(name: str) -> str:
            node = known.get(name)
            return node.inventory.host if node is not None else name

        hosts = {host(n) for n in nodes}
        used = (
            port
            for r in self._shards.values()
            if r.spec.replica_id != ignore and host(r.node) in hosts
            for port in (r.spec.port, r.spec.dist_port)
        )
        s = self.settings
        return free_port(used, s.engine_port_min, s.engine_port_max, after=after)

    def _new_replica_id(self, model: str) -> str:
        self._seq += 1
        return f"{_UNSAFE.sub('_', model)}-{self._instance}-{self._seq}"


def _endpoint(spec: LaunchSpec) -> Endpoint:
    return attrs.evolve(parse_endpoint(spec.url), api_key=spec.api_key)
