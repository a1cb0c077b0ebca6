"""The control plane's metrics (GET /metrics on the control port) and the settle time's
log lines: the pure parts against the simulated fleet, the route's access rule in
process over real sockets, and the page of a real fleet with a node registered."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

sys.path.insert(0, str(Path(__file__).parent / "control"))

from fleetsim import FAST, catalog, gpu_node, model
from fleetsim import Fleet as SimFleet

from fleet import Fleet, wait_until
from llmgw_core.config import Config, parse_config
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import ShardState
from llmgw_core.wire import Ack, Heartbeat, Welcome
from llmgw_http.server import HTTPServer, ServerLimits
from llmgw_server.control.fit import KINDS, MisfitKind
from llmgw_server.control.reconciler import Reconciler
from llmgw_server.control_shell.admin import AdminAPI
from llmgw_server.control_shell.metrics import (
    PLACEMENT_REASONS,
    ControlMetrics,
    PlacementReason,
    message_type,
    placement_reason,
    placement_reasons,
)
from procs import metric

TOKEN = "adm-secret-token"
DIGEST = "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest()


# --- pure: reasons, types, the page from a view ---------------------------------------------


def test_every_reason_an_explanation_gives_has_its_own_label() -> None:
    """The label is the explanation's typed reason, mapped one to one; the words are not
    parsed (they may change freely)."""
    expected: dict[MisfitKind, PlacementReason] = {
        "lost": "lost",
        "unreachable": "unreachable",
        "cordoned": "cordoned",
        "draining": "draining",
        "engine": "engine",
        "selector": "node_selector",
        "gpu_model": "gpu_model",
        "few": "free_gpus",
        "memory": "gpu_memory",
        "no_fabric": "no_fabric_label",
        "domain": "fabric_domain",
    }
    assert set(expected) == set(KINDS)
    for kind, label in expected.items():
        assert placement_reason(kind) == label, kind
        assert label in PLACEMENT_REASONS
    assert len(set(expected.values())) == len(expected)  # no two reasons share a label


def test_the_reasons_counted_are_those_the_explanation_carries() -> None:
    f = SimFleet(FAST, catalog(model("m", 1, node_selector={"zone": "a"}, tensor_parallel=4)))
    f.join(gpu_node("n1", 2), gpu_node("n2", 2, labels={"zone": "a"}), gpu_node("n3", 8))
    f.feed(f.cp.cordon("n3", True, f.now))
    unplaced = f.cp.view().unplaced["m"]
    assert {n: why.reason for n, why in unplaced.explanation.passed_over.items()} == {
        "n1": "selector",
        "n2": "few",
        "n3": "cordoned",
    }
    assert placement_reasons(unplaced) == {"node_selector", "free_gpus", "cordoned"}


def test_message_types_are_the_wire_tags() -> None:
    assert message_type(Heartbeat(1)) == "heartbeat"
    assert message_type(Ack(3)) == "ack"
    assert message_type(Welcome(1, 5.0)) == "welcome"


def page(f: SimFleet, metrics: ControlMetrics | None = None, streams: int = 0) -> str:
    return (metrics or ControlMetrics()).render(f.cp.view(), streams).decode()


def test_the_page_counts_nodes_replicas_and_why_replicas_are_not_placed() -> None:
    f = SimFleet(FAST, catalog(model("small", 1), model("huge", 2, tensor_parallel=8)))
    f.join(gpu_node("n1", 2), gpu_node("n2", 2))
    f.feed(f.cp.cordon("n2", True, f.now))
    text = page(f, streams=2)
    assert metric(text, "llmgw_control_nodes", status="reachable") == 2
    assert metric(text, "llmgw_control_nodes", status="lost") == 0
    assert "llmgw_control_nodes{status=\"lost\"} 0" in text  # every status, zeros too
    assert metric(text, "llmgw_control_nodes_cordoned") == 1
    assert metric(text, "llmgw_control_replicas", model="small", phase="live") == 1
    assert metric(text, "llmgw_control_replicas", model="huge", phase="live") == 0
    assert metric(text, "llmgw_control_replicas_desired", model="huge") == 2
    # Both huge replicas are unplaced: n1 has too few GPUs, n2 is cordoned.
    assert metric(text, "llmgw_control_unplaced_replicas", model="huge", reason="free_gpus") == 2
    assert metric(text, "llmgw_control_unplaced_replicas", model="huge", reason="cordoned") == 2
    assert 'model="small",reason=' not in text
    assert metric(text, "llmgw_agent_streams_open") == 2
    assert metric(text, "llmgw_control_guard_holds") == 0
    # The replica fails: its phase and the crash loop show.
    (start,) = f.starts()
    f.report(start.node, start.spec.replica_id, 0, ShardState.FAILED, "exit status 1")
    text = page(f)
    assert metric(text, "llmgw_control_replicas", model="small", phase="failed") == 1
    assert metric(text, "llmgw_control_replicas", model="small", phase="live") == 0
    assert metric(text, "llmgw_control_replicas_serving", model="small") == 0


def test_no_node_and_the_settle_time_have_their_own_reasons() -> None:
    settle = ControlSection(settle_after_start_s=30.0, reconcile_interval_s=0.0)
    f = SimFleet(settle, catalog(model("m", 1)))
    f.feed(f.cp.tick(f.now))
    assert metric(page(f), "llmgw_control_unplaced_replicas", model="m", reason="waiting") == 1
    f = SimFleet(FAST, catalog(model("m", 1)))
    f.feed(f.cp.tick(f.now))
    assert metric(page(f), "llmgw_control_unplaced_replicas", model="m", reason="no_nodes") == 1


def test_counters_and_the_reconcile_histogram_render() -> None:
    metrics = ControlMetrics()
    metrics.frame_in(Heartbeat(1))
    metrics.frame_in(Heartbeat(2))
    metrics.bad_frame()
    metrics.frame_out(Welcome(1, 5.0))
    metrics.engine_failures["m"] += 2
    metrics.replica_restarts["m"] += 1
    metrics.streams_refused["identity"] += 1
    metrics.reconcile.observe(0.002)
    metrics.reconcile.observe(0.2)
    text = page(SimFleet(FAST, catalog()), metrics)
    assert metric(text, "llmgw_agent_frames_total", direction="in", type="heartbeat") == 2
    assert metric(text, "llmgw_agent_frames_total", direction="in", type="invalid") == 1
    assert metric(text, "llmgw_agent_frames_total", direction="out", type="welcome") == 1
    assert metric(text, "llmgw_engine_failures_total", model="m") == 2
    assert metric(text, "llmgw_replica_restarts_total", model="m") == 1
    assert metric(text, "llmgw_agent_streams_refused_total", reason="identity") == 1
    assert 'llmgw_control_reconcile_seconds_bucket{le="0.005"} 1' in text
    assert 'llmgw_control_reconcile_seconds_bucket{le="+Inf"} 2' in text
    assert "llmgw_control_reconcile_seconds_count 2" in text
    assert "# TYPE llmgw_control_reconcile_seconds histogram" in text


# --- the settle time in the log -------------------------------------------------------------


def test_the_settle_time_is_said_when_it_starts_and_when_it_ends() -> None:
    settle = ControlSection(settle_after_start_s=30.0, reconcile_interval_s=0.0)
    f = SimFleet(settle, catalog(model("m", 1)))
    f.feed(f.cp.tick(f.now))
    f.join(gpu_node("n1", 2))
    assert [n for n in f.notes if "settle" in n] == [
        "no new replica is placed for 30 s after the start (settle_after_start_s = 30), "
        "so that re-registering agents get their engines adopted"
    ]
    assert not f.starts()
    f.advance(29)
    assert not f.starts() and len([n for n in f.notes if "settle" in n]) == 1
    f.advance(2)
    settle_notes = [n for n in f.notes if "settle" in n]
    assert settle_notes[1:] == ["settle time of 30 s over: missing replicas are placed from now on"]
    assert len(f.starts()) == 1
    f.advance(60)
    assert len([n for n in f.notes if "settle" in n]) == 2  # once each, never again


def test_no_settle_time_says_nothing() -> None:
    f = SimFleet(FAST, catalog(model("m", 1)))
    f.join(gpu_node("n1", 2))
    f.advance(10)
    assert not [n for n in f.notes if "settle" in n]


# --- the route: the admin rule, in process over real sockets ---------------------------------


class Streams:
    streams: dict[str, object] = {"n1": object()}


class Plane:
    """What the /metrics route reads of the control plane."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reconciler = Reconciler(config.control, config.catalog, now=0.0, instance="t")
        self.metrics = ControlMetrics()
        self.agents = Streams()


