"""Why a replica cannot be placed, counted the way an operator reads it.

Every node is named once, with the first reason it was passed over, in the
order the checks run (status, flags, engine, labels, GPU model, free GPUs,
memory), so that the counts add up to the fleet:

  0 of 5 nodes fit: 2 unreachable (gpu-3, gpu-4); 2 have too few free GPUs
  (gpu-1 has 2, gpu-2 has 1, need 4); 1 lacks 70 GiB free per GPU (gpu-5: 40 GiB)

For a replica that may span nodes, the node checks are per shard and the nodes
that could hold a shard are counted by fabric domain:

  0 of 4 nodes fit 16 GPUs on one node or as 2 shards of 8 in one fabric domain:
  fabric domain pod-a (gpu-1) has 8 free GPUs of the 16 needed; pod-b (gpu-2, gpu-3) 12
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs

from llmgw_core.catalog import Profile
from llmgw_server.control.capacity import NodeFree
from llmgw_server.control.lifecycle import NodeStatus


@attrs.frozen
class Explanation:
    model: str
    text: str
    fitting: tuple[str, ...]  # nodes that could take one more replica now
    # Every other node, with why it was passed over.
    passed_over: dict[str, str] = attrs.field(hash=False)

    @property
    def placeable(self) -> bool:
        return bool(self.fitting)


# The order in which checks run and in which the text lists the groups.
_KINDS = (
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
)


def explain_free(
    model: str, profile: Profile, states: Sequence[NodeFree], fabric_key: str
) -> Explanation:
    tp, pp, total = profile.tensor_parallel, profile.pipeline_parallel, profile.gpus
    need = tp if pp > 1 else total  # what one node must hold: a shard, or the whole replica
    min_mib = math.ceil(profile.gpu_memory_gib * 1024)
    wanted = (profile.gpu_model or "").lower()
    found: dict[str, list[tuple[str, str]]] = {kind: [] for kind in _KINDS}
    fitting: list[str] = []
    domain_nodes: dict[str, list[str]] = {}
    domain_gpus: dict[str, dict[str, int]] = {}  # domain -> GPU name -> GPUs in whole shards
    for state in states:
        name = state.capacity.name
        kind, detail, usable = _check(state, profile, need, min_mib, wanted)
        if kind is not None:
            found[kind].append((name, detail))
        elif pp == 1 or max(usable.values()) >= total:
            fitting.append(name)
        elif (domain := state.capacity.inventory.fabric.get(fabric_key)) is None:
            found["no_fabric"].append((name, ""))
        else:
            domain_nodes.setdefault(domain, []).append(name)
            per_name = domain_gpus.setdefault(domain, {})
            for gpu_name, count in usable.items():
                if count >= tp:  # one shard per node: each node adds tp GPUs at most
                    per_name[gpu_name] = per_name.get(gpu_name, 0) + tp
    short: dict[str, int] = {}
    for domain, nodes in domain_nodes.items():
        have = max(domain_gpus[domain].values(), default=0)
        if have >= total:
            fitting += nodes
        else:
            short[domain] = have
            found["domain"] += [(n, domain) for n in nodes]
    passed_over = {
        node: _node_reason(kind, detail, profile, need, total, fabric_key, short)
        for kind, items in found.items()
        for node, detail in items
    }
    text = _text(profile, len(states), fitting, found, need, fabric_key, domain_nodes, short)
    return Explanation(model, text, tuple(fitting), passed_over)


def _check(
    state: NodeFree, profile: Profile, need: int, min_mib: int, wanted: str
) -> tuple[str | None, str, dict[str, int]]:
    """The first reason a node cannot hold `need` GPUs, or the usable GPUs by name."""
    cap = state.capacity
    inventory = cap.inventory
    if cap.status is NodeStatus.LOST:
        return "lost", "", {}
    if cap.status is NodeStatus.UNREACHABLE:
        return "unreachable", "", {}
    if cap.cordoned:
        return "cordoned", "", {}
    if cap.draining:
        return "draining", "", {}
    if not inventory.can_launch(profile.engine):
        return "engine", "", {}
    if any(inventory.labels.get(k) != v for k, v in profile.node_selector.items()):
        return "selector", "", {}
    if wanted and not any(wanted in g.name.lower() for g in inventory.gpus):
        return "gpu_model", inventory.gpus[0].name if inventory.gpus else "no GPUs", {}
    free = {n: g for n, g in state.free.items() if not wanted or wanted in n.lower()}
    most = max((len(g) for g in free.values()), default=0)
    if most < need:
        return "few", str(most), {}
    usable = {n: sum(1 for g in gpus if g.memory_free_mib >= min_mib) for n, gpus in free.items()}
    if max(usable.values()) < need:
        offered = max(
            sorted((g.memory_free_mib for g in gpus), reverse=True)[need - 1]
            for gpus in free.values()
            if len(gpus) >= need
        )
        return "memory", _gib(offered), {}
    return None, "", usable


def _node_reason(
    kind: str,
    detail: str,
    profile: Profile,
    need: int,
    total: int,
    fabric_key: str,
    short: dict[str, int],
) -> str:
    if kind in ("lost", "unreachable", "cordoned", "draining"):
        return kind
    return {
        "engine": lambda: f"cannot launch {profile.engine}",
        "selector": lambda: f"does not match node_selector {_selector(profile)}",
        "gpu_model": lambda: f"has no {profile.gpu_model} GPUs ({detail})",
        "few": lambda: f"has {detail} free GPUs, needs {need}",
        "memory": lambda: f"has {detail} GiB free per GPU, needs {profile.gpu_memory_gib:g} GiB",
        "no_fabric": lambda: f"has no {fabric_key} label",
        "domain": lambda: (
            f"its fabric domain {detail} has {short[detail]} free GPUs of the {total} needed"
        ),
    }[kind]()


def _text(
    profile: Profile,
    n_nodes: int,
    fitting: list[str],
    found: dict[str, list[tuple[str, str]]],
    need: int,
    fabric_key: str,
    domain_nodes: dict[str, list[str]],
    short: dict[str, int],
) -> str:
    tp, pp, total = profile.tensor_parallel, profile.pipeline_parallel, profile.gpus
    head = f"{len(fitting)} of {n_nodes} nodes fit"
    if pp > 1:
        head += f" {total} GPUs on one node or as {pp} shards of {tp} in one fabric domain"
    if fitting:
        head += f" ({', '.join(sorted(fitting, key=_natural))})"
    if not n_nodes:
        return f"{head}: no node has registered"
    parts: list[str] = []
    for kind in _KINDS[:-1]:
        items = sorted(found[kind], key=lambda item: _natural(item[0]))
        if items:
            parts.append(_group(kind, items, profile, need, fabric_key))
    if short:
        domains = sorted(short, key=_natural)
        for i, domain in enumerate(domains):
            names = ", ".join(sorted(domain_nodes[domain], key=_natural))
            if i == 0:
                parts.append(
                    f"fabric domain {domain} ({names}) has {short[domain]} free GPUs "
                    f"of the {total} needed"
                )
            else:
                parts.append(f"{domain} ({names}) {short[domain]}")
    return f"{head}: {'; '.join(parts)}" if parts else head


def _group(
    kind: str, items: list[tuple[str, str]], profile: Profile, need: int, fabric_key: str
) -> str:
    k = len(items)
    one = k == 1
    names = ", ".join(node for node, _ in items)
    if kind in ("lost", "unreachable", "cordoned", "draining"):
        return f"{k} {kind} ({names})"
    if kind == "engine":
        return f"{k} cannot launch {profile.engine} ({names})"
    if kind == "selector":
        verb = "does" if one else "do"
        return f"{k} {verb} not match node_selector {_selector(profile)} ({names})"
    has = "has" if one else "have"
    if kind == "gpu_model":
        listed = ", ".join(f"{node}: {gpu}" for node, gpu in items)
        return f"{k} {has} no {profile.gpu_model} GPUs ({listed})"
    if kind == "few":
        listed = ", ".join(f"{node} has {count}" for node, count in items)
        return f"{k} {has} too few free GPUs ({listed}, need {need})"
    if kind == "memory":
        listed = ", ".join(f"{node}: {gib} GiB" for node, gib in items)
        lacks = "lacks" if one else "lack"
        return f"{k} {lacks} {profile.gpu_memory_gib:g} GiB free per GPU ({listed})"
    return f"{k} {has} no {fabric_key} label ({names})"


def _selector(profile: Profile) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(profile.node_selector.items()))


def _gib(mib: int) -> str:
    # Rounded down: saying "70" for 69.99 GiB would contradict "lacks 70 GiB".
    return f"{math.floor(mib / 1024 * 10) / 10:g}"


_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort gpu-2 before gpu-10."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(name) if part
    )
