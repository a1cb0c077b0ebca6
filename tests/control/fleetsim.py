"""A simulated fleet for the control-plane core: inventories, profiles, and agents
that obey commands and report back, with a clock the test moves."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from llmgw_core.catalog import Catalog, ModelEntry, Profile
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_server.control.commands import DrainShard, MarkNode, StartShard, StopShard
from llmgw_server.control.lifecycle import NodeStatus, NodeTransition
from llmgw_server.control.reconciler import Reconciler, Routes, Step

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"
LIVE = (ShardState.PENDING, ShardState.STARTING, ShardState.READY, ShardState.DRAINING)


def gpu_node(
    name: str,
    gpus: int = 8,
    *,
    gpu_name: str = H100,
    total_gib: float = 80,
    free_gib: float | None = None,
    fabric: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    engines: Sequence[str] = ("vllm", "sglang", "mock"),
) -> Inventory:
    free = total_gib if free_gib is None else free_gib
    return Inventory(
        name=name,
        address=f"10.0.0.{sum(map(ord, name)) % 250 + 1}",
        labels=labels or {},
        fabric=fabric or {},
        cpus=64,
        memory_mib=512 * 1024,
        gpus=tuple(
            Gpu(i, f"GPU-{name}-{i}", gpu_name, int(total_gib * 1024), int(free * 1024))
            for i in range(gpus)
        ),
        engines=tuple(EngineInfo(e, True, "1.0") for e in engines),
    )


def profile(**kw: Any) -> Profile:
    fields: dict[str, Any] = {"engine": "mock", "model": "org/weights"}
    fields.update(kw)
    return Profile(**fields)


def model(name: str, replicas: int = 1, **kw: object) -> ModelEntry:
    return ModelEntry(name=name, profile=profile(**kw), replicas=replicas)


def catalog(*models: ModelEntry) -> Catalog:
    return Catalog(models=tuple(models))


FAST = ControlSection(settle_after_start_s=0.0, reconcile_interval_s=0.0)


@attrs.frozen
class Lost:
    """A node declared lost, with what the test knew then."""

    transition: NodeTransition
    heard: float  # when the control plane last heard from it
    started: float  # when the control plane started
    guarded: bool  # unreachable (and silent since) while the mass-loss guard held
    released: float | None  # when the guard released, if it was unreachable then


@attrs.define
class SimShard:
    spec: LaunchSpec
    state: ShardState
    detail: str = ""


class Agent:
    """One node's agent: runs what it is told, reports every change while connected."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.connected = True
        self.shards: dict[tuple[str, int], SimShard] = {}
        self.cordoned = False
        self.draining = False

    @property
    def name(self) -> str:
        return self.inventory.name

    def reports(self) -> list[ShardReport]:
        return [ShardReport(s.spec, s.state, s.detail) for s in self.shards.values()]

    def live_gpus(self, *, skip: tuple[str, int] | None = None) -> list[int]:
        return [
            i
            for key, s in self.shards.items()
            if key != skip and s.state in LIVE
            for i in s.spec.gpu_indices
        ]

    def apply(self, command: object) -> list[tuple[str, int, ShardState, str]]:
        """Obey a command; returns the transitions to report."""
        if isinstance(command, StartShard):
            spec = command.spec
            key = (spec.replica_id, spec.rank)
            clash = set(spec.gpu_indices) & set(self.live_gpus(skip=key))
            assert not clash, f"{self.name}: GPUs {sorted(clash)} started twice"
            self.shards[key] = SimShard(spec, ShardState.PENDING)
            return [(*key, ShardState.PENDING, "")]
        if isinstance(command, DrainShard):
            shard = self.shards.get((command.replica_id, command.rank))
            if shard and shard.state in (ShardState.PENDING, ShardState.STARTING, ShardState.READY):
                shard.state = ShardState.DRAINING
                return [(command.replica_id, command.rank, ShardState.DRAINING, "")]
            return []
        if isinstance(command, StopShard):
            shard = self.shards.pop((command.replica_id, command.rank), None)
            return [(command.replica_id, command.rank, ShardState.STOPPED, "")] if shard else []
        assert isinstance(command, MarkNode)
        self.cordoned, self.draining = command.cordoned, command.draining
        return []