def config(admin: dict[str, Any]) -> Config:
    return parse_config(
        {
            "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
            "models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}],
            "admin": admin,
        },
        "s.toml",
    )


@asynccontextmanager
async def control_port(cfg: Config) -> AsyncIterator[str]:
    server = HTTPServer(AdminAPI(Plane(cfg)).handle, ServerLimits())  # type: ignore[arg-type]  # a fake ControlPlane
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        yield f"http://127.0.0.1:{port}/metrics"
        nursery.cancel_scope.cancel()


async def get(url: str, token: str | None = None, method: str = "GET") -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient() as client:
        return await client.request(method, url, headers=headers)


async def test_metrics_need_the_admin_token_unless_status_is_open() -> None:
    with trio.fail_after(20):
        async with control_port(config({"token_digest": DIGEST})) as url:
            for token in (None, "wrong", DIGEST):
                response = await get(url, token)
                assert response.status_code == 401, token
                assert "admin or metrics token" in response.json()["error"]["message"]
            response = await get(url, TOKEN)
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain")
            assert metric(response.text, "llmgw_agent_streams_open") == 1
            assert (await get(url, TOKEN, "POST")).status_code == 405
        async with control_port(config({"token_digest": DIGEST, "open_status": True})) as url:
            assert (await get(url)).status_code == 200
        async with control_port(config({})) as url:  # no token at all: closed, says why
            response = await get(url)
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "admin_closed"


