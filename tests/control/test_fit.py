"""The one fit rule: an explanation accounts for every node, and says what placement does.

Fleets here mix what the examples in test_placement.py keep apart: nodes with two GPU
models, GPUs with different free memory, fabric domains of mixed GPU models, every
node status and flag, and engines a node cannot launch.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from fleetsim import A100, H100, gpu_node, profile
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.catalog import Profile
from llmgw_core.inventory import EngineInfo, Gpu, Inventory
from llmgw_server.control.capacity import NodeCapacity, NodeFree
from llmgw_server.control.fit import Fits, Misfit, Need, check, runs_within
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.placement import Explanation, PlacementRequest, explain, place

H100_PCIE = "NVIDIA H100 PCIe"
FREE_MIB = (20 * 1024, 40 * 1024, 70 * 1024, 80 * 1024)


@st.composite
def nodes(draw: st.DrawFn, name: str) -> NodeCapacity:
    """One node: up to 8 GPUs of one or two models, each with its own free memory."""
    models = draw(st.lists(st.sampled_from([H100, A100, H100_PCIE]), max_size=2, unique=True))
    gpus = []
    for index in range(draw(st.sampled_from([0, 1, 2, 4, 8])) if models else 0):
        gpu_name = models[0] if index % 2 == 0 or len(models) == 1 else models[1]
        gpus.append(
            Gpu(index, f"GPU-{name}-{index}", gpu_name, 80 * 1024, draw(st.sampled_from(FREE_MIB)))
        )
    engines = draw(st.sampled_from([("mock",), ("mock", "vllm"), ("sglang",)]))
    domain = draw(st.sampled_from(["pod-a", "pod-b", None]))
    inventory = Inventory(
        name=name,
        address="10.0.0.1",
        labels={"pool": draw(st.sampled_from(["prod", "dev"]))},
        fabric={} if domain is None else {"ib_domain": domain},
        cpus=64,
        memory_mib=512 * 1024,
        gpus=tuple(gpus),
        engines=tuple(EngineInfo(e, True, "1.0") for e in engines),
    )
    used = draw(st.sets(st.sampled_from([g.index for g in gpus]))) if gpus else set()
    return NodeCapacity(
        inventory,
        status=draw(st.sampled_from([NodeStatus.REACHABLE] * 3 + list(NodeStatus))),
        cordoned=draw(st.booleans()) and draw(st.booleans()),
        draining=draw(st.booleans()) and draw(st.booleans()),
        used_gpus=frozenset(used),
    )


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeCapacity]:
    return [draw(nodes(f"n{i}")) for i in range(draw(st.integers(0, 10)))]


profiles = st.builds(
    profile,
    engine=st.sampled_from(["mock", "vllm"]),
    tensor_parallel=st.sampled_from([1, 2, 4, 8]),
    pipeline_parallel=st.sampled_from([1, 1, 2, 3]),
    gpu_memory_gib=st.sampled_from([0, 30, 70]),
    gpu_model=st.sampled_from([None, "H100", "a100", "pcie"]),
    node_selector=st.sampled_from([{}, {"pool": "prod"}]),
)

# "3 unreachable (n1, n2, n4)", "2 have too few free GPUs (n1 has 2, ...)": a count first.
# The fabric domain groups name their nodes in the first parentheses instead.
_COUNTED = re.compile(r"^(\d+) ")
_DOMAIN = re.compile(r"^(?:fabric domain )?\S+ \(([^)]*)\)")


def counts_in_text(why: Explanation) -> tuple[int, int, list[int]]:
    """The text's fitting count, fleet size and the count of each group of nodes passed over."""
    head, _, rest = why.text.partition(": ")
    fit, total = map(int, re.findall(r"^(\d+) of (\d+) nodes fit", head)[0])
    if rest == "no node has registered":
        return fit, total, []
    groups = []
    for part in rest.split("; ") if rest else []:
        counted = _COUNTED.match(part)
        if counted:
            groups.append(int(counted.group(1)))
        else:
            domain = _DOMAIN.match(part)
            assert domain, part
            groups.append(len(domain.group(1).split(", ")))
    return fit, total, groups


def one(p: Profile) -> list[PlacementRequest]:
    return [PlacementRequest("m#0", "m", p)]


def placed_nodes(p: Profile, fleet: list[NodeCapacity], spread: bool) -> set[str] | None:
    result = place(one(p), fleet, spread=spread)
    if not result.assignments:
        return None
    (assignment,) = result.assignments
    return {s.node for s in assignment.shards}


