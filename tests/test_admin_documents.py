"""The admin API's documents: the JSON they make (the wire format the page, the CLI
and scripts read), read back through the same classes, and the fields the fleet page
(ui/app.js) reads, each of which a document must have."""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest

sys.path.insert(0, str(Path(__file__).parent / "control"))

from fleetsim import FAST, Fleet, catalog, gpu_node, model

import status_docs
from llmgw_core.inventory import ShardState
from llmgw_server import admin_cli
from llmgw_server.control.documents import (
    DocumentError,
    ExplainDoc,
    GpuDoc,
    ModelDoc,
    NodeDoc,
    RecentDoc,
    ReplicaDoc,
    ShardDoc,
    StatusDoc,
    TenantLimitDoc,
    from_json,
    to_json,
)
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.shards import Phase
from llmgw_server.control_shell.admin import explain_doc, status_doc, status_page
from llmgw_server.demo import all_serving, placement_lines

APP_JS = Path(__file__).parents[1] / "src" / "llmgw_server" / "ui" / "app.js"


def fleet() -> Fleet:
    """Two nodes, a replica serving and one that failed, and a model that fits nowhere."""
    f = Fleet(FAST, catalog(model("a", 2), model("huge", 1, tensor_parallel=16)))
    f.join(gpu_node("n1", 2, fabric={"ib_domain": "pod-a"}), gpu_node("n2", 2))
    first, second = f.starts()
    f.report(first.node, first.spec.replica_id, 0, ShardState.READY)
    f.report(second.node, second.spec.replica_id, 0, ShardState.FAILED, "exit status 1")
    return f


def test_the_status_json_has_the_fields_it_always_had() -> None:
    f = fleet()
    tails = {("n1", "x", 0): ("not this one",)}
    data = to_json(status_doc(f.cp.view(), tails, f.now))
    assert list(data) == ["nodes", "replicas", "models", "guard"]  # no "page": whole
    assert {tuple(n) for n in data["nodes"]} == {
        (
            "name", "status", "cordoned", "draining", "drain_forced", "last_seen_s_ago",
            "address", "labels", "fabric", "cpus", "memory_mib", "gpus", "engines",
        )
    }  # fmt: skip
    node = next(n for n in data["nodes"] if n["name"] == "n1")
    assert node["status"] == "reachable" and node["fabric"] == {"ib_domain": "pod-a"}
    assert list(node["gpus"][0]) == ["index", "name", "memory_total_mib", "memory_free_mib", "used"]
    assert list(node["engines"][0]) == ["name", "found", "version"]
    assert {tuple(r) for r in data["replicas"]} == {
        (
            "replica_id", "model", "phase", "serving", "kept", "moving", "reason", "url",
            "attempt", "failures", "crash_loop", "restart_in_s", "shards",
        )
    }  # fmt: skip
    phases = sorted((r["phase"], r["serving"]) for r in data["replicas"])
    assert phases == [("failed", False), ("live", True)]
    shard = data["replicas"][0]["shards"][0]
    assert list(shard) == ["node", "rank", "state", "gpus", "detail", "retiring", "output_tail"]
    assert isinstance(shard["gpus"], list) and shard["output_tail"] == []
    models = {m["name"]: m for m in data["models"]}
    assert list(models["a"]) == ["name", "desired", "kept", "unplaced", "autoscale"]
    assert models["a"]["autoscale"] is None  # a fixed replicas count
    assert models["a"]["unplaced"] is None
    unplaced = models["huge"]["unplaced"]
    assert list(unplaced) == ["count", "explanation", "waiting"]
    assert unplaced["count"] == 1 and unplaced["explanation"].startswith("0 of 2 nodes fit")


def test_a_page_says_where_the_next_starts() -> None:
    f = fleet()
    chosen, page = status_page(f.cp.node_names(), {"limit": ["1"]})
    view = f.cp.view(chosen)
    data = to_json(attrs.evolve(status_doc(view, {}, f.now), page=page))
    assert data["page"] == {"nodes": 1, "of": 2, "next_after": "n1"}
    assert from_json(data, StatusDoc).page == page


def test_documents_read_back_as_they_were_made() -> None:
    f = fleet()
    doc = status_doc(f.cp.view(), {}, f.now)
    assert from_json(to_json(doc), StatusDoc) == doc
    why = f.cp.explain("huge")
    assert why is not None
    data = to_json(explain_doc(why))
    assert data["passed_over"] == {
        "n1": "has 0 free GPUs, needs 16",
        "n2": "has 2 free GPUs, needs 16",
    }
    assert from_json(data, ExplainDoc).text == why.text


