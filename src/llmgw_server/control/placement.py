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
- Whether a node fits is `fit.check`, the rule the explanation follows too.

Nodes' free GPUs are indexed by how many a profile can use, in buckets, so a
replica is placed in time independent of the fleet's size; the buckets are
rebuilt once per distinct profile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from llmgw_core.catalog import Profile
from llmgw_core.inventory import Gpu
from llmgw_server.control.capacity import NodeCapacity, NodeFree
from llmgw_server.control.explanation import Explanation, explain_free
from llmgw_server.control.fit import Fits, Need, check, group_fits, shard_groups

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
    """The nodes that fit a profile (`fit.check`), bucketed by the most GPUs of one name
    it could use on each; a node that stops fitting leaves the buckets."""

    def __init__(self, profile: Profile, states: Sequence[NodeFree]) -> None:
        self.profile = profile
        self.need = Need.of(profile)
        fitting = [(s, f) for s in states if isinstance(f := check(s, self.need), Fits)]
        size = max((f.most for _, f in fitting), default=0) + 1
        self.buckets: list[dict[NodeFree, None]] = [{} for _ in range(size)]
        self.usable: dict[NodeFree, dict[str, list[Gpu]]] = {}
        self.most: dict[NodeFree, int] = {}  # the bucket each node is in
        for state, fits in fitting:
            self._file(state, fits)

    def _file(self, state: NodeFree, fits: Fits) -> None:
        self.usable[state] = fits.usable
        self.most[state] = fits.most
        self.buckets[fits.most][state] = None

    def refile(self, state: NodeFree) -> None:
        del self.buckets[self.most.pop(state)][state]
        del self.usable[state]
        fits = check(state, self.need)
        if isinstance(fits, Fits):
            self._file(state, fits)

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
    # Every filed node holds a shard's tensor_parallel GPUs of some name. Taken in
    # bucket order (fewest usable GPUs first) so that ties fall the same way every time.
    filed = ((s, cands.usable[s]) for bucket in cands.buckets for s in bucket)
    fitting = [
        (key, members)
        for key, members in shard_groups(filed, cands.need, fabric_key).items()
        if group_fits(members, cands.need)
    ]
    if not fitting:
        return None

    # Best fit takes the smallest domain that fits and, inside it, the fullest
    # nodes; spread takes the largest domain and its emptiest nodes.
    def free_in(key: tuple[str, str], state: NodeFree) -> int:
        return len(cands.usable[state][key[1]])

    def domain_size(item: tuple[tuple[str, str], list[NodeFree]]) -> tuple[int, int]:
        key, members = item
        return (len(members), sum(free_in(key, s) for s in members))

    key, members = (max if spread else min)(fitting, key=domain_size)
    ordered = sorted(members, key=lambda s: -free_in(key, s) if spread else free_in(key, s))
    pp = cands.profile.pipeline_parallel
    return tuple(_take(cands, s, cands.profile.tensor_parallel, key[1]) for s in ordered[:pp])


def _take(
    cands: _Candidates, state: NodeFree, n: int, gpu_name: str | None = None
) -> ShardAssignment:
    usable = cands.usable[state]
    if gpu_name is None:
        gpu_name = max(usable, key=lambda name: (len(usable[name]), name))
    chosen = usable[gpu_name][:n]
    taken = {g.index for g in chosen}
    state.free[gpu_name] = [g for g in state.free[gpu_name] if g.index not in taken]
    cands.refile(state)
    return ShardAssignment(state.capacity.name, tuple(g.index for g in chosen))
