"""Placement and its explanations: examples, then properties over random fleets."""

from __future__ import annotations

from collections import Counter
from typing import Any

from fleetsim import A100, H100, gpu_node, profile
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.catalog import Profile
from llmgw_core.inventory import Inventory
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.placement import NodeCapacity, PlacementRequest, explain, place

UNREACHABLE = NodeStatus.UNREACHABLE


def cap(inventory: Inventory, used: int | set[int] = 0, **kw: Any) -> NodeCapacity:
    taken = set(range(used)) if isinstance(used, int) else used
    return NodeCapacity(inventory, used_gpus=frozenset(taken), **kw)


def requests(p: Profile, n: int, model: str = "m") -> list[PlacementRequest]:
    return [PlacementRequest(f"{model}#{i}", model, p) for i in range(n)]


# -- the explanation texts ------------------------------------------------------------


def test_explains_single_node_misfits_like_the_issue() -> None:
    nodes = [
        cap(gpu_node("gpu-1"), used=6),
        cap(gpu_node("gpu-2"), used=7),
        cap(gpu_node("gpu-3"), status=UNREACHABLE),
        cap(gpu_node("gpu-4"), status=UNREACHABLE),
        cap(gpu_node("gpu-5", free_gib=40)),
    ]
    why = explain("big", profile(tensor_parallel=4, gpu_memory_gib=70), nodes)
    assert why.text == (
        "0 of 5 nodes fit: 2 unreachable (gpu-3, gpu-4); 2 have too few free GPUs "
        "(gpu-1 has 2, gpu-2 has 1, need 4); 1 lacks 70 GiB free per GPU (gpu-5: 40 GiB)"
    )
    assert not why.placeable
    assert {n: (p.reason, p.text) for n, p in why.passed_over.items()} == {
        "gpu-1": ("few", "has 2 free GPUs, needs 4"),
        "gpu-2": ("few", "has 1 free GPUs, needs 4"),
        "gpu-3": ("unreachable", "unreachable"),
        "gpu-4": ("unreachable", "unreachable"),
        "gpu-5": ("memory", "has 40 GiB free per GPU, needs 70 GiB"),
    }
    assert why.passed_over_text() == {
        "gpu-1": "has 2 free GPUs, needs 4",
        "gpu-2": "has 1 free GPUs, needs 4",
        "gpu-3": "unreachable",
        "gpu-4": "unreachable",
        "gpu-5": "has 40 GiB free per GPU, needs 70 GiB",
    }


def test_explains_multi_node_misfits_by_fabric_domain() -> None:
    a, b = {"ib_domain": "pod-a"}, {"ib_domain": "pod-b"}
    nodes = [
        cap(gpu_node("gpu-1", fabric=a), used=4),
        cap(gpu_node("gpu-2", fabric=a), used=4),
        cap(gpu_node("gpu-3", fabric=b), used=4),
        cap(gpu_node("gpu-4", fabric=b), used=2),
        cap(gpu_node("gpu-5", fabric=b)),
        cap(gpu_node("gpu-6", fabric=a), status=UNREACHABLE),
    ]
    p = profile(tensor_parallel=4, pipeline_parallel=4)
    why = explain("huge", p, nodes)
    assert why.text == (
        "0 of 6 nodes fit 16 GPUs on one node or as 4 shards of 4 in one fabric domain: "
        "1 unreachable (gpu-6); fabric domain pod-a (gpu-1, gpu-2) has 8 free GPUs of the "
        "16 needed; pod-b (gpu-3, gpu-4, gpu-5) 12"
    )
    assert why.passed_over["gpu-4"] == (
        "domain",
        "its fabric domain pod-b has 12 free GPUs of the 16 needed",
    )
    assert set(why.passed_over) == {f"gpu-{i}" for i in range(1, 7)}
    assert place(requests(p, 1), nodes).unplaced


def test_explains_every_other_reason_in_check_order() -> None:
    nodes = [
        cap(gpu_node("n1"), status=NodeStatus.LOST),
        cap(gpu_node("n2"), cordoned=True),
        cap(gpu_node("n3"), draining=True),
        cap(gpu_node("n4", engines=("sglang",))),
        cap(gpu_node("n5", labels={"pool": "dev"})),
        cap(gpu_node("n6", labels={"pool": "prod"}, gpu_name=A100)),
        cap(gpu_node("n7", labels={"pool": "prod"}, gpus=0)),
    ]
    p = profile(engine="vllm", gpu_model="H100", node_selector={"pool": "prod"})
    why = explain("m", p, nodes)
    assert why.text == (
        "0 of 7 nodes fit: 1 lost (n1); 1 cordoned (n2); 1 draining (n3); 1 cannot launch vllm "
        "(n4); 1 does not match node_selector pool=prod (n5); 2 have no H100 GPUs "
        "(n6: NVIDIA A100-SXM4-40GB, n7: no GPUs)"
    )


