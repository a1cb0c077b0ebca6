"""The mock engine: a real process that takes vLLM's command line."""

from __future__ import annotations

import time

import httpx

from llmgw_core.mock_engine import parse_args
from procs import Procs


def test_accepts_the_vllm_command_line() -> None:
    settings = parse_args(
        [
            "serve", "Qwen/Qwen2.5-7B", "--host", "0.0.0.0", "--port", "8123",
            "--served-model-name", "qwen", "--tensor-parallel-size", "2",
            "--pipeline-parallel-size", "1", "--max-model-len", "4096",
            "--gpu-memory-utilization", "0.9", "--some-future-flag", "x",
        ],
        {"LLMGW_MOCK_TOKENS": "7"},
    )
    assert settings.model == "Qwen/Qwen2.5-7B"
    assert settings.served_model_names == ["qwen"]
    assert (settings.host, settings.port, settings.tokens) == ("0.0.0.0", 8123, 7)


def test_startup_delay_then_ready(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-startup-delay", "1.0", wait=False)
    engine.wait_http("/health", status=503)
    assert httpx.post(engine.url + "/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 503
    engine.wait_http("/health", status=200)
    answer = httpx.post(engine.url + "/v1/completions", json={"model": "m", "prompt": "x"}).json()
    assert answer["choices"][0]["text"]


def test_answers_are_deterministic_and_metrics_use_vllm_names(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "4")
    body = {"model": "m", "messages": [{"role": "user", "content": "same prompt"}]}
    first = httpx.post(engine.url + "/v1/chat/completions", json=body).json()
    second = httpx.post(engine.url + "/v1/chat/completions", json=body).json()
    assert first["choices"] == second["choices"]
    page = httpx.get(engine.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in page


def test_exit_after_leaves_a_line_in_its_output(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-exit-after", "0.5")
    assert engine.popen.wait(10) == 3
    time.sleep(0.1)
    assert "exiting after 0.5 s" in engine.output()
