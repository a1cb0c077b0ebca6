"""What the control plane knows: nodes (the lifecycle), shard records (the store),
failures, drains the router reported, and flags an agent has yet to hear of.

Events update it and say what they touched (`Change`): the models whose replicas
may now be judged differently, and the nodes that may now hold more. Each event
costs O(what it touches): the node and the replicas with a shard on it.

Its methods are the one writer of all it holds: the reconciler calls them for events
and time, the reconcile pass for what it sends and for the records it settles (its
placements read, within the same pass, the GPUs and ports they take).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import Inventory, ShardReport, ShardState
from llmgw_server.control.capacity import NodeCapacity
from llmgw_server.control.commands import Command, MarkNode
from llmgw_server.control.launch import free_port
from llmgw_server.control.lifecycle import Lifecycle, Node, NodeStatus, NodeTransition
from llmgw_server.control.persisted import OperatorFlags
from llmgw_server.control.shards import Failure, ShardKey, ShardRecord, backoff, unconfirmed
from llmgw_server.control.store import ShardStore
from llmgw_server.control.work import Work


@attrs.frozen
class Change:
    models: frozenset[str] = frozenset()  # to judge again
    grown: frozenset[str] = frozenset()  # nodes that may hold more than before
    transitions: tuple[NodeTransition, ...] = ()
    notes: tuple[str, ...] = ()
    gone: frozenset[str] = frozenset()  # replicas with no record left
    # The model of each shard newly reported failed, whichever way the report came (an
    # update, or a registration carrying a failure that happened while away).
    failed: tuple[str, ...] = ()


@attrs.frozen
class Settled:
    """A replica's records as the reconcile pass judges them (`Known.settle`)."""

    records: list[ShardRecord]
    notes: list[str]
    freed: set[str]  # nodes whose records went: they may hold more