def test_explains_nodes_without_the_fabric_label_and_an_empty_fleet() -> None:
    nodes = [cap(gpu_node("n1", 4)), cap(gpu_node("n2", 4))]
    why = explain("m", profile(tensor_parallel=4, pipeline_parallel=2), nodes)
    assert why.text.endswith(": 2 have no ib_domain label (n1, n2)")
    assert explain("m", profile(), []).text == "0 of 0 nodes fit: no node has registered"


def test_an_explanation_of_a_placeable_model_names_the_fitting_nodes() -> None:
    why = explain("m", profile(tensor_parallel=4), [cap(gpu_node("n1")), cap(gpu_node("n2"), 6)])
    assert why.placeable and why.fitting == ("n1",)
    assert why.text == "1 of 2 nodes fit (n1): 1 has too few free GPUs (n2 has 2, need 4)"


def test_node_names_sort_naturally_and_memory_rounds_down() -> None:
    nodes = [cap(gpu_node(f"gpu-{i}", free_gib=69.99)) for i in (10, 9)]
    why = explain("m", profile(gpu_memory_gib=70), nodes)
    assert why.text == (
        "0 of 2 nodes fit: 2 lack 70 GiB free per GPU (gpu-9: 69.9 GiB, gpu-10: 69.9 GiB)"
    )


# -- placing ------------------------------------------------------------------------


def test_bin_packing_fills_the_fullest_node_and_spread_the_emptiest() -> None:
    nodes = [cap(gpu_node("empty")), cap(gpu_node("half"), used=4), cap(gpu_node("full"), used=7)]
    (packed,) = place(requests(profile(tensor_parallel=2), 1), nodes).assignments
    assert [(s.node, s.gpus) for s in packed.shards] == [("half", (4, 5))]
    (spread,) = place(requests(profile(tensor_parallel=2), 1), nodes, spread=True).assignments
    assert [(s.node, s.gpus) for s in spread.shards] == [("empty", (0, 1))]


def test_largest_replicas_go_first_so_whole_nodes_stay_for_them() -> None:
    nodes = [cap(gpu_node("a")), cap(gpu_node("b"))]
    reqs = requests(profile(tensor_parallel=2), 4, "small") + requests(
        profile(tensor_parallel=8), 1, "big"
    )
    result = place(reqs, nodes)
    assert not result.unplaced
    assert Counter(a.shards[0].node for a in result.assignments) == {"a": 1, "b": 4}


def test_gpus_are_never_shared_and_used_ones_are_skipped() -> None:
    nodes = [cap(gpu_node("a", 4), used={1, 2})]
    result = place(requests(profile(), 3), nodes)
    assert sorted(a.shards[0].gpus for a in result.assignments) == [(0,), (3,)]
    assert len(result.unplaced) == 1
    assert (
        result.explanations["m"].text
        == "0 of 1 nodes fit: 1 has too few free GPUs (a has 0, need 1)"
    )


def test_constraints_select_nodes_and_gpus() -> None:
    nodes = [
        cap(gpu_node("a100", gpu_name=A100)),
        cap(gpu_node("dev", labels={"pool": "dev"})),
        cap(gpu_node("small", free_gib=20, labels={"pool": "prod"})),
        cap(gpu_node("right", labels={"pool": "prod"})),
    ]
    p = profile(gpu_model="h100", node_selector={"pool": "prod"}, gpu_memory_gib=40)
    (a,) = place(requests(p, 1), nodes).assignments
    assert a.shards[0].node == "right"


def test_a_replica_that_fits_one_node_stays_on_one_node() -> None:
    pod = {"ib_domain": "pod-a"}
    nodes = [cap(gpu_node("a", fabric=pod), used=4), cap(gpu_node("b", fabric=pod), used=4)]
    nodes.append(cap(gpu_node("c", fabric=pod)))
    (a,) = place(requests(profile(tensor_parallel=4, pipeline_parallel=2), 1), nodes).assignments
    assert [s.node for s in a.shards] == ["c"] and a.shards[0].gpus == tuple(range(8))