def test_a_newer_control_planes_fields_are_ignored_and_a_wrong_shape_is_named() -> None:
    data: dict[str, Any] = to_json(status_doc(fleet().cp.view(), {}, 0.0))
    data["replicas"][0]["something_new"] = 1
    data["later"] = {"x": 1}
    assert len(from_json(data, StatusDoc).replicas) == 2
    # An older control plane's status, before drains moved replicas: read as not moving.
    del data["replicas"][0]["moving"], data["nodes"][0]["drain_forced"]
    older = from_json(data, StatusDoc)
    assert not older.replicas[0].moving and not older.nodes[0].drain_forced
    del data["replicas"][0]["phase"]
    with pytest.raises(DocumentError, match=r"StatusDoc.replicas\[0\].phase"):
        from_json(data, StatusDoc)
    with pytest.raises(DocumentError):
        from_json([], StatusDoc)


def test_the_cli_and_the_demo_read_a_fleets_status() -> None:
    f = fleet()
    status = from_json(to_json(status_doc(f.cp.view(), {}, f.now)), StatusDoc)
    text = admin_cli.render_status(status)
    assert "failed" in text and "exit status 1" in text and "0 of 2 nodes fit" in text
    lines = placement_lines(status)
    assert lines[:2] == [
        "  node n1: 2 x NVIDIA H100 80GB HBM3 (simulated), reachable",
        "  node n2: 2 x NVIDIA H100 80GB HBM3 (simulated), reachable",
    ]
    assert any("on one node" in line and "serving" in line for line in lines)
    assert not all_serving(status)
    serving = status_docs.replica("a-1", "a", Phase.LIVE, (), serving=True)
    assert all_serving(status_docs.status([], [serving], [status_docs.model("a")]))
    # The demo's banner waits for every one of its nodes, not only for the replicas.
    one_node = [status_docs.node("n1"), status_docs.node("n2", status=NodeStatus.UNREACHABLE)]
    assert not all_serving(
        status_docs.status(one_node, [serving], [status_docs.model("a")]), ["n1", "n2"]
    )
    assert all_serving(status_docs.status(one_node, [serving], [status_docs.model("a")]), ["n1"])


# -- what the fleet page reads ----------------------------------------------------

# The page's names for documents: nodeRow(n), `for (const g of n.gpus)`, replicaRow(r),
# `for (const s of r.shards)`, outputTail(replicaId, shard), modelRow(m), render's status.
PAGE_NAMES: dict[str, type] = {
    "n": NodeDoc,
    "g": GpuDoc,
    "r": ReplicaDoc,
    "s": ShardDoc,
    "shard": ShardDoc,
    "m": ModelDoc,
    "status": StatusDoc,
    "t": RecentDoc,  # render's `line.recent` (the stream's, beside the status)
    "limit": TenantLimitDoc,  # renderTenants' `status.tenants`
}
# nodeRow's own `status` is a table cell, not the document.
NOT_DOCUMENTS = {"status.append"}
_PATH = re.compile(r"(?<![\w.])(" + "|".join(PAGE_NAMES) + r")((?:\.[A-Za-z_]+)+)")


def _field_type(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls)
    assert name in {f.name for f in attrs.fields(cls)}, f"{cls.__name__} has no field {name!r}"
    tp = hints[name]
    if isinstance(tp, types.UnionType):  # X | None: the page checks for null first
        (tp,) = [t for t in typing.get_args(tp) if t is not type(None)]
    return tp


def page_paths() -> set[str]:
    return {m[0] for m in _PATH.finditer(APP_JS.read_text())} - NOT_DOCUMENTS


def test_every_field_the_page_reads_is_in_the_documents() -> None:
    paths = page_paths()
    # Not vacuous: the page's reads of each document are found.
    assert {
        "n.drain_forced", "n.last_seen_s_ago", "g.memory_free_mib", "r.restart_in_s",
        "s.retiring", "shard.output_tail", "m.unplaced.explanation", "status.guard",
        "t.subject", "limit.shares", "limit.used",
    } <= paths  # fmt: skip
    for path in sorted(paths):
        name, *fields = path.split(".")
        tp: Any = PAGE_NAMES[name]
        for field in fields:
            if not attrs.has(tp):
                break  # a list, map or string: what follows is JavaScript's (.length, .join)
            tp = _field_type(tp, field)


def test_a_field_the_documents_lack_is_caught() -> None:
    with pytest.raises(AssertionError, match="has no field 'draining_forced'"):
        _field_type(NodeDoc, "draining_forced")
