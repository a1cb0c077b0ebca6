"""Decisions about one replica, or the replicas of one model: pure functions of the
records, the nodes and the time, returning commands. Nothing here changes state; the
reconcile pass (`decide.py`) records what it sends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import attrs

from llmgw_core.catalog import Catalog, ModelEntry
from llmgw_core.inventory import ShardState
from llmgw_server.control.commands import Command, DrainShard, StartShard, StopShard
from llmgw_server.control.lifecycle import Node, NodeStatus
from llmgw_server.control.shards import Classified, Failure, Phase, ShardRecord, matches

_LIVE_ORDER = {ShardState.READY: 0, ShardState.STARTING: 1, ShardState.PENDING: 2}
Replica = tuple[str, list[ShardRecord]]  # id, records
PROFILE_CHANGED = "its profile changed"


@attrs.define
class Status:
    """How the last reconcile judged a replica."""

    classified: Classified
    kept: bool = False
    # On a draining node, or rolling to a changed profile: serving until a replacement
    # serves.
    moving: bool = False


def unwanted(
    c: Classified,
    entry: ModelEntry | None,
    catalog: Catalog,
    records: Sequence[ShardRecord],
    nodes: Mapping[str, Node],
) -> str | None:
    """Why a replica is not a candidate to keep ("" when it is already retiring); `entry`
    is its model when it is wanted (a profile and replicas > 0)."""
    if c.phase is Phase.RETIRING:
        return ""
    name = records[0].spec.model_name
    if entry is None or entry.profile is None:
        known = catalog.get(name)
        if known is not None and known.profile is not None:
            return "its model is scaled to 0 replicas"
        return f"no model {name!r} with a profile in the catalog"
    if not matches(records, entry.profile, nodes):
        return PROFILE_CHANGED
    return None


def on_draining_node(records: Sequence[ShardRecord], nodes: Mapping[str, Node]) -> bool:
    return any(nodes[r.node].draining for r in records)


def serves(status: Status, records: Sequence[ShardRecord]) -> bool:
    return status.classified.phase is Phase.LIVE and all(
        r.state is ShardState.READY for r in records
    )


def keep_order(
    replica: Replica, status: Status, abandoned: Collection[str], nodes: Mapping[str, Node]
) -> tuple[bool, bool, int, str]:
    """Reachable before not, then ready before starting before pending before failed."""
    rid, records = replica
    unreachable = any(nodes[r.node].status is not NodeStatus.REACHABLE for r in records)
    if status.classified.phase is Phase.FAILED:
        rank = len(_LIVE_ORDER)
    else:
        rank = max(_LIVE_ORDER.get(r.state, len(_LIVE_ORDER)) for r in records)
    return (rid in abandoned, unreachable, rank, rid)


def hold(
    moving: Sequence[Replica],
    budget: int,
    underway: int,
    order: Callable[[Replica], tuple[bool, bool, int, str]],
    status: Mapping[str, Status],
    nodes: Mapping[str, Node],
) -> tuple[list[str], list[tuple[str, list[ShardRecord], str]]]:
    """Keep up to `budget` serving replicas of a model that sit on draining nodes or
    roll to a changed profile (as many as replacements do not serve yet); returns
    those held and those to retire, with why.

    A replica on a node whose drain was not forced stays whatever is `underway`: that
    drain never takes a model offline. One on a forced drain stays only while one of
    the `underway` replacements is its own. The unforced come first: they stay anyway.
    """
    held: list[str] = []
    retire = []

    def forced(records: list[ShardRecord]) -> bool:
        return any(nodes[r.node].draining and nodes[r.node].drain_forced for r in records)

    for rid, records in sorted(moving, key=lambda c: (forced(c[1]), *order(c))):
        draining = sorted({r.node for r in records if nodes[r.node].draining})
        serving, is_forced = serves(status[rid], records), forced(records)
        if serving and budget > 0 and (underway > 0 or not is_forced):
            held.append(rid)
            budget -= 1
            if is_forced:
                underway -= 1
            continue
        why = f"node {draining[0]} is draining" if draining else PROFILE_CHANGED
        if serving and budget > 0:
            node = next(n for n in draining if nodes[n].drain_forced)
            why = f"the drain of node {node} is forced and it fits nowhere else"
        elif serving:
            why += " and its replacement serves"
        retire.append((rid, records, why))
    return held, retire


def reachable(record: ShardRecord, nodes: Mapping[str, Node]) -> bool:
    node = nodes.get(record.node)
    return node is not None and node.status is NodeStatus.REACHABLE


def stop(records: Sequence[ShardRecord], nodes: Mapping[str, Node]) -> list[Command]:
    return [
        StopShard(r.node, r.spec.replica_id, r.spec.rank)
        for r in records
        if not r.stop_sent and r.state is not ShardState.STOPPED and reachable(r, nodes)
    ]


def retire(
    rid: str,
    records: Sequence[ShardRecord],
    *,
    drained: bool,
    now: float,
    drain_timeout_s: float,
    nodes: Mapping[str, Node],
) -> tuple[list[Command], float | None]:
    """Drain a serving replica, then stop it once the router reports it drained or the
    drain times out (the deadline is returned while it runs); stop any other at once."""
    serving = any(
        r.drain_at is not None or r.state in (ShardState.READY, ShardState.DRAINING)
        for r in records
    )
    commands: list[Command] = []
    if serving and not drained:
        # A shard reported draining has `drain_at` already: the others are told to.
        commands = [
            DrainShard(r.node, rid, r.spec.rank)
            for r in records
            if r.drain_at is None
            and r.state not in (ShardState.FAILED, ShardState.STOPPED)
            and reachable(r, nodes)
        ]
        started = [r.drain_at for r in records if r.drain_at is not None]
        if commands:
            started.append(now)
        if not started:
            return [], None  # every shard is on an unreachable node: wait for one
        deadline = min(started) + drain_timeout_s
        if now < deadline:
            return commands, deadline
    return commands + stop(records, nodes), None


def restart(
    records: Sequence[ShardRecord],
    failure: Failure,
    now: float,
    nodes: Mapping[str, Node],
    free_port: Callable[[], int],
) -> tuple[list[Command], float | None]:
    """A failed replica restarts whole, on the same GPUs, once its backoff has passed:
    the ranks that still run are stopped first (they cannot rejoin a new head). Returns
    the commands and, while the backoff runs, when it ends."""
    commands = stop([r for r in records if r.state is not ShardState.FAILED], nodes)
    spec = records[0].spec
    if any(r.state not in (ShardState.FAILED, ShardState.STOPPED) for r in records):
        return commands, None
    if len(records) < spec.nnodes or not all(reachable(r, nodes) for r in records):
        return commands, None  # a rank is awaited, or a node is unreachable: its change wakes us
    if now < failure.restart_at:
        return commands, failure.restart_at
    port = free_port()
    for r in sorted(records, key=lambda r: r.spec.rank):
        new = attrs.evolve(r.spec, attempt=failure.count, port=port, dist_port=port + 1)
        commands.append(StartShard(r.node, new))
    return commands, None