class Shell:
    """What the trio shell keeps of the core, taken from the steps alone (as
    `ControlPlane.apply` takes it), checked after every step against what the core's
    queries say: the shell never reads back into the core, so a fact a step leaves out
    is a fact the shell gets wrong."""

    def __init__(self) -> None:
        self.cp: Reconciler | None = None  # the control plane process it belongs to
        self.routes: Routes | None = None
        self.tails: set[str] = set()  # the replicas whose failure's output tail it keeps

    def failed(self, cp: Reconciler, replica_id: str) -> None:
        """A shard's failure came on its node's stream, with its output tail."""
        self.restarted(cp)
        self.tails.add(replica_id)

    def restarted(self, cp: Reconciler) -> None:
        if cp is not self.cp:  # a new process (a restart, a failover) keeps nothing
            self.cp, self.routes, self.tails = cp, None, set()

    def take(self, cp: Reconciler, step: Step) -> None:
        self.restarted(cp)
        if step.routes is not None:
            assert step.routes != self.routes, "routes carried unchanged"
            self.routes = step.routes
        catalog = cp.catalog
        entries = {name: catalog.get(name) for name in cp.scaling.specs}
        autoscaled = {name: e.replicas for name, e in entries.items() if e is not None}
        assert self.routes == Routes(
            cp.serving(), dict(catalog.adapters), autoscaled, cp.awaiting
        ), "the routes as the steps left them differ from the core's"
        assert step.guard == cp.lifecycle.guard
        drains = [c.replica_id for c in step.commands if isinstance(c, DrainShard) and c.rank == 0]
        found = {rid: cp.endpoint(rid) for rid in drains}
        heads = {h.replica_id: (h.model, h.endpoint) for h in step.drain_heads}
        assert heads == {rid: e for rid, e in found.items() if e is not None}
        assert all(catalog.get(m) is not None for m in step.failed)
        assert not step.forgotten or step.reconciled
        assert not any(cp.knows_replica(rid) for rid in step.forgotten)
        self.tails -= step.forgotten
        if step.reconciled:  # where the shell prunes: what it keeps is known
            assert all(cp.knows_replica(rid) for rid in self.tails), self.tails


