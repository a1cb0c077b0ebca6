"""Read-only snapshots of the control plane, for the admin API (which makes its
documents of them, `documents`), the metrics and tests.

Engine keys never appear here: a view is shown to operators and written to logs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import attrs

from llmgw_core.catalog import Catalog
from llmgw_core.inventory import Inventory, ShardState
from llmgw_server.control.explanation import Explanation
from llmgw_server.control.known import Known
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.replicas import Status
from llmgw_server.control.scaling import ScaleView
from llmgw_server.control.shards import Classified, Failure, Phase, ShardRecord


@attrs.frozen
class NodeView:
    name: str
    status: NodeStatus
    cordoned: bool
    draining: bool
    # The drain was forced: a replica that fits nowhere else stops without a replacement.
    drain_forced: bool
    last_seen: float
    inventory: Inventory
    used_gpus: tuple[int, ...]


@attrs.frozen
class ShardView:
    node: str
    rank: int
    state: ShardState
    gpus: tuple[int, ...]
    detail: str
    retiring: bool  # a drain or stop was sent, the agent reports it draining, or it is moving
    # Running, then left out of its node's registration: kept until reported again or
    # lost_after_s passes (shards.unconfirmed).
    unconfirmed: bool = False


@attrs.frozen
class ReplicaView:
    replica_id: str
    model: str
    phase: Phase
    kept: bool  # counted toward the model's replicas (else being retired or replaced)
    # On a draining node, serving until a replacement elsewhere serves; not counted toward
    # the model's replicas (its replacement is), and its shards show as retiring.
    moving: bool
    reason: str  # why it is failed or broken
    shards: tuple[ShardView, ...]
    url: str  # the head's endpoint
    attempt: int
    failures: int  # consecutive failures so far
    crash_loop: bool
    restart_at: float | None

    @property
    def serving(self) -> bool:
        """Whether the router should send it requests."""
        return (
            self.phase is Phase.LIVE
            and (self.kept or self.moving)
            and all(s.state is ShardState.READY for s in self.shards)
        )


@attrs.frozen
class Unplaced:
    model: str
    count: int  # replicas wanted but not placed
    explanation: Explanation  # against the fleet as it is now
    waiting: str | None = None  # set when placement is deferred rather than impossible


@attrs.frozen
class ModelView:
    name: str
    desired: int
    kept: int  # replicas counted toward `desired`
    autoscale: ScaleView | None = None  # [models.autoscale]: its bounds, target and reasons


@attrs.frozen
class ControlView:
    nodes: tuple[NodeView, ...]
    replicas: tuple[ReplicaView, ...]
    models: tuple[ModelView, ...]
    unplaced: dict[str, Unplaced] = attrs.field(hash=False)
    guard: str | None  # why the mass-loss guard holds


def replica_view(
    records: list[ShardRecord],
    classified: Classified,
    *,
    kept: bool,
    moving: bool = False,
    failure: Failure | None,
    crash_loop_after: int,
) -> ReplicaView:
    records = sorted(records, key=lambda r: r.spec.rank)
    spec = records[0].spec
    failures = failure.count if failure else 0
    view = ReplicaView(
        replica_id=spec.replica_id,
        model=spec.model_name,
        phase=classified.phase,
        kept=kept,
        moving=moving,
        reason=classified.reason,
        shards=tuple(
            ShardView(
                r.node,
                r.spec.rank,
                r.state,
                r.spec.gpu_indices,
                r.detail,
                r.retiring or moving,
                r.unconfirmed_until is not None,
            )
            for r in records
        ),
        url=spec.url,
        attempt=spec.attempt,
        failures=failures,
        crash_loop=False,
        restart_at=failure.restart_at if failure and classified.phase is Phase.FAILED else None,
    )
    # A replica that serves again is out of its loop, whatever it went through.
    return attrs.evolve(view, crash_loop=failures >= crash_loop_after and not view.serving)


def control_view(
    known: Known,
    status: Mapping[str, Status],
    kept: Mapping[str, int],
    short: Mapping[str, tuple[int, str | None]],
    catalog: Catalog,
    explain: Callable[[str], Explanation | None],
    only: Collection[str] | None = None,
    scaling: Callable[[str], ScaleView | None] = lambda _: None,
) -> ControlView:
    """Everything, for the admin API: O(nodes and shards, and an explanation for each
    model short of replicas). With `only`, just those nodes (the known ones among them)
    and the replicas with a shard on them: O(those, and the models)."""
    store, lifecycle = known.store, known.lifecycle
    chosen = (
        lifecycle.nodes.values()
        if only is None
        else [lifecycle.nodes[name] for name in only if name in lifecycle.nodes]
    )
    nodes = tuple(
        NodeView(
            n.name,
            n.status,
            n.cordoned,
            n.draining,
            n.draining and n.drain_forced,
            n.last_seen,
            n.inventory,
            tuple(sorted(store.used_gpus(n.name))),
        )
        for n in chosen
    )
    if only is None:
        with_shards: Iterable[tuple[str, list[ShardRecord]]] = store.replicas()
    else:
        # In the whole view's order, which is the store's.
        names = {n.name for n in nodes}
        touching = {rid for name in names for rid in store.touching(name)}
        with_shards = (
            (rid, records)
            for rid, records in store.replicas()
            if rid in touching and any(r.node in names for r in records)
        )
    replicas = []
    for rid, records in with_shards:
        judged = status.get(rid) or Status(Classified(Phase.LIVE))
        view = replica_view(
            records,
            judged.classified,
            kept=judged.kept,
            moving=judged.moving,
            failure=known.failures.get(rid),
            crash_loop_after=known.settings.crash_loop_after,
        )
        replicas.append(view)
    models = tuple(
        ModelView(m.name, m.replicas, kept.get(m.name, 0), scaling(m.name))
        for m in catalog.profiled
    )
    unplaced = {}
    for name, (count, waiting) in short.items():
        why = explain(name)
        assert why is not None
        unplaced[name] = Unplaced(name, count, why, waiting)
    return ControlView(nodes, tuple(replicas), models, unplaced, lifecycle.guard)