def test_multi_node_stays_in_one_domain_and_one_gpu_model() -> None:
    a, b = {"ib_domain": "pod-a"}, {"ib_domain": "pod-b"}
    nodes = [
        cap(gpu_node("a1", fabric=a), used=4),
        cap(gpu_node("a2", fabric=a, gpu_name=A100), used=4),
        cap(gpu_node("b1", fabric=b), used=4),
        cap(gpu_node("b2", fabric=b), used=5),
        cap(gpu_node("b3", fabric=b), used=4),
    ]
    p = profile(tensor_parallel=4, pipeline_parallel=2)
    (x,) = place(requests(p, 1), nodes).assignments
    assert [s.node for s in x.shards] == ["b1", "b3"]
    assert all(s.gpus == (4, 5, 6, 7) for s in x.shards)


# -- properties ------------------------------------------------------------------------

DOMAINS = {"pod-a": {"ib_domain": "pod-a"}, "pod-b": {"ib_domain": "pod-b"}, "none": {}}


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeCapacity]:
    out = []
    for i in range(draw(st.integers(0, 8))):
        gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
        inventory = gpu_node(
            f"n{i}",
            gpus,
            gpu_name=draw(st.sampled_from([H100, A100])),
            free_gib=draw(st.sampled_from([20, 40, 80])),
            fabric=DOMAINS[draw(st.sampled_from(sorted(DOMAINS)))],
            labels={"pool": draw(st.sampled_from(["prod", "dev"]))},
        )
        used = draw(st.sets(st.integers(0, max(gpus - 1, 0)), max_size=gpus))
        status = draw(st.sampled_from(list(NodeStatus)))
        out.append(cap(inventory, used, status=status, cordoned=draw(st.booleans())))
    return out


profiles = st.builds(
    profile,
    tensor_parallel=st.sampled_from([1, 2, 4, 8]),
    pipeline_parallel=st.sampled_from([1, 1, 2]),
    gpu_memory_gib=st.sampled_from([0, 30, 70]),
    gpu_model=st.sampled_from([None, "H100"]),
    node_selector=st.sampled_from([{}, {"pool": "prod"}]),
)


@settings(max_examples=profile_times(1.5), deadline=None)
@given(
    nodes=fleets(),
    wants=st.lists(st.tuples(profiles, st.integers(1, 4)), max_size=4),
    spread=st.booleans(),
)
def test_placement_properties(
    nodes: list[NodeCapacity], wants: list[tuple[Profile, int]], spread: bool
) -> None:
    reqs = [r for i, (p, n) in enumerate(wants) for r in requests(p, n, f"m{i}")]
    result = place(reqs, nodes, spread=spread)
    by_name = {n.name: n for n in nodes}
    profile_of = {r.model: r.profile for r in reqs}
    taken: set[tuple[str, int]] = set()
    for a in result.assignments:
        p = profile_of[a.model]
        for s in a.shards:
            node = by_name[s.node]
            assert node.status is NodeStatus.REACHABLE and not node.cordoned
            gpus = {g.index: g for g in node.inventory.gpus}
            for i in s.gpus:
                assert i not in node.used_gpus and (s.node, i) not in taken
                taken.add((s.node, i))
                assert gpus[i].memory_free_mib >= p.gpu_memory_gib * 1024
            assert len({gpus[i].name for i in s.gpus}) == 1
        if len(a.shards) == 1:
            assert len(a.shards[0].gpus) == p.gpus
        else:
            assert len(a.shards) == p.pipeline_parallel
            assert all(len(s.gpus) == p.tensor_parallel for s in a.shards)
            assert len({s.node for s in a.shards}) == len(a.shards)
            domains = {by_name[s.node].inventory.fabric.get("ib_domain") for s in a.shards}
            assert len(domains) == 1 and None not in domains
    assert len(result.assignments) + len(result.unplaced) == len(reqs)
    # Every model left short is explained, node by node, and truly fits nowhere now.
    after = [
        cap(
            n.inventory,
            set(n.used_gpus) | {i for node, i in taken if node == n.name},
            status=n.status,
            cordoned=n.cordoned,
        )
        for n in nodes
    ]
    for request in result.unplaced:
        why = result.explanations[request.model]
        assert not why.placeable
        assert set(why.passed_over) == set(by_name)
        assert all(name in why.text for name in by_name)
        assert not place([request], after).assignments
