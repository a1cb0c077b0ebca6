"""Why a replica cannot be placed, counted the way an operator reads it: every node
named once, with the first reason it was passed over (`fit.check`, the rule placement
follows), in the order the checks run. The format, with examples, and the tests that
hold it are in docs/control-plane.md, "How the control core decides".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple, assert_never

import attrs

from llmgw_core.catalog import Profile
from llmgw_core.inventory import Gpu
from llmgw_server.control.capacity import NodeFree
from llmgw_server.control.fit import (
    KINDS,
    Misfit,
    MisfitKind,
    Need,
    check,
    fabric_domain,
    group_fits,
    shard_groups,
)


class PassedOver(NamedTuple):
    """Why one node was passed over: the check it failed, and the words for it."""

    reason: MisfitKind  # what metrics count, never parsed back from `text`
    text: str


@attrs.frozen
class Explanation:
    model: str
    text: str
    fitting: tuple[str, ...]  # nodes that could take one more replica now
    # Every other node, with why it was passed over.
    passed_over: dict[str, PassedOver] = attrs.field(hash=False)

    def passed_over_text(self) -> dict[str, str]:
        """Node -> why it was passed over, in words (what the admin API shows)."""
        return {node: why.text for node, why in self.passed_over.items()}

    @property
    def placeable(self) -> bool:
        return bool(self.fitting)


# The order in which checks run and in which the text lists the groups.
_KINDS = KINDS


def explain_free(
    model: str, profile: Profile, states: Sequence[NodeFree], fabric_key: str
) -> Explanation:
    need = Need.of(profile)
    pp, total = profile.pipeline_parallel, profile.gpus
    found: dict[MisfitKind, list[tuple[str, str]]] = {kind: [] for kind in _KINDS}
    fitting: list[str] = []
    shard_holders: list[tuple[NodeFree, dict[str, list[Gpu]]]] = []  # fit one shard only
    domain_nodes: dict[str, list[NodeFree]] = {}
    for state in states:
        name = state.capacity.name
        fit = check(state, need)
        if isinstance(fit, Misfit):
            found[fit.kind].append((name, _detail(fit)))
        elif pp == 1 or fit.most >= total:
            fitting.append(name)
        elif (domain := fabric_domain(state, fabric_key)) is None:
            found["no_fabric"].append((name, ""))
        else:
            shard_holders.append((state, fit.usable))
            domain_nodes.setdefault(domain, []).append(state)
    # A node fits across nodes when a group of its domain and GPU model fits (each node
    # adds one shard of tensor_parallel GPUs); the others count under their domain, with
    # the most GPUs of one model it offers them.
    groups = shard_groups(shard_holders, need, fabric_key)
    grouped = {s for members in groups.values() if group_fits(members, need) for s in members}
    short_nodes: dict[str, list[str]] = {}
    for domain, nodes in domain_nodes.items():
        for state in nodes:
            if state in grouped:
                fitting.append(state.capacity.name)
            else:
                short_nodes.setdefault(domain, []).append(state.capacity.name)
                found["domain"].append((state.capacity.name, domain))
    short: dict[str, int] = {}
    for (domain, _), members in groups.items():
        if domain in short_nodes and not group_fits(members, need):
            short[domain] = max(short.get(domain, 0), len(members) * profile.tensor_parallel)
    passed_over = {
        node: PassedOver(
            kind, _node_reason(kind, detail, profile, need.per_node, total, fabric_key, short)
        )
        for kind, items in found.items()
        for node, detail in items
    }
    text = _text(
        profile, len(states), fitting, found, need.per_node, fabric_key, short_nodes, short
    )
    return Explanation(model, text, tuple(fitting), passed_over)


def _detail(misfit: Misfit) -> str:
    """What the text says of one node passed over: its GPU name, free GPUs or memory."""
    match misfit.kind:
        case "gpu_model":
            return misfit.gpu_name or "no GPUs"
        case "few":
            return str(misfit.free)
        case "memory":
            return _gib(misfit.offered_mib)
        case _:
            return ""


def _node_reason(
    kind: MisfitKind,
    detail: str,
    profile: Profile,
    need: int,
    total: int,
    fabric_key: str,
    short: dict[str, int],
) -> str:
    match kind:
        case "lost" | "unreachable" | "cordoned" | "draining":
            return kind
        case "engine":
            return f"cannot launch {profile.engine}"
        case "selector":
            return f"does not match node_selector {_selector(profile)}"
        case "gpu_model":
            return f"has no {profile.gpu_model} GPUs ({detail})"
        case "few":
            return f"has {detail} free GPUs, needs {need}"
        case "memory":
            return f"has {detail} GiB free per GPU, needs {profile.gpu_memory_gib:g} GiB"
        case "no_fabric":
            return f"has no {fabric_key} label"
        case "domain":
            return f"its fabric domain {detail} has {short[detail]} free GPUs of the {total} needed"
        case _:
            assert_never(kind)


def _text(
    profile: Profile,
    n_nodes: int,
    fitting: list[str],
    found: dict[MisfitKind, list[tuple[str, str]]],
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
        head += f" ({', '.join(sorted(fitting, key=natural))})"
    if not n_nodes:
        return f"{head}: no node has registered"
    parts: list[str] = []
    for kind in _KINDS[:-1]:
        items = sorted(found[kind], key=lambda item: natural(item[0]))
        if items:
            parts.append(_group(kind, items, profile, need, fabric_key))
    if short:
        domains = sorted(short, key=natural)
        for i, domain in enumerate(domains):
            names = ", ".join(sorted(domain_nodes[domain], key=natural))
            if i == 0:
                parts.append(
                    f"fabric domain {domain} ({names}) has {short[domain]} free GPUs "
                    f"of the {total} needed"
                )
            else:
                parts.append(f"{domain} ({names}) {short[domain]}")
    return f"{head}: {'; '.join(parts)}" if parts else head


def _group(
    kind: MisfitKind, items: list[tuple[str, str]], profile: Profile, need: int, fabric_key: str
) -> str:
    k = len(items)
    one = k == 1
    names = ", ".join(node for node, _ in items)
    has = "has" if one else "have"
    match kind:
        case "lost" | "unreachable" | "cordoned" | "draining":
            return f"{k} {kind} ({names})"
        case "engine":
            return f"{k} cannot launch {profile.engine} ({names})"
        case "selector":
            verb = "does" if one else "do"
            return f"{k} {verb} not match node_selector {_selector(profile)} ({names})"
        case "gpu_model":
            listed = ", ".join(f"{node}: {gpu}" for node, gpu in items)
            return f"{k} {has} no {profile.gpu_model} GPUs ({listed})"
        case "few":
            listed = ", ".join(f"{node} has {count}" for node, count in items)
            return f"{k} {has} too few free GPUs ({listed}, need {need})"
        case "memory":
            listed = ", ".join(f"{node}: {gib} GiB" for node, gib in items)
            lacks = "lacks" if one else "lack"
            return f"{k} {lacks} {profile.gpu_memory_gib:g} GiB free per GPU ({listed})"
        case "no_fabric":
            return f"{k} {has} no {fabric_key} label ({names})"
        case "domain":  # told by fabric domain, with the GPUs each domain has (`_text`)
            raise ValueError("fabric domains are not listed as a group of nodes")
        case _:
            assert_never(kind)


def _selector(profile: Profile) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(profile.node_selector.items()))


def _gib(mib: int) -> str:
    # Rounded down: saying "70" for 69.99 GiB would contradict "lacks 70 GiB".
    return f"{math.floor(mib / 1024 * 10) / 10:g}"


_DIGITS = re.compile(r"(\d+)")


def natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort gpu-2 before gpu-10."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(name) if part
    )
