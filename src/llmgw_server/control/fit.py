"""Does a node fit a profile: the one rule placement, its explanation and the
check of running replicas share, so that they cannot disagree.

`check` runs the checks in the order an explanation lists them (status, flags,
engine, labels, GPU model, free GPUs, memory) and returns either the GPUs the
profile may use on the node or the first reason it cannot, with the data the
explanation prints. A replica of pipeline_parallel > 1 that no single node
holds fits as one shard per node in one group of `shard_groups`.

Pure: nothing here changes a node's free GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal, get_args

import attrs

from llmgw_core.catalog import Profile
from llmgw_core.inventory import Gpu, Inventory
from llmgw_server.control.capacity import NodeFree
from llmgw_server.control.lifecycle import NodeStatus

MisfitKind = Literal[
    "lost",
    "unreachable",
    "cordoned",
    "draining",
    "engine",
    "selector",
    "gpu_model",
    "few",
    "memory",
    "no_fabric",
    "domain",
]

# The order in which checks run and in which an explanation lists the groups. The
# last two are about spanning nodes, decided over a whole fleet, not by `check`.
KINDS: Final[tuple[MisfitKind, ...]] = get_args(MisfitKind)


@attrs.frozen
class Need:
    """What a profile asks of each node that holds it or one shard of it; made once per
    profile so that checking a node costs no arithmetic on the profile."""

    profile: Profile
    per_node: int  # the whole replica, or one shard when it may span nodes
    min_mib: int  # free memory each GPU must have
    gpu_model: str  # lower case; "" takes any GPU

    @classmethod
    def of(cls, profile: Profile) -> Need:
        per_node = profile.tensor_parallel if profile.pipeline_parallel > 1 else profile.gpus
        return cls(
            profile,
            per_node,
            math.ceil(profile.gpu_memory_gib * 1024),
            (profile.gpu_model or "").lower(),
        )


# Misfit and Fits are made for every node on every placement: not frozen, since a
# frozen attrs class takes twice as long to make. Nothing changes them once returned.


@attrs.define
class Misfit:
    """The first reason a node cannot hold `Need.per_node` GPUs."""

    kind: MisfitKind
    gpu_name: str = ""  # gpu_model: the node's first GPU's name ("" for a node without GPUs)
    free: int = 0  # few: the most free GPUs of one name the profile may use
    offered_mib: int = 0  # memory: the best free memory per GPU over per_node GPUs of one name


@attrs.define
class Fits:
    """The node holds `Need.per_node` GPUs."""

    # Its free GPUs the profile may use (model and memory), by GPU name, lowest index
    # first; only names with at least one.
    usable: dict[str, list[Gpu]]
    most: int  # the most of one name: `Need.per_node` or more


_LOST, _UNREACHABLE = Misfit("lost"), Misfit("unreachable")
_CORDONED, _DRAINING = Misfit("cordoned"), Misfit("draining")
_ENGINE, _SELECTOR = Misfit("engine"), Misfit("selector")


def selector_matches(profile: Profile, inventory: Inventory) -> bool:
    return all(inventory.labels.get(k) == v for k, v in profile.node_selector.items())


def gpu_allowed(gpu_model: str, gpu_name: str) -> bool:
    """`gpu_model` lower case, "" for any: a case-insensitive substring of the name."""
    return not gpu_model or gpu_model in gpu_name.lower()


def check(state: NodeFree, need: Need) -> Fits | Misfit:
    """Whether `state` can hold `need.per_node` of its free GPUs now, or the first reason not.

    O(GPUs of the node). Called for every node on every placement: one pass over the
    free GPUs; the reasons that need more are worked out only for a node that misfits."""
    cap = state.capacity
    if cap.status is not NodeStatus.REACHABLE:
        return _LOST if cap.status is NodeStatus.LOST else _UNREACHABLE
    if cap.cordoned:
        return _CORDONED
    if cap.draining:
        return _DRAINING
    profile, inventory = need.profile, cap.inventory
    if not inventory.can_launch(profile.engine):
        return _ENGINE
    if profile.node_selector and not selector_matches(profile, inventory):
        return _SELECTOR
    wanted, min_mib, per_node = need.gpu_model, need.min_mib, need.per_node
    usable: dict[str, list[Gpu]] = {}
    most = 0
    for name, gpus in state.free.items():
        if wanted and wanted not in name.lower():
            continue
        ok = [g for g in gpus if g.memory_free_mib >= min_mib] if min_mib else gpus
        if ok:
            usable[name] = ok
            if len(ok) > most:
                most = len(ok)
    if most >= per_node:
        return Fits(usable, most)
    return _misfit(state, need)


def _misfit(state: NodeFree, need: Need) -> Misfit:
    """Which of the GPU checks a node that passed the others fails, with what it has."""
    wanted, per_node, gpus = need.gpu_model, need.per_node, state.capacity.inventory.gpus
    if wanted and not any(wanted in g.name.lower() for g in gpus):
        return Misfit("gpu_model", gpu_name=gpus[0].name if gpus else "")
    free = [g for name, g in state.free.items() if gpu_allowed(wanted, name)]
    most = max(map(len, free), default=0)
    if most < per_node:
        return Misfit("few", free=most)
    offered = max(
        sorted((g.memory_free_mib for g in gpus), reverse=True)[per_node - 1]
        for gpus in free
        if len(gpus) >= per_node
    )
    return Misfit("memory", offered_mib=offered)


def fabric_domain(state: NodeFree, fabric_key: str) -> str | None:
    return state.capacity.inventory.fabric.get(fabric_key)


def shard_groups(
    fitting: Iterable[tuple[NodeFree, Mapping[str, list[Gpu]]]], need: Need, fabric_key: str
) -> dict[tuple[str, str], list[NodeFree]]:
    """Nodes that could each hold one shard, by fabric domain and GPU name: a replica fits
    across nodes in a group of `pipeline_parallel` or more (`group_fits`).

    `fitting`: nodes that `check` found to fit, each with its `Fits.usable`, in the order
    the groups keep them. Nodes without a domain are left out."""
    tp = need.profile.tensor_parallel
    groups: dict[tuple[str, str], list[NodeFree]] = {}
    for state, usable in fitting:
        domain = fabric_domain(state, fabric_key)
        if domain is None:
            continue
        for name, gpus in usable.items():
            if len(gpus) >= tp:
                groups.setdefault((domain, name), []).append(state)
    return groups


def group_fits(members: Sequence[NodeFree], need: Need) -> bool:
    return len(members) >= need.profile.pipeline_parallel


def runs_within(profile: Profile, inventory: Inventory, gpu_indices: Iterable[int]) -> bool:
    """Whether a shard's node and GPUs still meet the profile's constraints (labels, GPU
    model). Status, engine and free memory are not asked of a running shard: its own
    engine holds the memory, and an unreachable node is the lifecycle's to judge."""
    if not selector_matches(profile, inventory):
        return False
    wanted = (profile.gpu_model or "").lower()
    if not wanted:
        return True
    names: Mapping[int, str] = {g.index: g.name for g in inventory.gpus}
    return all(i in names and gpu_allowed(wanted, names[i]) for i in gpu_indices)
