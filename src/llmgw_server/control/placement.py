"""Placement: which GPUs of which nodes a replica gets, pure and deterministic.

- A replica goes on one node when one node has its tensor_parallel x
  pipeline_parallel GPUs free; otherwise (pipeline_parallel > 1) it becomes
  pipeline_parallel shards of tensor_parallel GPUs, one shard per node, all in
  one fabric domain and on one GPU model. Shard 0 is the head.
- Bin-packing (best fit, largest replicas first) by default: it keeps whole
  nodes free for the replicas that need them. `spread` picks the emptiest node.
- A GPU is never shared: a node's used GPUs are handed in and grow as replicas
  are placed.
- The GPUs of one shard are all of one GPU name, lowest indices first.

Nodes' free GPUs are indexed by how many a profile can use, in buckets, so a
replica is placed in time independent of the fleet's size; the buckets are
rebuilt once per distinct profile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from llmgw_core.catalog import Profile
from llmgw_core.inventory import Gpu
from llmgw_server.control.capacity import NodeCapacity, NodeFree
from llmgw_server.control.explanation import Explanation, explain_free
from llmgw_server.control.lifecycle import NodeStatus

__all__ = [
    "Assignment",
    "Explanation",
    "NodeCapacity",
    "PlacementRequest",
    "PlacementResult",
    "ShardAssignment",
    "explain",
    "place",
]


@attrs.frozen
class PlacementRequest:
    key: str  # the caller's name for the replica, returned in its Assignment
    model: str
    profile: Profile


@attrs.frozen
class ShardAssignment:
    node: str
    gpus: tuple[int, ...]


@attrs.frozen
class Assignment:
    key: str
    model: str
    shards: tuple[ShardAssignment, ...]  # in rank order; shards[0] is the head


@attrs.frozen
class PlacementResult:
    assignments: tuple[Assignment, ...]
    unplaced: tuple[PlacementRequest, ...]
    # For every model with an unplaced request: why, against the fleet as it
    # is after this placement (none when not asked for).
    explanations: dict[str, Explanation]


def explain(
    model: str, profile: Profile, nodes: Sequence[NodeCapacity], *, fabric_key: str = "ib_domain"
) -> Explanation:
    """Why `profile` can or cannot get one more replica on `nodes`, naming every node."""
    return explain_free(model, profile, [NodeFree(n) for n in nodes], fabric_key)


def place(
    requests: Iterable[PlacementRequest],
    nodes: Sequence[NodeCapacity],
    *,
    fabric_key: str = "ib_domain",
    spread: bool = False,
    explain_unplaced: bool = True,
) -> PlacementResult:
    states = [NodeFree(n) for n in nodes]
    order = sorted(requests, key=lambda r: (-r.profile.gpus, r.model, r.key))
    assignments: list[Assignment] = []
    unplaced: list[PlacementRequest] = []
    i = 0
    while i < len(order):
        j = i
        while (
            j < len(order)
            and order[j].model == order[i].model
            and order[j].profile == order[i].profile
        ):
            j += 1
        placed, failed = _place_group(order[i:j], states, fabric_key, spread)
        assignments += placed
        unplaced += failed
        i = j
    explanations: dict[str, Explanation] = {}
    for request in unplaced if explain_unplaced else ():
        if request.model not in explanations:
            explanations[request.model] = explain_free(
                request.model, request.profile, states, fabric_key
            )
    return PlacementResult(tuple(assignments), tuple(unplaced), explanations)


class _Candidates:
    """The nodes a profile may use, bucketed by how many GPUs it could use on each."""

    def __init__(self, profile: Profile, states: Sequence[NodeFree]) -> None:
        self.profile = profile
        self.min_mib = _min_mib(profile)
        self.nodes = [s for s in states if _eligible(s, profile)]
        self.buckets: list[dict[NodeFree, None]] = [{} for _ in range(_max_gpus(self.nodes) + 1)]
        self.count: dict[NodeFree, int] = {}
        for state in self.nodes:
            self._file(state)

    def _file(self, state: NodeFree) -> None:
        n = max((len(g) for g in self.usable(state).values()), default=0)
        self.count[state] = n
        self.buckets[n][state] = None

    def refile(self, state: NodeFree) -> None:
        del self.buckets[self.count[state]][state]
        self._file(state)

    def usable(self, state: NodeFree) -> dict[str, list[Gpu]]:
        """Free GPUs the profile may use on a node, by GPU name."""
        wanted = (self.profile.gpu_model or "").lower()
        out: dict[str, list[Gpu]] = {}
        for name, gpus in state.free.items():
            if wanted and wanted not in name.lower():
                continue
            ok = [g for g in gpus if g.memory_free_mib >= self.min_mib] if self.min_mib else gpus
            if ok:
                out[name] = ok
        return out

    def single(self, need: int, spread: bool) -> NodeFree | None:
        sizes = (
            range(len(self.buckets) - 1, need - 1, -1) if spread else range(need, len(self.buckets))
        )
        for n in sizes:
            if self.buckets[n]:
                return next(iter(self.buckets[n]))
        return None


def _place_group(
    group: Sequence[PlacementRequest], states: Sequence[NodeFree], fabric_key: str, spread: bool
) -> tuple[list[Assignment], list[PlacementRequest]]:
    profile = group[0].profile
    cands = _Candidates(profile, states)
    placed: list[Assignment] = []
    for k, request in enumerate(group):
        shards = _place_one(cands, fabric_key, spread)
        if shards is None:
            # Capacity only shrinks within one call: the rest of the group cannot fit either.
            return placed, list(group[k:])
        placed.append(Assignment(request.key, request.model, shards))
    return placed, []


def _place_one(
    cands: _Candidates, fabric_key: str, spread: bool
) -> tuple[ShardAssignment, ...] | None:
    profile = cands.profile
    state = cands.single(profile.gpus, spread)
    if state is not None:
        return (_take(cands, state, profile.gpus),)
    if profile.pipeline_parallel == 1:
        return None
    return _place_across(cands, fabric_key, spread)


def _place_across(
    cands: _Candidates, fabric_key: str, spread: bool
) -> tuple[ShardAssignment, ...] | None:
    tp, pp = cands.profile.tensor_parallel, cands.profile.pipeline_parallel
    groups: dict[tuple[str, str], list[tuple[int, NodeFree]]] = {}
    for n in range(tp, len(cands.buckets)):
        for state in cands.buckets[n]:
            domain = state.capacity.inventory.fabric.get(fabric_key)
            if domain is None:
                continue
            for name, gpus in cands.usable(state).items():
                if len(gpus) >= tp:
                    groups.setdefault((domain, name), []).append((len(gpus), state))
    fitting = [(key, members) for key, members in groups.items() if len(members) >= pp]
    if not fitting:
        return None

    # Best fit takes the smallest domain that fits and, inside it, the fullest
    # nodes; spread takes the largest domain and its emptiest nodes.
    def domain_size(item: tuple[tuple[str, str], list[tuple[int, NodeFree]]]) -> tuple[int, int]:
        return (len(item[1]), sum(n for n, _ in item[1]))

    (_, gpu_name), members = (max if spread else min)(fitting, key=domain_size)
    members.sort(key=lambda m: -m[0] if spread else m[0])
    return tuple(_take(cands, state, tp, gpu_name) for _, state in members[:pp])


def _take(
    cands: _Candidates, state: NodeFree, n: int, gpu_name: str | None = None
) -> ShardAssignment:
    usable = cands.usable(state)
    if gpu_name is None:
        gpu_name = max(usable, key=lambda name: (len(usable[name]), name))
    chosen = usable[gpu_name][:n]
    taken = {g.index for g in chosen}
    state.free[gpu_name] = [g for g in state.free[gpu_name] if g.index not in taken]
    cands.refile(state)
    return ShardAssignment(state.capacity.name, tuple(g.index for g in chosen))


def _eligible(state: NodeFree, profile: Profile) -> bool:
    cap = state.capacity
    if cap.status is not NodeStatus.REACHABLE or cap.cordoned or cap.draining:
        return False
    inventory = cap.inventory
    if not inventory.can_launch(profile.engine):
        return False
    return all(inventory.labels.get(k) == v for k, v in profile.node_selector.items())


def _min_mib(profile: Profile) -> int:
    return math.ceil(profile.gpu_memory_gib * 1024)


def _max_gpus(states: Sequence[NodeFree]) -> int:
    return max((sum(len(g) for g in s.free.values()) for s in states), default=0)