# --- a real fleet -----------------------------------------------------------------------------


def test_a_real_control_plane_serves_its_metrics(fleet: Fleet) -> None:
    fleet.server(
        '\n[[models]]\nname = "chat"\nreplicas = 1\n[models.profile]\nengine = "vllm"\n'
        'model = "org/chat"\ngpu_memory_gib = 20\n'
    )
    fleet.agent("gpu-1", "node-2xl4.toml")
    wait_until(lambda: fleet.serving("chat"), what="a ready replica")

    def scrape() -> str:
        response = httpx.get(fleet.control + "/metrics", timeout=5, verify=fleet.tls)
        response.raise_for_status()
        return response.text

    text = wait_until(
        lambda: (t := scrape())
        and metric(t, "llmgw_agent_frames_total", direction="in", type="heartbeat") >= 1
        and t,
        what="a heartbeat counted",
    )
    assert metric(text, "llmgw_control_nodes", status="reachable") == 1
    assert metric(text, "llmgw_agent_streams_open") == 1
    assert metric(text, "llmgw_agent_frames_total", direction="in", type="register") == 1
    assert metric(text, "llmgw_agent_frames_total", direction="in", type="shard_update") >= 2
    assert metric(text, "llmgw_agent_frames_total", direction="out", type="welcome") == 1
    assert metric(text, "llmgw_agent_frames_total", direction="out", type="start") == 1
    assert metric(text, "llmgw_control_replicas", model="chat", phase="live") == 1
    assert metric(text, "llmgw_control_replicas_serving", model="chat") == 1
    assert metric(text, "llmgw_control_reconcile_seconds_count") >= 1
    # The agent goes: its stream closes and the node turns unreachable.
    fleet.agents["gpu-1"].stop()
    text = wait_until(
        lambda: (t := scrape()) and metric(t, "llmgw_agent_streams_open") == 0 and t,
        what="the stream to close",
    )
    wait_until(
        lambda: metric(scrape(), "llmgw_control_nodes", status="unreachable") == 1,
        what="the node to turn unreachable",
    )


@pytest.mark.parametrize("reason", PLACEMENT_REASONS)
def test_placement_reasons_are_label_safe(reason: str) -> None:
    assert reason.isidentifier() and reason.islower()


def test_a_crashing_engine_counts_failures_and_restarts(fleet: Fleet) -> None:
    fleet.server(
        '\n[[models]]\nname = "flaky"\nreplicas = 1\n[models.profile]\nengine = "vllm"\n'
        'model = "org/flaky"\ngpu_memory_gib = 20\n'
    )
    fleet.agent("gpu-1", "node-2xl4.toml", env='LLMGW_MOCK_EXIT_AFTER = "1.5"')

    def scrape() -> str:
        response = httpx.get(fleet.control + "/metrics", timeout=5, verify=fleet.tls)
        response.raise_for_status()
        return response.text

    text = wait_until(
        lambda: (t := scrape()) and metric(t, "llmgw_replica_restarts_total", model="flaky") >= 1 and t,
        what="a restart counted",
    )
    assert metric(text, "llmgw_engine_failures_total", model="flaky") >= 1
    assert metric(text, "llmgw_agent_frames_total", direction="out", type="start") >= 2
