"""The mock engine: a real process that takes vLLM's command line."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import trio

from llmgw_mock_engine.engine import answer_text, main, parse_args
from llmgw_mock_engine.scheduler import EngineModel
from procs import Procs, metric


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


def test_takes_vllms_lora_flags_and_refuses_adapters_vllm_could_not_load() -> None:
    settings = parse_args(
        ["serve", "org/m", "--served-model-name", "m", "--enable-lora",
         "--lora-modules", "m-sql=/l/sql", "m-chat=org/chat", "--max-lora-rank", "8"],
        {},
    )  # fmt: skip
    assert settings.lora_modules == {"m-sql": "/l/sql", "m-chat": "org/chat"}
    assert parse_args(["serve", "m"], {}).lora_modules == {}
    for bad in (
        ["--lora-modules", "m-sql=/l"],  # without --enable-lora vLLM cannot load it
        ["--enable-lora", "--lora-modules", "no-path"],
        ["--enable-lora", "--lora-modules", "a=/x,y"],  # vLLM would read it as JSON
        ["--enable-lora", "--lora-modules", "a=/x", "--max-lora-rank", "7"],
    ):
        with pytest.raises(SystemExit):
            parse_args(["serve", "m", *bad], {})


async def test_each_adapter_answers_under_its_name_otherwise_than_its_base_and_is_listed() -> None:
    settings = parse_args(
        ["serve", "org/m", "--served-model-name", "m", "--port", "0", "--mock-tokens", "6",
         "--enable-lora", "--lora-modules", "m-sql=/l/sql"],
        {},
    )  # fmt: skip
    messages = [{"role": "user", "content": "the same prompt"}]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(main, settings)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1") as client:
                answers = {}
                for model in ("m", "m-sql"):
                    body = {"model": model, "messages": messages}
                    got = (await client.post("/chat/completions", json=body)).json()
                    assert got["model"] == model
                    answers[model] = got["choices"][0]["message"]["content"]
                    assert answers[model] == answer_text(body, 6, settings.lora_modules)
                    async with client.stream(
                        "POST", "/chat/completions", json={**body, "stream": True}
                    ) as stream:
                        events = [line async for line in stream.aiter_lines() if line]
                    assert all(json.loads(e[6:])["model"] == model for e in events[:-1])
                assert answers["m"] != answers["m-sql"] and len(answers["m-sql"].split()) == 6
                gone = await client.post("/chat/completions", json={"model": "m-x", "messages": messages})
                assert gone.status_code == 404
                listing = (await client.get("/models")).json()["data"]
                assert [(c["id"], c.get("parent"), c["root"]) for c in listing] == [
                    ("m", None, "org/m"), ("m-sql", "m", "/l/sql")
                ]
            nursery.cancel_scope.cancel()


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


# --------------------------------------------------------------------------- the scheduler model


def test_the_scheduler_model_is_off_by_default_and_its_flags_are_checked() -> None:
    off = parse_args(["serve", "m"], {})
    assert off.engine_model() is None
    on = parse_args(
        ["serve", "m", "--mock-kv-blocks", "100", "--mock-block-size", "8", "--mock-prefill-tps", "500",
         "--mock-max-seqs", "3", "--mock-tokens-per-second", "7"],
        {"LLMGW_MOCK_DECODE_TPS": "0"},
    )
    model = on.engine_model()
    assert model is not None
    assert (model.kv_blocks, model.block_size, model.prefill_tps, model.max_seqs) == (100, 8, 500.0, 3)
    assert model.decode_tps == 7.0  # falls back to --mock-tokens-per-second
    assert parse_args(["serve", "m"], {"LLMGW_MOCK_KV_BLOCKS": "5", "LLMGW_MOCK_DECODE_TPS": "9"}).engine_model() == EngineModel(5, decode_tps=9.0)
    for bad in (["--mock-block-size", "0"], ["--mock-prefill-tps", "0"], ["--mock-max-seqs", "-1"], ["--mock-decode-tps", "nan"]):
        with pytest.raises(SystemExit):
            parse_args(["serve", "m", "--mock-kv-blocks", "10", *bad], {})


def test_model_off_reports_nothing_and_costs_nothing(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "3")
    answer = httpx.post(engine.url + "/v1/completions", json={"model": "m", "prompt": "a b c"})
    assert "x-mock-ttft-ms" not in answer.headers
    assert answer.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    stored = {"stored": 0, "bytes": 0, "dropped": 0}
    assert httpx.get(engine.url + "/mock/stats").json() == {
        "model": None, "requests": [], "stored_responses": stored
    }  # fmt: skip
    assert httpx.post(engine.url + "/mock/reset").status_code == 409
    assert "vllm:prefix_cache_queries_total" not in httpx.get(engine.url + "/metrics").text


def test_a_repeated_prompt_and_the_next_turn_hit_the_prefix_cache(procs: Procs) -> None:
    engine = procs.mock(
        "m", "--mock-kv-blocks", "256", "--mock-block-size", "4", "--mock-prefill-tps", "1000",
        "--mock-decode-tps", "1000", "--mock-tokens", "4",
    )
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(400))}]
    body = {"model": "m", "messages": messages}
    first = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=10)
    again = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=10)
    ttft_first, ttft_again = (float(r.headers["x-mock-ttft-ms"]) for r in (first, again))
    assert ttft_first >= 402.0  # <|user|>, 400 words, <|assistant|> at 1,000 tokens/s
    assert ttft_again < ttft_first / 4
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 400}  # 1 computed
    answer = again.json()["choices"][0]["message"]["content"]
    turn = {
        "model": "m",
        "stream": True,
        "messages": [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "more please"}],
    }
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=turn, timeout=10) as stream:
        assert float(stream.headers["x-mock-ttft-ms"]) < ttft_first / 4
        assert stream.read().endswith(b"data: [DONE]\n\n")
    stats = httpx.get(engine.url + "/mock/stats").json()
    # 402 prompt tokens + 4 answer tokens fill 101 blocks of 4: the answer's block is cached too.
    assert stats["requests"][-1]["cached_tokens"] == 404
    assert [r["completed"] for r in stats["requests"]] == [True, True, True]
    assert [r["output_tokens"] for r in stats["requests"]] == [4, 4, 4]
    page = httpx.get(engine.url + "/metrics").text
    assert metric(page, "vllm:prefix_cache_queries_total", model_name="m") == stats["prefix_cache_queries"] == 402 * 2 + 410
    assert metric(page, "vllm:prefix_cache_hits_total", model_name="m") == stats["prefix_cache_hits"] == 400 + 404
    assert metric(page, "vllm:time_to_first_token_seconds_count", model_name="m") == 3
    assert metric(page, "vllm:time_to_first_token_seconds_bucket", le="0.25", model_name="m") == 2
    assert metric(page, "vllm:cache_config_info", block_size="4", num_gpu_blocks="256") == 1
    # Longer than the whole cache: refused as vLLM refuses it, and the engine serves on.
    huge = httpx.post(engine.url + "/v1/completions", json={"model": "m", "prompt": "x " * 1100})
    assert huge.status_code == 400 and "maximum context length is 1024 tokens" in huge.text
    assert httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200


async def _wait_metrics(client: httpx.AsyncClient, **want: float) -> None:
    with trio.fail_after(10):
        while True:
            page = (await client.get("/metrics")).text
            if all(metric(page, f"vllm:{name}", model_name="m") == value for name, value in want.items()):
                return
            await trio.sleep(0.02)


async def test_a_full_engine_queues_first_come_first_served(procs: Procs) -> None:
    engine = procs.mock(
        "m", "--mock-kv-blocks", "64", "--mock-max-seqs", "1", "--mock-decode-tps", "10",
        "--mock-tokens", "30", "--mock-prefill-tps", "100000",
    )
    answers: dict[str, httpx.Response] = {}
    leaving = trio.CancelScope()

    async def ask(client: httpx.AsyncClient, name: str) -> None:
        body = {"model": "m", "prompt": f"request {name}"}
        answers[name] = await client.post("/v1/completions", json=body)

    async def ask_and_leave(client: httpx.AsyncClient) -> None:
        with leaving:
            await ask(client, "gone")

    async with httpx.AsyncClient(base_url=engine.url, timeout=20) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, client, "a")
            await _wait_metrics(client, num_requests_running=1)
            assert (await client.post("/mock/reset")).status_code == 409  # not while running
            nursery.start_soon(ask, client, "b")
            await _wait_metrics(client, num_requests_running=1, num_requests_waiting=1)
            nursery.start_soon(ask_and_leave, client)
            await _wait_metrics(client, num_requests_running=1, num_requests_waiting=2)
            leaving.cancel()  # this client goes away while it waits: it leaves the queue
            await _wait_metrics(client, num_requests_running=1, num_requests_waiting=1)
        stats = (await client.get("/mock/stats")).json()
        assert sorted(answers) == ["a", "b"]
        assert answers["a"].status_code == answers["b"].status_code == 200
        assert len(stats["requests"]) == 3 and stats["running"] == stats["waiting"] == 0
        a, b, gone = sorted(stats["requests"], key=lambda r: r["id"])  # in arrival order
        assert (a["completed"], gone["completed"], b["completed"]) == (True, False, True)
        assert gone["ttft_s"] is None and gone["queued_s"] is None and gone["output_tokens"] == 0
        # a's whole answer: 30 tokens at 10 tokens/s, the first right away (3 s: time for
        # the requests behind it to queue and one to leave on a loaded machine; with 1 s,
        # a CI run saw a end first). b waited for
        # all of it: it left the queue, and had its first token, only once a had ended,
        # however long after a's start it arrived (a busy machine delays the test's
        # second request; the 50 ms: a's end is read just after b is let in).
        assert a["end"] - a["arrival"] >= 2.85
        assert a["queued_s"] == 0 and b["arrival"] + b["queued_s"] >= a["end"] - 0.05
        assert b["arrival"] + b["ttft_s"] >= a["end"] - 0.05
        assert float(answers["b"].headers["x-mock-ttft-ms"]) == pytest.approx(b["ttft_s"] * 1000, abs=0.01)
        assert a["arrival"] < b["arrival"] < gone["arrival"] < gone["end"] < a["end"] < b["end"]
        assert (await client.post("/mock/reset")).status_code == 200
        after = (await client.get("/mock/stats")).json()
        assert after["requests"] == [] and after["prefix_cache_queries"] == 0
