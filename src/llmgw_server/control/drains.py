"""An operator's drain: which replicas would have nowhere to go, and what the log says.

`stuck` places the node's replicas on the fleet's other nodes: O(nodes), once per
operator request. Its explanations count only those (the node asked about is not
"already draining"), or say there is none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from llmgw_core.catalog import Catalog
from llmgw_core.control_config import ControlSection
from llmgw_server.control.capacity import NodeCapacity
from llmgw_server.control.explanation import Explanation
from llmgw_server.control.placement import PlacementRequest, place
from llmgw_server.control.replicas import Status
from llmgw_server.control.store import ShardStore


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


def stuck(
    node: str,
    replicas: Mapping[str, str],
    capacities: Sequence[NodeCapacity],
    catalog: Catalog,
    settings: ControlSection,
) -> list[Stuck]:
    """The `replicas` (id -> model) on `node` that could not be placed elsewhere, were
    it draining."""
    nodes = [c for c in capacities if c.name != node]
    requests = []
    for rid, model in replicas.items():
        entry = catalog.get(model)
        if entry is not None and entry.profile is not None:
            requests.append(PlacementRequest(rid, model, entry.profile))
    result = place(requests, nodes, fabric_key=settings.fabric_key, spread=settings.spread)
    return [
        Stuck(
            r.key,
            r.model,
            result.explanations[r.model]
            if nodes
            else Explanation(r.model, "there is no other node", (), {}),
        )
        for r in sorted(result.unplaced, key=lambda r: r.key)
    ]


def drain_notes(
    node: str,
    moving: Mapping[str, str],
    stuck: Sequence[Stuck],
    *,
    force: bool,
    draining: bool,
    forced: bool,
) -> list[str]:
    """What the log says of a drain asked for; `draining` and `forced`: as it was."""
    notes = []
    if not draining:
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
    elif force and not forced:
        notes.append(
            f"draining {node} is forced now: a replica that fits nowhere else stops "
            "without a replacement"
        )
    return notes


def replicas_on(node: str, store: ShardStore, status: Mapping[str, Status]) -> dict[str, str]:
    """The replicas with a shard on `node` that count for their model: id -> model."""
    out = {}
    for rid in sorted(store.touching(node)):
        records = store.replica(rid)
        judged = status.get(rid)
        if any(r.node == node for r in records) and (
            judged is None or judged.kept or judged.moving
        ):
            out[rid] = records[0].spec.model_name
    return out