@settings(max_examples=profile_times(4), deadline=None)
@given(fleet=fleets(), p=profiles, spread=st.booleans())
@example(
    # A domain whose H100 nodes fit two shards beside an A100 node that does not.
    fleet=[
        NodeCapacity(gpu_node(n, 4, gpu_name=g, fabric={"ib_domain": "pod-a"}))
        for n, g in (("a1", H100), ("a2", H100), ("a3", A100))
    ],
    p=profile(tensor_parallel=4, pipeline_parallel=2),
    spread=False,
)
def test_the_explanation_adds_up_to_the_fleet_and_agrees_with_placement(
    fleet: list[NodeCapacity], p: Profile, spread: bool
) -> None:
    why = explain("m", p, fleet)
    names = {n.name for n in fleet}

    # Every node is counted once: fitting, or passed over with one reason.
    assert len(why.fitting) == len(set(why.fitting))
    assert set(why.fitting) | set(why.passed_over) == names
    assert not set(why.fitting) & set(why.passed_over)
    fit, total, groups = counts_in_text(why)
    assert (fit, total) == (len(why.fitting), len(fleet))
    assert fit + sum(groups) == total
    assert why.placeable == bool(why.fitting)

    # Each node's own reason is the one the rule gives it.
    need = Need.of(p)
    for node in fleet:
        verdict = check(NodeFree(node), need)
        reason = why.passed_over.get(node.name)
        if isinstance(verdict, Misfit):
            assert reason is not None and reason.reason == verdict.kind, (node.name, verdict)
        else:
            assert reason is None or reason.reason in ("domain", "no_fabric")
            assert reason is None or reason.text.startswith(
                ("its fabric domain ", "has no ib_domain")
            )

    # Placement does what the explanation says, on the fleet and on its parts.
    used = placed_nodes(p, fleet, spread)
    assert why.placeable == (used is not None)
    if used is not None:
        assert used <= set(why.fitting)
    fitting = [n for n in fleet if n.name in why.fitting]
    passed_over = [n for n in fleet if n.name not in why.fitting]
    assert (placed_nodes(p, fitting, spread) is not None) == why.placeable
    assert placed_nodes(p, passed_over, spread) is None
    for node in passed_over:
        assert placed_nodes(p, [node], spread) is None
    for node in fitting:
        # A fitting node takes the replica alone, or a shard of it beside other fitting
        # nodes of its domain: with exactly pipeline_parallel nodes, every one is used.
        if placed_nodes(p, [node], spread) == {node.name}:
            continue
        domain = node.inventory.fabric.get("ib_domain")
        peers = [
            n for n in fitting if n is not node and n.inventory.fabric.get("ib_domain") == domain
        ]
        assert p.pipeline_parallel > 1 and domain is not None, node.name
        assert any(
            placed_nodes(p, [node, *others], spread) is not None
            for others in itertools.combinations(peers, p.pipeline_parallel - 1)
        ), node.name


@settings(max_examples=profile_times(2), deadline=None)
@given(fleet=fleets(), wants=st.lists(st.tuples(profiles, st.integers(1, 3)), max_size=3))
def test_a_model_left_unplaced_is_explained_as_fitting_nowhere(
    fleet: list[NodeCapacity], wants: list[tuple[Profile, int]]
) -> None:
    """Against the fleet as placement leaves it: placement stops only where nothing fits."""
    reqs = [
        PlacementRequest(f"m{i}#{k}", f"m{i}", p)
        for i, (p, n) in enumerate(wants)
        for k in range(n)
    ]
    result = place(reqs, fleet)
    for request in result.unplaced:
        why = result.explanations[request.model]
        assert not why.placeable
        assert set(why.passed_over) == {n.name for n in fleet}


def test_check_reports_the_first_reason_with_what_the_node_has() -> None:
    def verdict(inventory: Inventory, p: Profile, **kw: Any) -> Fits | Misfit:
        return check(NodeFree(NodeCapacity(inventory, **kw)), Need.of(p))

    assert verdict(gpu_node("n", 8), profile(tensor_parallel=4), status=NodeStatus.LOST) == Misfit(
        "lost"
    )
    # Cordoned is found before the engine, as the explanation lists them.
    assert verdict(gpu_node("n", engines=()), profile(), cordoned=True) == Misfit("cordoned")
    assert verdict(gpu_node("n", gpu_name=A100), profile(gpu_model="h100")) == Misfit(
        "gpu_model", gpu_name=A100
    )
    assert verdict(gpu_node("n", 0), profile(gpu_model="h100")) == Misfit("gpu_model")
    assert verdict(gpu_node("n", 8), profile(tensor_parallel=4), used_gpus=frozenset(range(6))) == (
        Misfit("few", free=2)
    )
    assert verdict(gpu_node("n", free_gib=40), profile(gpu_memory_gib=70)) == Misfit(
        "memory", offered_mib=40 * 1024
    )
    fits = verdict(gpu_node("n", 4), profile(tensor_parallel=2), used_gpus=frozenset({0}))
    assert isinstance(fits, Fits) and fits.most == 3
    assert [g.index for g in fits.usable[H100]] == [1, 2, 3]
    # A replica that may span nodes needs one shard's GPUs of a node.
    assert isinstance(
        verdict(gpu_node("n", 4), profile(tensor_parallel=4, pipeline_parallel=2)), Fits
    )


def test_a_running_shard_is_held_to_labels_and_gpu_model_only() -> None:
    node = gpu_node("n", 4, labels={"pool": "prod"}, free_gib=1)
    p = profile(gpu_model="H100", node_selector={"pool": "prod"}, gpu_memory_gib=70)
    assert runs_within(p, node, (0, 1))  # its own engine holds the memory
    assert not runs_within(p, node, (0, 7))  # no GPU 7 on that node
    assert not runs_within(profile(node_selector={"pool": "dev"}), node, (0,))
    assert not runs_within(profile(gpu_model="a100"), node, (0,))
    assert runs_within(profile(), gpu_node("m", 1, gpu_name=A100), (0,))
