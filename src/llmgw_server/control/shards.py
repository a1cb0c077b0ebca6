"""Shards as the control plane knows them, and what state a replica is in.

A replica is the set of shard records with one replica id; its phase is
derived from those records and the nodes' status on every reconcile, never
stored, so that records rebuilt from agents' reports after a restart lead to
the same decisions.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from llmgw_core.catalog import Profile
from llmgw_core.inventory import LaunchSpec, ShardState
from llmgw_server.control.fit import runs_within
from llmgw_server.control.lifecycle import Node, NodeStatus

ShardKey = tuple[str, str, int]  # node, replica id, rank


@attrs.define
class ShardRecord:
    node: str
    spec: LaunchSpec
    state: ShardState
    detail: str = ""
    ready_since: float | None = None
    drain_at: float | None = None  # when a drain was sent or first reported
    stop_sent: bool = False
    # Running (starting or ready) when its node registered again without it: kept, and
    # serving if ready, until reported again or this time passes (`unconfirmed`).
    unconfirmed_until: float | None = None

    @property
    def key(self) -> ShardKey:
        return (self.node, self.spec.replica_id, self.spec.rank)

    @property
    def retiring(self) -> bool:
        return self.stop_sent or self.drain_at is not None or self.state is ShardState.DRAINING


def unconfirmed(record: ShardRecord, reported: bool) -> bool:
    """Whether a registration of its node that leaves `record` out (`reported` False)
    keeps it, unconfirmed: a shard its node had reported running is not taken as gone
    on one registration's word.

    An agent reports every engine it runs or ran (one that ended while it was away, as
    failed), so a running shard goes missing only when the registering agent is not the
    one that runs it: its state directory lost, or a second machine under the node's
    name (a cloned image). Dropping the record at once withdrew the replica's route
    while its engine may still serve, and freed its port and GPUs for a replacement that
    then found them in use (issue 34, finding 6). It is awaited as the rank of a node
    that has not registered is after a restart: `lost_after_s`, the time after which a
    silent node's replicas move (`Known.register` sets the deadline once; reported
    again, the shard is confirmed; at the deadline the decider drops it, and its
    replica is replaced as any whose shard is gone)."""
    return (
        not reported
        and record.state in (ShardState.STARTING, ShardState.READY)
        and not record.retiring
    )


class Phase(enum.StrEnum):
    LIVE = "live"  # pending, starting or ready (maybe on an unreachable node)
    FAILED = "failed"  # a shard failed: the replica restarts whole, after a backoff
    RETIRING = "retiring"  # being drained or stopped
    BROKEN = "broken"  # a node is lost or a rank is gone: what is left gets stopped


@attrs.frozen
class Classified:
    phase: Phase
    reason: str = ""
    wait_until: float | None = None  # ranks on nodes not yet registered are awaited until then


def classify(
    records: Sequence[ShardRecord],
    nodes: Mapping[str, Node],
    *,
    grace_until: float,
    now: float,
) -> Classified:
    """The phase of one replica, from its records (none of them stopped unless it failed)."""
    spec = min(records, key=lambda r: r.spec.rank).spec
    ranks = [r.spec.rank for r in records]
    if len(set(ranks)) != len(ranks):
        return Classified(Phase.BROKEN, "two shards claim one rank")
    for r in records:
        if r.spec.nodes != spec.nodes or r.node != r.spec.node or r.spec.attempt != spec.attempt:
            return Classified(Phase.BROKEN, "its shards disagree on the placement")
        if nodes[r.node].status is NodeStatus.LOST:
            return Classified(Phase.BROKEN, f"node {r.node} is lost")
    wait_until = None
    for rank in sorted(set(range(spec.nnodes)) - set(ranks)):
        name = spec.nodes[rank]
        if name in nodes:
            return Classified(Phase.BROKEN, f"rank {rank} is gone from node {name}")
        if now >= grace_until:
            return Classified(Phase.BROKEN, f"node {name} of rank {rank} has not registered")
        wait_until = grace_until
    if any(r.state is ShardState.FAILED for r in records):
        failed = next(r for r in records if r.state is ShardState.FAILED)
        return Classified(Phase.FAILED, failed.detail, wait_until)
    if any(r.retiring for r in records):
        return Classified(Phase.RETIRING, "", wait_until)
    return Classified(Phase.LIVE, "", wait_until)


def matches(records: Sequence[ShardRecord], profile: Profile, nodes: Mapping[str, Node]) -> bool:
    """Whether a replica still runs what the profile asks, where the profile allows."""
    spec = records[0].spec
    if (
        spec.engine != profile.engine
        or spec.hf_model != profile.model
        or spec.args != profile.args
        or spec.max_model_len != profile.max_model_len
        or spec.lora != profile.lora
        or spec.max_lora_rank != profile.max_lora_rank
        or spec.env != profile.env
        or spec.tensor_parallel != profile.tensor_parallel
        or spec.pipeline_parallel != profile.pipeline_parallel
    ):
        return False
    per_shard = profile.gpus if spec.nnodes == 1 else profile.tensor_parallel
    if spec.nnodes not in (1, profile.pipeline_parallel):
        return False
    return all(
        len(r.spec.gpu_indices) == per_shard
        and runs_within(profile, nodes[r.node].inventory, r.spec.gpu_indices)
        for r in records
    )


@attrs.frozen
class Failure:
    """One failure of a replica, kept to pace its restarts."""

    attempt: int  # the spec's attempt that failed: one Failure per failed start
    count: int  # consecutive failures, this one included
    at: float
    restart_at: float
    detail: str


def backoff(count: int, base: float, cap: float) -> float:
    """10 s, 20 s, 40 s... up to 5 min with the defaults."""
    return min(base * 2.0 ** min(count - 1, 64), cap)