class Fleet:
    """The control plane and its agents, wired the way the trio shell will wire them."""

    def __init__(
        self,
        settings: ControlSection = FAST,
        cat: Catalog | None = None,
        *,
        now: float = 1000.0,
        instance: str = "a",
    ) -> None:
        self.settings = settings
        self.catalog = cat or catalog()
        self.now = now
        self.agents: dict[str, Agent] = {}
        self.transitions: list[NodeTransition] = []
        self.lost: list[Lost] = []
        self.notes: list[str] = []
        self.commands: list[object] = []
        self.failed: list[str] = []  # the models of the failures the control plane counted
        self.last_step = Step()
        self.heard: dict[str, float] = {}  # when the control plane last heard from each node
        self.closed: dict[str, float] = {}  # when it saw a node's stream close, since then
        # The mass-loss guard, as seen after each step: whether it held, which nodes it
        # saw unreachable (silent since), and when it released for those.
        self.guard_held = False
        self.guarded: set[str] = set()
        self.released: dict[str, float] = {}
        self.cp = Reconciler(settings, self.catalog, now=now, instance=instance)
        # Set, every step is checked to carry what the shell needs (`Shell`): for tests
        # that feed every step the control plane takes.
        self.shell: Shell | None = None

    # -- wiring ----------------------------------------------------------------

    def feed(self, step: Step) -> Step:
        if self.shell is not None:
            self.shell.take(self.cp, step)
        self.last_step = step
        self.transitions += step.transitions
        just_lost = [t for t in step.transitions if t.new is NodeStatus.LOST]
        self.watch_guard({t.node for t in just_lost})
        self.lost += [
            Lost(
                t,
                self.heard[t.node],
                self.cp.started_at,
                t.node in self.guarded,
                self.released.get(t.node),
            )
            for t in just_lost
        ]
        self.notes += step.notes
        self.commands += step.commands
        self.failed += step.failed
        for command in step.commands:
            agent = self.agents.get(command.node)
            if agent is None or not agent.connected:
                continue  # the stream is gone: the command is lost with it
            for rid, rank, state, detail in agent.apply(command):
                self.feed(self.cp.shard_status(agent.name, rid, rank, state, self.now, detail))
        return step

    def watch_guard(self, just_lost: set[str]) -> None:
        """What the guard did in the step just taken (this is the test's own record)."""
        nodes = self.cp.lifecycle.nodes
        unreachable = {n for n, node in nodes.items() if node.status is NodeStatus.UNREACHABLE}
        if self.cp.lifecycle.guard is not None:
            self.guarded |= unreachable
        elif self.guard_held:
            # Released in this step: whoever was still unreachable at that moment.
            for name in unreachable | just_lost:
                self.released[name] = self.now
        self.guard_held = self.cp.lifecycle.guard is not None

    def heard_from(self, name: str) -> None:
        self.heard[name] = self.now
        self.closed.pop(name, None)
        self.guarded.discard(name)
        self.released.pop(name, None)

    def register(self, name: str) -> Step:
        agent = self.agents[name]
        agent.connected = True
        self.heard_from(name)
        return self.feed(
            self.cp.register(
                agent.inventory,
                agent.reports(),
                self.now,
                cordoned=agent.cordoned,
                draining=agent.draining,
            )
        )

    # -- what the test does ----------------------------------------------------

    def join(self, *inventories: Inventory) -> None:
        for inventory in inventories:
            self.agents[inventory.name] = Agent(inventory)
            self.register(inventory.name)

    def set_catalog(self, cat: Catalog) -> Step:
        self.catalog = cat
        return self.feed(self.cp.set_catalog(cat, self.now))

    def silence(self, name: str, *, tell: bool = False) -> None:
        """The agent's stream breaks; `tell` when the control plane sees it close."""
        self.agents[name].connected = False
        node = self.cp.lifecycle.nodes.get(name)
        if tell and node is not None and node.status is NodeStatus.REACHABLE:
            self.closed[name] = self.now
            self.feed(self.cp.disconnected(name, self.now))

    def heartbeats(self) -> None:
        for agent in self.agents.values():
            if agent.connected:
                self.heard_from(agent.name)
                self.feed(self.cp.heartbeat(agent.name, self.now))

    def advance(self, seconds: float, *, beat: bool = True, every: float = 5.0) -> None:
        """Move time on; connected agents heartbeat every `every` seconds when `beat`."""
        end = self.now + seconds
        while self.now < end:
            self.now = min(end, self.now + every) if beat else end
            if beat:
                self.heartbeats()
            self.feed(self.cp.tick(self.now))

    def report(self, name: str, rid: str, rank: int, state: ShardState, detail: str = "") -> None:
        """A shard changes on its node; the control plane hears of it while connected."""
        agent = self.agents[name]
        shard = agent.shards[(rid, rank)]
        shard.state, shard.detail = state, detail
        if agent.connected:
            if self.shell is not None and state is ShardState.FAILED:
                self.shell.failed(self.cp, rid)
            self.feed(self.cp.shard_status(name, rid, rank, state, self.now, detail))

    def ready_all(self) -> None:
        """Every launched shard becomes ready, as engines finish loading."""
        for agent in self.agents.values():
            for (rid, rank), shard in list(agent.shards.items()):
                if shard.state in (ShardState.PENDING, ShardState.STARTING):
                    self.report(agent.name, rid, rank, ShardState.STARTING)
                    self.report(agent.name, rid, rank, ShardState.READY)

    def restart_control_plane(self, *, instance: str, order: Iterable[str] | None = None) -> None:
        """A new control plane process: connected agents re-register, in `order`."""
        self.cp = Reconciler(self.settings, self.catalog, now=self.now, instance=instance)
        # The new control plane knows nothing of the old one's guard (its start-up grace rules).
        self.guard_held, self.guarded, self.released = False, set(), {}
        for name in order if order is not None else list(self.agents):
            if self.agents[name].connected:
                self.register(name)

    # -- looking ---------------------------------------------------------------

    def shards(self, state: ShardState | None = None) -> list[tuple[str, SimShard]]:
        return [
            (a.name, s)
            for a in self.agents.values()
            for s in a.shards.values()
            if state is None or s.state is state
        ]

    def replicas(self, model: str, *states: ShardState) -> set[str]:
        return {
            s.spec.replica_id
            for _, s in self.shards()
            if s.spec.model_name == model and (not states or s.state in states)
        }

    def starts(self) -> list[StartShard]:
        return [c for c in self.commands if isinstance(c, StartShard)]
