"""The reconcile pass: for each model whose replicas may be judged differently, keep
the best `replicas` of them, restart, retire and place; it returns the commands.

It reads what is known and has Known record only what it sends (`Known.sent`), the
records of stopped shards it drops (`Known.settle`), and the failures and the router's
reported drains it has seen through. Its own state (`status`, the model records,
`holding`, what awaits its nodes) it alone writes.
What it decides per model is one `ModelRecord`, kept until the model is judged
again, so that a pass costs O(replicas of the models it judges), plus placement
(see `placing`); the rules are in docs/control-plane.md, "How the control core decides".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import attrs

from llmgw_core.catalog import Catalog, Endpoint, ModelEntry, parse_endpoint
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import LaunchSpec, ShardState
from llmgw_server.control.commands import Command, StartShard
from llmgw_server.control.known import Known
from llmgw_server.control.launch import launch_specs
from llmgw_server.control.lifecycle import Node
from llmgw_server.control.persisted import StoredReplica
from llmgw_server.control.placement import Assignment
from llmgw_server.control.placing import Shortfall
from llmgw_server.control.replicas import (
    PROFILE_CHANGED,
    Replica,
    Status,
    hold,
    keep_order,
    on_draining_node,
    restart,
    retire,
    serves,
    stop,
    unwanted,
)
from llmgw_server.control.shards import Classified, Phase, ShardRecord, classify
from llmgw_server.control.timers import Deadlines

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@attrs.frozen
class Decided:
    commands: tuple[Command, ...]
    placements: tuple[Assignment, ...]  # `key` is the new replica's id
    notes: tuple[str, ...]


@attrs.define
class ModelRecord:
    """What the last judgement of one model decided, kept until it is judged again.

    A record with nothing to keep (all defaults) is dropped, so the records are those
    of models with replicas, a shortfall or a roll."""

    kept: int = 0  # replicas counted toward the model
    serving: tuple[Endpoint, ...] = ()  # where its requests go (the same tuple if unchanged)
    missing: int = 0  # replicas to place
    rolling: int = 0  # its serving stale replicas (a roll to a changed profile)
    # Replacements of serving stale replicas not asked of placement yet: one is placed
    # at a time.
    roll_held: int = 0
    roll_said: bool = False  # the roll's wait for room was logged (once per wait)


_EMPTY = ModelRecord()


@attrs.define
class _Judged:
    """One model's replicas, judged before placement."""

    moving: list[Replica] = attrs.Factory(list)
    ready: int = 0  # kept replicas that serve
    kept: int = 0
    commands: list[Command] = attrs.Factory(list)  # broken ones stopped, failed ones restarted
    notes: list[str] = attrs.Factory(list)
    retiring: list[tuple[str, list[ShardRecord], str]] = attrs.Factory(list)
    times: list[float] = attrs.Factory(list)  # when to judge it again, at the latest


