"""The admin status in pages (`?limit=&after=`) or for chosen nodes (`?node=`), as the
CLI and the fleet page ask for it on a large fleet."""

from __future__ import annotations

import pytest

from llmgw_core.config import parse_config
from llmgw_core.inventory import Gpu, Inventory
from llmgw_server.control.reconciler import Reconciler, random_engine_key
from llmgw_server.control_shell.admin import status_page

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
    view = fleet(["n3", "n0", "n4", "n1", "n2"]).view()
    seen: list[str] = []
    after = ""
    while True:
        page_view, page = status_page(view, {"limit": ["2"], "after": [after]})
        assert page is not None and page.of == 5 and len(page_view.nodes) <= 2
        seen += [n.name for n in page_view.nodes]
        if page.next_after is None:
            break
        after = page.next_after
    assert seen == ["n0", "n1", "n2", "n3", "n4"]


def test_chosen_nodes_and_the_whole_fleet() -> None:
    view = fleet(["a", "b", "c"]).view()
    chosen, page = status_page(view, {"node": ["c", "a", "nope"]})
    assert [n.name for n in chosen.nodes] == ["a", "c"] and page is not None
    whole, page = status_page(view, {})
    assert whole is view and page is None
    for bad in ("0", "x", "-3"):
        with pytest.raises(ValueError, match="limit"):
            status_page(view, {"limit": [bad]})
