"""What the router makes of each kind of engine answer: relayed, retried, or counted.

Only signs of a broken replica (connect errors, timeouts, broken answers, 500/502/504)
count towards ejection. 4xx and 501 are the engine's answer to this request; 429 and
503 are a live engine asking for a pause, tried on another replica but never counted.
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from procs import Proc, Procs, metric, models_toml

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
TUNING = "\n[router]\neject_after_failures = 2\n"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def control(engine: Proc, **settings: object) -> None:
    httpx.post(engine.url + "/mock/control", json=settings).raise_for_status()


def test_501_is_relayed_never_retried_never_counted(procs: Procs) -> None:
    a = procs.mock("m", "--mock-unsupported", "/v1/embeddings")
    b = procs.mock("m", "--mock-unsupported", "/v1/embeddings")
    router = procs.router(models_toml({"m": [a.url, b.url]}) + TUNING)
    api = client(router.url)
    for _ in range(6):
        with pytest.raises(openai.APIStatusError) as caught:
            api.embeddings.create(model="m", input="hi")
        assert caught.value.status_code == 501
        assert "does not support /v1/embeddings" in caught.value.message
    assert api.chat.completions.create(model="m", messages=MESSAGES).choices
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_requests_total", model="m", status="501") == 6
    assert metric(page, "llmgw_upstream_retries_total", model="m") == 0
    assert "llmgw_replica_ejections_total{" not in page
    assert metric(page, "llmgw_replica_available", model="m", endpoint=a.url) == 1
    assert metric(page, "llmgw_replica_available", model="m", endpoint=b.url) == 1
    assert "501 for m from replica" in router.output()


def test_4xx_is_relayed_as_the_engine_answered(procs: Procs) -> None:
    a = procs.mock("m", "--mock-fail-status", "400")
    b = procs.mock("m", "--mock-fail-status", "400")
    router = procs.router(models_toml({"m": [a.url, b.url]}) + TUNING)
    for _ in range(4):
        response = httpx.post(router.url + "/v1/chat/completions", json={"model": "m"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "mock engine failing as asked"
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_upstream_retries_total", model="m") == 0
    assert "llmgw_replica_ejections_total{" not in page


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_replica_is_passed_over_and_not_ejected(procs: Procs, status: int) -> None:
    busy = procs.mock("m")
    calm = procs.mock("m")
    router = procs.router(models_toml({"m": [busy.url, calm.url]}) + TUNING)
    control(busy, fail_status=status, retry_after=30)
    api = client(router.url)
    seen = [
        api.chat.completions.create(model="m", messages=MESSAGES).system_fingerprint
        for _ in range(6)
    ]
    assert set(seen) == {f"mock:{calm.port}"}
    page = httpx.get(router.url + "/metrics").text
    # Retry-After: 30 keeps it out of the rotation after its first refusal.
    assert metric(page, "llmgw_upstream_retries_total", model="m") == 1
    assert metric(page, "llmgw_replica_available", model="m", endpoint=busy.url) == 1
    assert "llmgw_replica_ejections_total{" not in page


def test_every_replica_busy_relays_the_engine_answer_with_retry_after(procs: Procs) -> None:
    engine = procs.mock("m")
    control(engine, fail_status=429, retry_after=7)
    router = procs.router(models_toml({"m": [engine.url]}) + TUNING)
    for _ in range(3):
        response = httpx.post(router.url + "/v1/chat/completions", json={"model": "m"})
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_replica_available", model="m", endpoint=engine.url) == 1


def test_500_still_ejects(procs: Procs) -> None:
    bad = procs.mock("m", "--mock-fail-status", "500")
    good = procs.mock("m")
    router = procs.router(models_toml({"m": [bad.url, good.url]}) + TUNING)
    api = client(router.url)
    for _ in range(6):
        api.chat.completions.create(model="m", messages=MESSAGES)
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_replica_ejections_total", model="m", endpoint=bad.url) == 1
    assert f"ejected {bad.url} for m" in router.output()


def closes_after_one_stream(port: int) -> bool:
    """Whether the engine ends the connection once a stream is done, as llama-server does."""
    body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    # Well inside the 5 s an idle keep-alive lasts: only a close after the stream ends it.
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while chunk := sock.recv(65536):  # a kept-alive connection times out here
            received += chunk
    return received.endswith(b"0\r\n\r\n") and b"data: [DONE]" in received


def test_an_engine_closing_after_every_stream_fails_nothing(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-close-after-stream")  # as llama-server does
    assert closes_after_one_stream(engine.port)
    router = procs.router(models_toml({"m": [engine.url]}) + "\n[router]\nupstream_idle_s = 3600\n")
    api = client(router.url)
    for _ in range(10):
        chunks = list(api.chat.completions.create(model="m", messages=MESSAGES, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert api.chat.completions.create(model="m", messages=MESSAGES).choices
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_requests_total", model="m", status="200") >= 19
    assert "llmgw_replica_ejections_total{" not in page
    assert "llmgw_upstream_retries_total{" not in page


def test_an_engine_key_is_required_by_the_mock_as_by_vllm(procs: Procs) -> None:
    engine = procs.mock("m", env={"VLLM_API_KEY": "engine-secret"})
    assert httpx.post(engine.url + "/v1/chat/completions", json={"model": "m"}).status_code == 401
    ok = httpx.post(
        engine.url + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES},
        headers={"authorization": "Bearer engine-secret"},
    )
    assert ok.status_code == 200
    assert httpx.get(engine.url + "/health").status_code == 200  # as vLLM: /health is open