class Decider:
    def __init__(
        self,
        settings: ControlSection,
        known: Known,
        *,
        started_at: float,
        instance: str,
        engine_keys: Callable[[], str],
    ) -> None:
        self.settings = settings
        self.known = known
        self.grace_until = started_at + settings.lost_after_s
        self.shortfall = Shortfall(settings, started_at, known.work)
        self.status: dict[str, Status] = {}  # replica id -> how the last pass judged it
        # Awaited replicas that left `awaited` since the reconciler last took them (the
        # store a leader keeps no longer counts them as waiting).
        self.touched: set[str] = set()
        self.models: dict[str, ModelRecord] = {}
        # The models with replicas to place (`missing` > 0): an index of `models`, kept
        # by `_set_missing` alone, so that placement looks at them without a pass over all.
        self._missing: dict[str, int] = {}
        self._instance = instance
        self._engine_keys = engine_keys
        self._seq = 0
        # Replicas given up as broken in this run of the control plane (not kept across a
        # restart: then a returning replica and its replacement are alike, and one is retired).
        self.abandoned: set[str] = set()
        # When each model asked to be judged again (backoff, drain timeout, an awaited
        # rank): a heap by model, beside the records.
        self._due = Deadlines[str]()
        self._settle_due: float | None = None
        # Autoscaled models whose autoscaler has not started (control.scaling) -> the most
        # running replicas kept beyond their count: a restarted control plane keeps what
        # runs until it has measured the load.
        self.holding: dict[str, int] = {}
        # Restored from a store (control.persisted): replicas it says run, none of whose
        # nodes has registered yet. Each counts toward its model (unless retiring) until
        # one of its nodes registers (its agent then says what runs) or `grace_until`,
        # when it is placed again, as a replica whose node is lost.
        self.awaited: dict[str, StoredReplica] = {}
        self._awaited_on: dict[str, set[str]] = {}  # node -> awaited replica ids
        self._awaited_of: dict[str, set[str]] = {}  # model -> awaited replica ids
        # The nodes the store names that have not registered: the settle time ends once
        # none is left. None: no store spoke.
        self._unheard: set[str] | None = None

    def await_replicas(self, replicas: Mapping[str, StoredReplica], now: float) -> list[str]:
        """What a store says runs, before any node registered; returns notes. O(replicas)."""
        self.awaited = dict(replicas)
        self._unheard = set()
        for rid, stored in replicas.items():
            self._awaited_of.setdefault(stored.model, set()).add(rid)
            for node in stored.nodes:
                self._awaited_on.setdefault(node, set()).add(rid)
                self._unheard.add(node)
        if not self._unheard:
            if self.shortfall.end_settle(now):
                return ["the store names no replica: missing replicas are placed at once"]
            return []
        n, m = len(self._unheard), len(replicas)
        return [
            f"the store names {m} replica(s) on {n} node(s): placement waits for those nodes "
            f"to register, for settle_after_start_s ({self.settings.settle_after_start_s:g} "
            f"s) at most, and their replicas are replaced only after lost_after_s "
            f"({self.settings.lost_after_s:g} s)"
        ]

    def registered(self, node: str, now: float) -> tuple[set[str], list[str]]:
        """A node registered: the awaited replicas with a rank on it are its agents' to
        report from now on. Returns the models to judge again and notes. O(those)."""
        models = set()
        for rid in self._awaited_on.pop(node, ()):
            stored = self.awaited.pop(rid, None)
            if stored is None:
                continue
            self.touched.add(rid)
            models.add(stored.model)
            of = self._awaited_of[stored.model]
            of.discard(rid)
            if not of:
                del self._awaited_of[stored.model]
            for other in stored.nodes:
                self._awaited_on.get(other, set()).discard(rid)
        notes = []
        unheard = self._unheard
        if unheard is not None and node in unheard:
            unheard.discard(node)
            if not unheard:
                self._unheard = None
                if self.shortfall.end_settle(now):
                    models |= set(self._missing)
                    notes.append(
                        "every node the store names has registered: missing replicas are "
                        "placed from now on, without the rest of the settle time"
                    )
        return models, notes

    def _awaited_count(self, model: str, now: float) -> int:
        if now >= self.grace_until:
            return 0
        return sum(not self.awaited[rid].retiring for rid in self._awaited_of.get(model, ()))

    def next_due(self) -> float | None:
        awaited = self.grace_until if self.awaited else None
        times = (self._due.next(), self._settle_due, awaited)
        return min((t for t in times if t is not None), default=None)

    def due(self, now: float) -> set[str]:
        """The models whose time to be judged again has come."""
        out = set(self._due.pop_due(now))
        if self.awaited and now >= self.grace_until:
            # Their nodes never registered: replaced as a lost node's replicas are.
            out |= set(self._awaited_of)
            self.touched.update(self.awaited)
            self.awaited, self._awaited_on, self._awaited_of = {}, {}, {}
        if self._settle_due is not None and now >= self._settle_due:
            self._settle_due = None
            out |= set(self._missing)
        return out

    def forget(self, replicas: Iterable[str]) -> None:
        """Replicas with no record left: judged no more (their models are judged anew)."""
        for rid in replicas:
            self.status.pop(rid, None)

    def take_touched(self) -> frozenset[str]:
        """The awaited replicas touched since the last call, forgotten here."""
        touched = frozenset(self.touched)
        self.touched.clear()
        return touched

    def grew(self, nodes: Iterable[str]) -> None:
        """Nodes that may hold more than before: placement looks at them again."""
        self.shortfall.grown.update(nodes)

    def hold(self, holding: dict[str, int]) -> None:
        """Autoscaled models whose autoscaler has not started -> the most running
        replicas to keep meanwhile (control.scaling)."""
        self.holding = holding

    def reconcile(self, catalog: Catalog, models: Iterable[str], now: float) -> Decided:
        """Judge `models` (and place where any model lacks replicas). O(their replicas),
        plus placement."""
        # An autoscaled model whose autoscaler has not started (`holding`) may be at 0
        # replicas (min 0) and still keep what runs until its first cycle.
        wanted = {m.name: m for m in catalog.profiled if m.replicas > 0 or m.name in self.holding}
        order = {name: i for i, name in enumerate(wanted)}
        todo = sorted(set(models), key=lambda m: (order.get(m, len(order)), m))
        judged = {name: self._judge(name, wanted.get(name), catalog, now) for name in todo}
        commands = [c for j in judged.values() for c in j.commands]
        notes = [n for j in judged.values() for n in j.notes]
        placed, settle = self.shortfall.place(
            self._missing, wanted, now, self.known.capacities, self.known.lifecycle.domain_mates
        )
        self._settle_due = settle
        starts: list[Command] = []
        placements = []
        for a in placed:
            record = self._record(a.model)
            self._set_missing(a.model, record, record.missing - 1)
            rid, specs = self._launch(a, wanted[a.model], now)
            starts += specs
            placements.append(attrs.evolve(a, key=rid))
        for name in sorted({a.model for a in placed} - set(judged)):
            # Not judged before placing (nothing of it changed): its new replicas count.
            judged[name] = self._judge(name, wanted.get(name), catalog, now)
        notes += self._roll_notes(judged)
        retiring = [r for j in judged.values() for r in j.retiring]
        for name, j in judged.items():
            entry = wanted.get(name)
            placed_n = sum(a.model == name for a in placements)
            count, waiting = self.shortfall.short.get(name, (0, None))
            deferred = count if waiting is not None else 0  # placed once the settle time ends
            underway = j.kept - j.ready + placed_n + deferred
            # Moving replicas serve until as many replacements serve; on a forced drain,
            # only while replacements are on their way.
            budget = (entry.replicas if entry else 0) - j.ready
            held, rest = hold(j.moving, budget, underway, self._order, self.status, self._nodes)
            for rid in held:
                self.status[rid].moving = True
            retiring += rest
        times = {name: j.times for name, j in judged.items()}
        for rid, records, why in retiring:
            name = records[0].spec.model_name
            sent, deadline = retire(
                rid,
                records,
                drained=rid in self.known.drained,
                now=now,
                drain_timeout_s=self.settings.drain_timeout_s,
                nodes=self._nodes,
            )
            self._issue(sent, now)
            commands += sent
            if deadline is not None:
                times.setdefault(name, []).append(deadline)
            if sent and why:
                verbs = sorted({type(c).__name__.removesuffix("Shard").lower() for c in sent})
                notes.append(f"retiring replica {rid} of {name} ({why}): " + " and ".join(verbs))
        for name in judged:
            self._serve(name)
            self._due.set(name, min((t for t in times[name] if t > now), default=None))
            if self.models.get(name) == _EMPTY:
                del self.models[name]
        return Decided(tuple(commands + starts), tuple(placements), tuple(notes))

    # -- one model ----------------------------------------------------------------

    def _judge(self, name: str, entry: ModelEntry | None, catalog: Catalog, now: float) -> _Judged:
        known, nodes = self.known, self._nodes
        out = _Judged()
        candidates: list[Replica] = []
        stale: list[Replica] = []
        for rid in known.store.of_model(name):
            known.work.replicas += 1
            records = self._settled(rid, now, out.notes)
            if not records:
                continue
            c = classify(records, nodes, grace_until=self.grace_until, now=now)
            self.status[rid] = Status(c)
            if c.wait_until is not None:
                out.times.append(c.wait_until)
            out.times += [r.unconfirmed_until for r in records if r.unconfirmed_until is not None]
            if c.phase is Phase.BROKEN:
                # Once given up (a node lost, a rank gone), a replica stays given up: if its
                # node comes back, the replacement is kept and this one retired.
                self.abandoned.add(rid)
                sent = stop(records, nodes)
                if sent:
                    self._issue(sent, now)
                    out.commands += sent
                    out.notes.append(
                        f"replica {rid} of {name} is broken ({c.reason}): "
                        "stopping what is left of it"
                    )
                continue
            why = unwanted(c, entry, catalog, records, nodes)
            if why is None:
                candidates.append((rid, records))
            elif why == PROFILE_CHANGED and serves(self.status[rid], records):
                stale.append((rid, records))  # serves until its replacement does
            else:
                out.retiring.append((rid, records, why))
        desired = entry.replicas if entry is not None else 0
        moving = [c for c in candidates if on_draining_node(c[1], nodes)]
        staying = sorted(
            (c for c in candidates if not on_draining_node(c[1], nodes)), key=self._order
        )
        keeping = max(desired, min(len(staying), self.holding.get(name, 0)))
        keep, surplus = staying[:keeping], staying[keeping:]
        out.retiring += [(rid, records, "surplus") for rid, records in surplus]
        # What the store says runs on nodes not registered yet counts, up to the count.
        awaited = min(self._awaited_count(name, now), max(desired - len(keep), 0))
        record = self._record(name)
        record.kept = len(keep) + awaited
        ready = sum(serves(self.status[rid], records) for rid, records in keep)
        # A roll replaces serving stale replicas one at a time: a replacement is placed
        # only while no kept replica of the model is starting; replicas beyond the stale
        # ones (a scale-up with the change) are placed at once.
        missing = max(desired - len(keep) - awaited, 0)
        rolling = min(len(stale), max(missing, 0))
        placed_now = 1 if rolling and len(keep) == ready else 0
        self._set_missing(name, record, missing - rolling + placed_now)
        record.rolling = len(stale)
        record.roll_held = rolling - placed_now
        for rid, records in keep:
            self.status[rid].kept = True
            known.kept(rid)
            if self.status[rid].classified.phase is Phase.FAILED:
                sent, due, said = self._restart(rid, records, now)
                out.commands += sent
                out.notes += said
                if due is not None:
                    out.times.append(due)
            elif rid in known.failures and serves(self.status[rid], records):
                known.served_again(rid)
        out.moving, out.kept, out.ready = moving + stale, len(keep), ready
        return out

    def _roll_notes(self, judged: Iterable[str]) -> list[str]:
        """Once per wait: a roll whose next replacement fits nowhere while the old
        replicas hold their GPUs waits for room; they keep serving."""
        notes = []
        for name in judged:
            record = self.models.get(name, _EMPTY)
            short = self.shortfall.short.get(name)
            if record.rolling and short is not None and short[1] is None:
                if not record.roll_said:
                    record.roll_said = True
                    notes.append(
                        f"the roll of {name} to its changed profile waits for room: its "
                        f"{record.rolling} replicas with the old profile keep serving"
                    )
            elif record.roll_said:
                record.roll_said = False
        return notes

    def _settled(self, rid: str, now: float, notes: list[str]) -> list[ShardRecord]:
        """A replica's records, settled (`Known.settle`); one with none left is judged
        no more."""
        settled = self.known.settle(rid, now)
        notes += settled.notes
        self.shortfall.grown |= settled.freed
        if not settled.records:
            self.status.pop(rid, None)
        return settled.records

    def _restart(
        self, rid: str, records: list[ShardRecord], now: float
    ) -> tuple[list[Command], float | None, list[str]]:
        failed = next(r for r in records if r.state is ShardState.FAILED)
        failure = self.known.failures.get(rid)
        notes = []
        if failure is None or failure.attempt != failed.spec.attempt:
            notes = self.known.failed(failed, now)
            failure = self.known.failures[rid]
        spec = failed.spec
        width = len(spec.ports)
        port = lambda: self.known.free_port(  # noqa: E731
            spec.nodes, after=spec.port + width, ignore=rid, width=width
        )
        sent, due = restart(records, failure, now, self._nodes, port)
        self._issue(sent, now)
        if any(isinstance(c, StartShard) for c in sent):
            notes.append(
                f"restarting replica {rid} of {spec.model_name} (failure {failure.count} in a row)"
            )
        return sent, due, notes

    def _serve(self, name: str) -> None:
        """Where its requests go: kept or moving replicas whose every shard is ready."""
        endpoints = []
        for rid in self.known.store.of_model(name):
            status = self.status.get(rid)
            records = self.known.store.replica(rid)
            if status is not None and (status.kept or status.moving) and serves(status, records):
                endpoints.append(endpoint(min(records, key=lambda r: r.spec.rank).spec))
        record = self.models.get(name)
        if record is None:
            if endpoints:
                self._record(name).serving = tuple(endpoints)
        elif tuple(endpoints) != record.serving:  # unchanged, the same tuple
            record.serving = tuple(endpoints)

    # -- placing ------------------------------------------------------------------

    def _launch(self, a: Assignment, entry: ModelEntry, now: float) -> tuple[str, list[Command]]:
        profile = entry.profile
        assert profile is not None
        self._seq += 1
        rid = f"{_UNSAFE.sub('_', a.model)}-{self._instance}-{self._seq}"
        nodes = [s.node for s in a.shards]
        port = self.known.free_port(nodes, width=4 if profile.kv_events else 2)
        head = self._nodes[nodes[0]].inventory.host
        key = self._engine_keys()
        starts: list[Command] = [
            StartShard(spec.node, spec)
            for spec in launch_specs(rid, profile, a, head, port, api_key=key)
        ]
        self._issue(starts, now)
        self.status[rid] = Status(Classified(Phase.LIVE), kept=True)
        self._record(a.model).kept += 1
        return rid, starts

    @property
    def missing(self) -> Mapping[str, int]:
        """Model -> replicas to place, as last judged."""
        return self._missing

    def serving(self, model: str) -> tuple[Endpoint, ...]:
        """Where `model`'s requests go, as last judged."""
        return self.models.get(model, _EMPTY).serving

    def kept(self) -> dict[str, int]:
        """Model -> replicas counted toward it. O(models)."""
        return {name: record.kept for name, record in self.models.items()}

    def short(self) -> dict[str, tuple[int, str | None]]:
        """Model -> replicas wanted but not placed, and why placement waits (None when
        nothing fits): the placement's shortfall plus the replacements a roll holds back
        while one of them starts."""
        # The last attempt's shortfall, as far as the model still lacks it: judged again
        # after placing, a model whose new replica starts holds the rest of its roll back.
        short = {}
        for name, (count, waiting) in self.shortfall.short.items():
            count = min(count, self._missing.get(name, 0))
            if count:
                short[name] = (count, waiting)
        for name, record in self.models.items():
            held = record.roll_held
            if not held:
                continue
            count, waiting = short.get(name, (0, None))
            if name not in short:
                waiting = (
                    "its changed profile rolls one replica at a time: the next replacement "
                    "is placed once the one starting serves"
                )
            short[name] = (count + held, waiting)
        return short

    # -- helpers ------------------------------------------------------------------

    def _record(self, model: str) -> ModelRecord:
        record = self.models.get(model)
        if record is None:
            record = self.models[model] = ModelRecord()
        return record

    def _set_missing(self, model: str, record: ModelRecord, missing: int) -> None:
        """The one place `missing` changes: its index follows."""
        record.missing = max(missing, 0)
        if record.missing:
            self._missing[model] = record.missing
        else:
            self._missing.pop(model, None)

    @property
    def _nodes(self) -> dict[str, Node]:
        return self.known.lifecycle.nodes

    def _order(self, replica: Replica) -> tuple[bool, bool, int, str]:
        return keep_order(replica, self.status[replica[0]], self.abandoned, self._nodes)

    def _issue(self, commands: Iterable[Command], now: float) -> None:
        self.known.sent(commands, now)


def endpoint(spec: LaunchSpec) -> Endpoint:
    found = attrs.evolve(parse_endpoint(spec.url), api_key=spec.api_key)
    if not spec.kv_events:
        return found
    host = f"[{found.host}]" if ":" in found.host else found.host
    events, replay = spec.ports[2:]
    return attrs.evolve(
        found, kv_events=f"tcp://{host}:{events}", kv_replay=f"tcp://{host}:{replay}"
    )
