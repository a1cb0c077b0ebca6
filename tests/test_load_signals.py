"""Engine load signals: the pure parser on each engine's page, and the router reading them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw_core.catalog import Endpoint
from llmgw_core.config import parse_config
from llmgw_server.router.front import Router
from llmgw_server.router.health import probe_forever, read_load_forever
from llmgw_server.router.load_signals import LoadSignal, parse_load
from procs import Procs, free_port

SAMPLES = Path(__file__).parent / "engine_metrics"


def test_llamacpp_real_page() -> None:
    page = (SAMPLES / "llamacpp-0c1e570-busy.prom").read_text()
    assert parse_load(page) == LoadSignal(engine="llamacpp", running=1, waiting=2, kv_usage=None)


def test_vllm_data_parallel_engines_add_up_and_the_fullest_cache_counts() -> None:
    page = (SAMPLES / "vllm-dp2.prom").read_text()
    # kv_cache_usage_perc wins over the deprecated gpu_cache_usage_perc (0.9).
    assert parse_load(page) == LoadSignal(engine="vllm", running=5, waiting=1, kv_usage=0.5)


def test_vllm_before_0_9_has_only_the_old_cache_name() -> None:
    page = "\n".join(
        line
        for line in (SAMPLES / "vllm-dp2.prom").read_text().splitlines()
        if not line.startswith("vllm:kv_cache_usage_perc")
    )
    signal = parse_load(page)
    assert signal is not None and signal.kv_usage == 0.9


def test_sglang_tensor_parallel_ranks_are_not_counted_twice() -> None:
    page = (SAMPLES / "sglang-tp2.prom").read_text()
    assert parse_load(page) == LoadSignal(engine="sglang", running=7, waiting=2, kv_usage=0.41)


def test_sglang_data_parallel_ranks_add_up() -> None:
    page = (
        'sglang:num_running_reqs{dp_rank="0",model_name="q",tp_rank="0"} 3\n'
        'sglang:num_running_reqs{dp_rank="1",model_name="q",tp_rank="0"} 4\n'
        'sglang:num_queue_reqs{dp_rank="1",model_name="q",tp_rank="0"} 1 1700000000000\n'
    )
    assert parse_load(page) == LoadSignal(engine="sglang", running=7, waiting=1)


@pytest.mark.parametrize(
    "page",
    [
        "",
        "# HELP nothing here\n",
        "llamacpp:prompt_tokens_total 25\n",  # counters only: no load
        'vllm:num_requests_running{model_name="m"} NaN\n',
        'vllm:num_requests_running{model_name="m"} -1\n',
        'vllm:num_requests_running{model_name="m"} many\n',
        'vllm:num_requests_running{model_name="m"\n',
        "vllm:num_requests_running\n",
        "<html>not metrics</html>",
    ],
)
def test_pages_without_a_load_we_know(page: str) -> None:
    assert parse_load(page) is None


def test_a_label_value_with_braces_and_spaces() -> None:
    page = 'vllm:num_requests_running{model_name="a} b {c",engine="0"} 2.0\n'
    assert parse_load(page) == LoadSignal(engine="vllm", running=2, waiting=0)


def test_usage_is_capped_at_one() -> None:
    page = "sglang:num_running_reqs 1\nsglang:token_usage 1.7\n"
    signal = parse_load(page)
    assert signal is not None and signal.kv_usage == 1.0


@given(st.text())
def test_any_text_parses_or_gives_none(page: str) -> None:
    signal = parse_load(page)
    if signal is not None:
        assert signal.running >= 0 and signal.waiting >= 0
        assert math.isfinite(signal.running) and math.isfinite(signal.waiting)
        assert signal.kv_usage is None or 0 <= signal.kv_usage <= 1


def router_for(
    endpoint: Endpoint, interval: float = 0.05, balancing: str = "cache_aware"
) -> Router:
    config = parse_config(
        {
            "router": {
                "balancing": balancing,
                "health_interval_s": 0.1,
                "cache_aware": {"metrics_interval_s": interval},
            },
            "models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"]}],
        },
        "test.toml",
    )
    router = Router(config)
    router.served.set_endpoints("m", [endpoint])
    return router


async def read_until(router: Router, check: Any, timeout: float = 20.0) -> None:
    async with httpx.AsyncClient(timeout=2) as client, trio.open_nursery() as nursery:
        nursery.start_soon(read_load_forever, router, client)
        with trio.fail_after(timeout):
            while not check():
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()


def test_the_router_reads_the_real_llama_server_with_its_key(
    procs: Procs, real_engine: Any
) -> None:
    port = free_port()
    key = "sk-engine-load-test"
    argv = [
        str(real_engine.server), "-m", str(real_engine.model), "--host", "127.0.0.1",
        "--port", str(port), "--metrics", "-c", "2048", "-t", "1", "--api-key", key,
    ]  # fmt: skip
    procs.engine(argv, port)
    # Without the key llama-server refuses /metrics: counted, never used.
    keyless = router_for(Endpoint("127.0.0.1", port))
    trio.run(read_until, keyless, lambda: keyless.metrics.engine_errors[f"http://127.0.0.1:{port}"])
    (replica,) = keyless.served.balancers["m"].replicas
    assert replica.engine_load is None

    router = router_for(Endpoint("127.0.0.1", port, api_key=key))
    (replica,) = router.served.balancers["m"].replicas
    trio.run(read_until, router, lambda: replica.engine_load is not None)
    assert replica.engine_load == LoadSignal(engine="llamacpp", running=0, waiting=0)
    assert not router.metrics.engine_errors


def test_an_engine_without_metrics_leaves_the_router_on_its_own_counts(procs: Procs) -> None:
    engine = procs.mock("m")
    # The mock's /metrics answers; a path prefix that leads nowhere gives 404 for it.
    router = router_for(Endpoint("127.0.0.1", engine.port, prefix="/nowhere"))
    trio.run(read_until, router, lambda: router.metrics.engine_errors)
    (replica,) = router.served.balancers["m"].replicas
    assert replica.engine_load is None


@pytest.mark.parametrize("balancing", ["round_robin", "least_outstanding", "cache_aware"])
async def test_only_the_cache_aware_policy_reads_engine_load(balancing: str) -> None:
    asked: list[bytes] = []  # the paths asked for, in order

    async def engine(stream: trio.SocketStream) -> None:
        async with stream:
            data = await stream.receive_some(65536)
            asked.append(data.split(b" ", 2)[1])
            body = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            await stream.send_all(head % len(body) + body)

    with trio.fail_after(20):
        # The client outlives the nursery: the probes are cancelled before it closes (the
        # other way round, a probe could still send through a closed client).
        async with httpx.AsyncClient(timeout=2) as client, trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, engine, 0)
            port = listeners[0].socket.getsockname()[1]
            router = router_for(Endpoint("127.0.0.1", port), 0.02, balancing)
            nursery.start_soon(probe_forever, router, client)
            while asked.count(b"/health") < 3:  # three health rounds: many load intervals
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert (b"/metrics" in asked) == (balancing == "cache_aware"), asked