class Known:
    def __init__(self, settings: ControlSection, now: float, work: Work) -> None:
        self.settings = settings
        self.work = work
        self.lifecycle = Lifecycle(settings, now, work)
        self.store = ShardStore(work)
        self.failures: dict[str, Failure] = {}
        # Replicas the router reported drained (the reconcile pass clears the report once
        # the replica is kept again or gone).
        self.drained: set[str] = set()
        self._unmarked: set[str] = set()  # nodes whose agent has yet to hear of their flags
        self.touched_nodes: set[str] = set()  # flags changed since the reconciler last looked
        # Restored from a store (control.persisted): the operator's flags of every node,
        # none for a node not named. They win over what an agent reports at its node's
        # first registration here: the leader wrote them before it sent them, so the
        # agent's may only be older (it missed the Mark). None: no store spoke; the
        # agents' flags are taken, as after a restart.
        self.stored_flags: dict[str, OperatorFlags] | None = None
        self.unreadable_flags: frozenset[str] = frozenset()  # their agents' word is taken

    def register(
        self,
        inventory: Inventory,
        shards: Sequence[ShardReport],
        now: float,
        *,
        cordoned: bool,
        draining: bool,
        heartbeat_interval_s: float | None = None,
    ) -> Change:
        """O(the node's shards and the replicas touching it)."""
        name = inventory.name
        known = name in self.lifecycle.nodes
        transitions = self.lifecycle.register(inventory, now, heartbeat_interval_s)
        node = self.lifecycle.nodes[name]
        if not known:
            flags = self._stored(name)
            if flags is None:
                node.cordoned, node.draining = cordoned, draining
                node.drain_since = now if draining else None
            else:
                node.cordoned, node.draining = flags.cordoned, flags.draining
                node.drain_forced, node.drain_since = flags.drain_forced, flags.drain_since
                if (flags.cordoned, flags.draining) != (cordoned, draining):
                    self._unmarked.add(name)  # the store's word: tell the agent
            self.touched_nodes.add(name)
        elif (node.cordoned, node.draining) != (cordoned, draining):
            self._unmarked.add(name)  # this control plane's operator spoke last: tell the agent
        before = self.store.touching(name)
        models = self.store.models_of(before)  # before records go
        known_failed = set[tuple[ShardKey, int]]()
        reported = {(name, s.spec.replica_id, s.spec.rank) for s in shards}
        notes: list[str] = []
        failed: list[str] = []
        for record in self.store.on_node(name):
            if record.state is ShardState.FAILED:
                known_failed.add((record.key, record.spec.attempt))
            if unconfirmed(record, record.key in reported):
                if record.unconfirmed_until is None:  # set once: not moved on by each one
                    record.unconfirmed_until = now + self.settings.lost_after_s
                    notes.append(
                        f"node {name} registered without replica {record.spec.replica_id} "
                        f"rank {record.spec.rank}, which was {record.state}: kept until it is "
                        f"reported again, or for lost_after_s ({self.settings.lost_after_s:g} "
                        "s); another machine under its name, or its agent's state lost?"
                    )
                continue
            self.store.remove(record.key)
        for report in shards:
            spec = report.spec
            record = ShardRecord(name, spec, report.state, report.detail)
            if report.state is ShardState.READY:
                record.ready_since = now
            elif report.state is ShardState.DRAINING:
                record.drain_at = now
            if spec.replica_id not in self.store and spec.replica_id not in before:
                notes.append(
                    f"node {name} reports replica {spec.replica_id} of {spec.model_name} "
                    f"(rank {spec.rank}, {report.state})"
                )
            self.store.add(record)
            if report.state is ShardState.FAILED:
                notes += self.failed(record, now)
                if (record.key, spec.attempt) not in known_failed:
                    failed.append(spec.model_name)
        models |= self.store.models_of(self.store.touching(name))
        gone = frozenset(rid for rid in before if rid not in self.store)
        return Change(
            frozenset(models),
            frozenset({name}),
            tuple(transitions),
            tuple(notes),
            gone,
            tuple(failed),
        )

    def pace(self, node: str, heartbeat_interval_s: float) -> None:
        self.lifecycle.pace(node, heartbeat_interval_s)

    def advance(self, now: float) -> Change:
        """Time passes: the nodes whose deadline came change status."""
        return self.transitioned(self.lifecycle.advance(now))

    def heartbeat(self, node: str, now: float) -> Change | None:
        """O(1) when nothing changes (then None)."""
        transitions = self.lifecycle.heartbeat(node, now)
        return self.transitioned(transitions) if transitions else None

    def disconnected(self, node: str, now: float) -> Change:
        return self.transitioned(self.lifecycle.disconnected(node, now))

    def transitioned(self, transitions: Iterable[NodeTransition]) -> Change:
        """The models judged anew and the nodes grown, for nodes that changed status."""
        transitions = tuple(transitions)
        touched = set[str]().union(*(self.store.touching(t.node) for t in transitions))
        grown = {t.node for t in transitions if t.new is NodeStatus.REACHABLE}
        return Change(frozenset(self.store.models_of(touched)), frozenset(grown), transitions)

    def shard_status(
        self, node: str, replica_id: str, rank: int, state: ShardState, now: float, detail: str
    ) -> Change | None:
        """O(1); None when it changes nothing, a Change with only a note for a shard this
        control plane does not know."""
        record = self.store.get((node, replica_id, rank))
        if record is None:
            # Not started by this control plane and not reported at registration:
            # the agent's next registration brings it with its spec.
            note = f"node {node} reports unknown shard {replica_id} rank {rank} ({state})"
            return Change(notes=(note,))
        confirmed = record.unconfirmed_until is not None
        record.unconfirmed_until = None  # its node reports it: not missing after all
        if record.state is state and record.detail == detail:
            return Change(frozenset({record.spec.model_name})) if confirmed else None
        newly_failed = state is ShardState.FAILED and record.state is not ShardState.FAILED
        self.store.touched.add(replica_id)  # a drain reported makes it retiring
        record.state, record.detail = state, detail
        notes: list[str] = []
        if state is ShardState.READY:
            record.ready_since = record.ready_since if record.ready_since is not None else now
        elif state is ShardState.DRAINING:
            record.drain_at = record.drain_at if record.drain_at is not None else now
        elif state is ShardState.FAILED:
            notes += self.failed(record, now)
        grown = frozenset({node}) if state is ShardState.STOPPED else frozenset()
        model = record.spec.model_name
        failed = (model,) if newly_failed else ()
        return Change(frozenset({model}), grown, notes=tuple(notes), failed=failed)

    def replica_drained(self, replica_id: str) -> Change:
        self.drained.add(replica_id)
        return Change(frozenset(self.store.models_of([replica_id])))

    def mark(
        self,
        name: str,
        *,
        cordoned: bool | None = None,
        draining: bool | None = None,
        drain_forced: bool | None = None,
        now: float | None = None,
    ) -> Change:
        """The operator's flags (KeyError for an unknown node); a drain that begins began
        at `now`. A node a store names that has not registered with this leader yet
        has its stored flags changed, which it is given when it registers (a new leader
        takes an operator's cordon before the fleet is back)."""
        node = self.lifecycle.nodes.get(name)
        if node is None:
            flags = None if self.stored_flags is None else self.stored_flags.get(name)
            if flags is None:
                raise KeyError(name)
            _set_flags(flags, cordoned, draining, drain_forced, now)
            self.touched_nodes.add(name)
            return Change()
        _set_flags(node, cordoned, draining, drain_forced, now)
        # Unreachable, the node hears of it when it comes back: it keeps the flags
        # for the next control plane.
        self._unmarked.add(name)
        self.touched_nodes.add(name)
        models = self.store.models_of(self.store.touching(name))
        return Change(frozenset(models), frozenset({name}))

    def marks_due(self) -> list[MarkNode]:
        """The flags to send to reachable nodes that have yet to hear of them."""
        out = []
        for name in sorted(self._unmarked):
            node = self.lifecycle.nodes.get(name)
            if node is None:
                self._unmarked.discard(name)
            elif node.status is NodeStatus.REACHABLE:
                self._unmarked.discard(name)
                out.append(MarkNode(name, node.cordoned, node.draining))
        return out

    def forget(self, name: str) -> Change:
        """Drop a lost node and its shards (ValueError for a node not lost)."""
        if self.lifecycle.nodes[name].status is not NodeStatus.LOST:
            raise ValueError(f"node {name} is not lost; only a lost node can be forgotten")
        before = self.store.touching(name)
        models = self.store.models_of(before)
        self.lifecycle.forget(name)
        self.touched_nodes.add(name)
        if self.stored_flags is not None:
            self.stored_flags.pop(name, None)
        for record in self.store.on_node(name):
            self.store.remove(record.key)
        gone = frozenset(rid for rid in before if rid not in self.store)
        return Change(frozenset(models), gone=gone)

    def restore_flags(self, flags: dict[str, OperatorFlags], unreadable: frozenset[str]) -> None:
        """The store speaks for every node's flags from now on (`stored_flags`)."""
        self.stored_flags = flags
        self.unreadable_flags = unreadable

    def _stored(self, name: str) -> OperatorFlags | None:
        """The flags the store holds for a node registering here first, None for the
        agent's word (no store, or its record was unreadable)."""
        if self.stored_flags is None or name in self.unreadable_flags:
            return None
        return self.stored_flags.pop(name, None) or OperatorFlags()

    # -- what the reconcile pass does ---------------------------------------------

    def sent(self, commands: Iterable[Command], now: float) -> None:
        """The pass sends these: started shards are pending, drains and stops sent."""
        for command in commands:
            self.store.issued(command, now)

    def settle(self, rid: str, now: float) -> Settled:
        """A replica's records, those of stopped shards dropped (a failed replica keeps
        them until it restarts), and those left unconfirmed until now (`shards.unconfirmed`:
        what is left of the replica is then judged as one whose rank is gone); a replica
        with none left is forgotten, with its failures and a drain the router reported."""
        store = self.store
        records, notes, freed = [], [], set()
        for r in store.replica(rid):
            if r.unconfirmed_until is None or now < r.unconfirmed_until:
                records.append(r)
                continue
            store.remove(r.key)
            freed.add(r.node)
            notes.append(
                f"node {r.node} has not reported replica {rid} rank {r.spec.rank} since it "
                f"registered without it {self.settings.lost_after_s:g} s ago: taken as gone"
            )
        if not any(r.state is ShardState.FAILED for r in records):
            for r in records:
                if r.state is ShardState.STOPPED:
                    store.remove(r.key)
                    freed.add(r.node)
            records = [r for r in records if r.state is not ShardState.STOPPED]
            if not records:
                self.failures.pop(rid, None)
                self.drained.discard(rid)
        return Settled(records, notes, freed)

    def kept(self, rid: str) -> None:
        """The pass keeps the replica: a drain the router reported of it is over."""
        self.drained.discard(rid)

    def served_again(self, rid: str) -> None:
        """The replica serves again after a failure: none in a row. A crash soon after
        still backs off longer (`failed` counts from the attempt unless it served long)."""
        self.failures.pop(rid, None)

    def take_touched(self) -> tuple[frozenset[str], frozenset[str]]:
        """The replicas and nodes touched since the last call (for the store a leader
        keeps: control.persisted), forgotten here."""
        touched = frozenset(self.store.touched), frozenset(self.touched_nodes)
        self.store.touched.clear()
        self.touched_nodes.clear()
        return touched

    # -- reading ------------------------------------------------------------------

    def capacities(self, names: Iterable[str] | None) -> list[NodeCapacity]:
        """What these nodes offer to placement (every node for None)."""
        nodes, store = self.lifecycle.nodes, self.store
        chosen = nodes.values() if names is None else (nodes[n] for n in names if n in nodes)
        return [
            NodeCapacity(n.inventory, n.status, n.cordoned, n.draining, store.used_gpus(n.name))
            for n in chosen
        ]

    def free_port(
        self, nodes: Sequence[str], *, after: int | None = None, ignore: str = "", width: int = 2
    ) -> int:
        """`width` ports in a row free on every node of a replica (`ignore`: the replica
        itself): its HTTP and rendezvous ports, and its KV events' two with kv_events.

        Ports belong to an address, not a node name: several simulated nodes on
        one machine share one port space. O(shards at those addresses)."""
        known = self.lifecycle.nodes
        hosts = {known[n].inventory.host if n in known else n for n in nodes}
        names = self.lifecycle.on_hosts(hosts) | {h for h in hosts if h not in known}
        used = self.store.ports(sorted(names), ignore=ignore)
        s = self.settings
        return free_port(used, s.engine_port_min, s.engine_port_max, after=after, width=width)

    def failed(self, record: ShardRecord, now: float) -> list[str]:
        """Note a failure once per failed start and schedule the restart."""
        spec = record.spec
        previous = self.failures.get(spec.replica_id)
        if previous is not None and previous.attempt == spec.attempt:
            return []
        s = self.settings
        served_long = (
            record.ready_since is not None and now - record.ready_since >= s.restart_backoff_max_s
        )
        count = 1 if served_long else spec.attempt + 1
        delay = backoff(count, s.restart_backoff_s, s.restart_backoff_max_s)
        self.failures[spec.replica_id] = Failure(
            spec.attempt, count, now, now + delay, record.detail
        )
        loop = " (crash loop)" if count >= s.crash_loop_after else ""
        return [
            f"replica {spec.replica_id} of {spec.model_name} failed on {record.node}{loop}: "
            f"{record.detail or 'no detail'}; restart in {delay:g} s"
        ]


def _set_flags(
    node: Node | OperatorFlags,
    cordoned: bool | None,
    draining: bool | None,
    drain_forced: bool | None,
    now: float | None,
) -> None:
    """An operator's flags on a registered node or on what the store holds for one not
    yet registered (None: unchanged); a drain that begins began at `now`."""
    if draining is not None and draining != node.draining:
        node.drain_since = now if draining else None
    node.cordoned = node.cordoned if cordoned is None else cordoned
    node.draining = node.draining if draining is None else draining
    node.drain_forced = node.drain_forced if drain_forced is None else drain_forced
