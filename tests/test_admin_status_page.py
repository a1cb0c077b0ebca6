"""The admin status in pages (`?limit=&after=`) or for chosen nodes (`?node=`), as the
CLI and the fleet page ask for it on a large fleet."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw_core.config import parse_config
from llmgw_core.inventory import Gpu, Inventory
from llmgw_server.control.documents import to_json
from llmgw_server.control.reconciler import Reconciler, random_engine_key
from llmgw_server.control_shell.admin import NodeParts, status_doc, status_page

sys.path.insert(0, str(Path(__file__).parent / "control"))

from fleetsim import FAST, Fleet, catalog, gpu_node, model

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "models": [
        {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
    ],
}


def fleet(names: list[str]) -> Reconciler:
    config = parse_config(CONFIG, "<test>")
    reconciler = Reconciler(
        config.control, config.catalog, now=0.0, instance="t", engine_keys=random_engine_key
    )
    for name in names:
        gpus = (Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),)
        reconciler.register(Inventory(name=name, gpus=gpus), (), 1.0)
    return reconciler


def test_pages_cover_the_fleet_once_in_name_order() -> None:
    reconciler = fleet(["n3", "n0", "n4", "n1", "n2"])
    seen: list[str] = []
    after = ""
    while True:
        chosen, page = status_page(reconciler.node_names(), {"limit": ["2"], "after": [after]})
        assert chosen is not None and page is not None and page.of == 5
        page_view = reconciler.view(chosen)
        assert [n.name for n in page_view.nodes] == chosen and len(chosen) <= 2
        seen += [n.name for n in page_view.nodes]
        if page.next_after is None:
            break
        after = page.next_after
    assert seen == ["n0", "n1", "n2", "n3", "n4"]


def test_chosen_nodes_and_the_whole_fleet() -> None:
    reconciler = fleet(["a", "b", "c"])
    names = reconciler.node_names()
    chosen, page = status_page(names, {"node": ["c", "a", "nope"]})
    assert chosen == ["a", "c"] and page is not None
    assert [n.name for n in reconciler.view(chosen).nodes] == ["a", "c"]
    whole, page = status_page(names, {})
    assert whole is None and page is None
    for bad in ("0", "x", "-3"):
        with pytest.raises(ValueError, match="limit"):
            status_page(names, {"limit": [bad]})


def test_a_page_is_the_whole_status_cut_to_its_nodes() -> None:
    # A page's view is made of its nodes alone, not cut from the whole fleet's: it must
    # hold what the whole view holds for them, replicas in the same order.
    f = Fleet(FAST, catalog(model("a", 3), model("b", 2, tensor_parallel=2)))
    f.join(*(gpu_node(f"n{i}", 2) for i in range(5)))
    f.ready_all()
    whole = f.cp.view()
    assert len(whole.replicas) == 5
    for query in ({"limit": ["2"]}, {"limit": ["2"], "after": ["n1"]}, {"node": ["n4", "n0"]}):
        chosen, _ = status_page(f.cp.node_names(), query)
        assert chosen is not None
        page = f.cp.view(chosen)
        assert page.nodes == tuple(n for n in whole.nodes if n.name in chosen)
        on_page = [r for r in whole.replicas if any(s.node in chosen for s in r.shards)]
        assert page.replicas == tuple(on_page)
        assert page.models == whole.models


def test_kept_node_parts_follow_placement_and_registration() -> None:
    f = Fleet(FAST, catalog(model("a", 0)))
    f.join(gpu_node("n0", 2))
    kept = NodeParts()

    def node_json() -> dict[str, Any]:
        data = to_json(status_doc(f.cp.view(), {}, f.now, kept))
        assert data == to_json(status_doc(f.cp.view(), {}, f.now))  # as if made anew
        node: dict[str, Any] = data["nodes"][0]
        return node

    assert [g["used"] for g in node_json()["gpus"]] == [False, False]
    f.set_catalog(catalog(model("a", 1)))  # one GPU placed
    assert sorted(g["used"] for g in node_json()["gpus"]) == [False, True]
    # A new registration brings a new inventory: its GPUs, not the kept ones.
    f.agents["n0"].inventory = gpu_node("n0", 3)
    f.register("n0")
    assert len(node_json()["gpus"]) == 3
