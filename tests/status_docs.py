"""Admin documents for tests, with defaults for what a test does not look at."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw_core.inventory import ShardState
from llmgw_server.control.documents import (
    GpuDoc,
    ModelDoc,
    NodeDoc,
    ReplicaDoc,
    ShardDoc,
    StatusDoc,
    UnplacedDoc,
)
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.shards import Phase


def node(
    name: str,
    *,
    status: NodeStatus = NodeStatus.REACHABLE,
    cordoned: bool = False,
    draining: bool = False,
    drain_forced: bool = False,
    gpus: Sequence[GpuDoc] = (),
    fabric: dict[str, str] | None = None,
) -> NodeDoc:
    return NodeDoc(
        name=name,
        status=status,
        cordoned=cordoned,
        draining=draining,
        drain_forced=drain_forced,
        last_seen_s_ago=0.5,
        address=name,
        labels={},
        fabric=fabric or {},
        cpus=8,
        memory_mib=65536,
        gpus=tuple(gpus),
        engines=(),
    )


def shard(node: str, state: ShardState, *, rank: int = 0, retiring: bool = False) -> ShardDoc:
    return ShardDoc(node, rank, state, (rank,), "", retiring, ())


def replica(
    rid: str,
    model: str,
    phase: Phase,
    shards: Sequence[ShardDoc],
    *,
    serving: bool = False,
    moving: bool = False,
    crash_loop: bool = False,
    failures: int = 0,
    reason: str = "",
    restart_in_s: float | None = None,
) -> ReplicaDoc:
    return ReplicaDoc(
        replica_id=rid,
        model=model,
        phase=phase,
        serving=serving,
        kept=not moving,
        moving=moving,
        reason=reason,
        url="http://10.0.0.1:8000",
        attempt=failures,
        failures=failures,
        crash_loop=crash_loop,
        restart_in_s=restart_in_s,
        shards=tuple(shards),
    )


def model(
    name: str, desired: int = 1, kept: int = 1, *, unplaced: UnplacedDoc | None = None
) -> ModelDoc:
    return ModelDoc(name, desired, kept, unplaced)


def status(
    nodes: Sequence[NodeDoc],
    replicas: Sequence[ReplicaDoc] = (),
    models: Sequence[ModelDoc] = (),
    guard: str | None = None,
) -> StatusDoc:
    return StatusDoc(tuple(nodes), tuple(replicas), tuple(models), guard)
