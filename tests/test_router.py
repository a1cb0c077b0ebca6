"""The router as a real process in front of real mock engines, driven by real clients."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from procs import Proc, Procs, free_port, metric, models_toml

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
CHAT = {"model": "m", "messages": MESSAGES}


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


def wait_until(check: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        # Read before the check, so that one check follows the deadline: a stall of this
        # process (a starved CI machine) past it is not taken for the condition's lateness.
        last = time.monotonic() >= deadline
        if check():
            return
        if last:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_plain_and_streaming_through_openai_client(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "5", "--mock-sse-ping")
    router = procs.router(models_toml({"m": [engine.url]}))
    api = client(router.url)

    answer = api.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content and len(answer.choices[0].message.content.split()) == 5
    assert answer.usage is not None and answer.usage.completion_tokens == 5

    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
        )
        if chunk.choices
    ]
    assert "".join(pieces) == answer.choices[0].message.content

    completion = api.completions.create(model="m", prompt="hi", max_tokens=3)
    assert len(completion.choices[0].text.split()) == 3
    embedding = api.embeddings.create(model="m", input=["a", "b"])
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) == 16
    assert [m.id for m in api.models.list()] == ["m"]


def test_stream_relayed_chunk_by_chunk_with_comments(procs: Procs) -> None:
    engine = procs.mock(
        "m", "--mock-tokens", "6", "--mock-tokens-per-second", "10", "--mock-sse-ping"
    )
    router = procs.router(models_toml({"m": [engine.url]}))
    arrivals = []
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in response.iter_lines():
            if line:
                arrivals.append(time.monotonic())
                lines.append(line)
    assert lines[0] == ": ping"
    assert lines[-1] == "data: [DONE]"
    # 6 tokens at 10/s: if the router buffered the stream, everything would land at once.
    assert arrivals[-1] - arrivals[1] > 0.3


def test_balances_across_two_engines(procs: Procs) -> None:
    a = procs.mock("m")
    b = procs.mock("m")
    router = procs.router(models_toml({"m": [a.url, b.url]}))
    api = client(router.url)
    seen = Counter(
        api.chat.completions.create(model="m", messages=MESSAGES).system_fingerprint
        for _ in range(20)
    )
    assert set(seen) == {f"mock:{a.port}", f"mock:{b.port}"}
    assert min(seen.values()) >= 5


def test_session_affinity_keeps_one_replica(procs: Procs) -> None:
    a = procs.mock("m")
    b = procs.mock("m")
    router = procs.router(models_toml({"m": [a.url, b.url]}))
    for session in ("alice", "bob", "carol"):
        fingerprints = {
            httpx.post(
                router.url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": session}
            ).json()["system_fingerprint"]
            for _ in range(6)
        }
        assert len(fingerprints) == 1


def test_retries_past_a_dead_replica(procs: Procs) -> None:
    live = procs.mock("m")
    dead = f"http://127.0.0.1:{free_port()}"
    router = procs.router(
        models_toml({"m": [dead, live.url]}) + "\n[router]\nhealth_interval_s = 60\n", wait=False
    )
    router.wait_http("/healthz")
    api = client(router.url)
    for _ in range(6):
        assert api.chat.completions.create(model="m", messages=MESSAGES).choices
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_requests_total", model="m", status="200") == 6


def test_ejection_and_recovery(procs: Procs) -> None:
    cooldown_s = 2.0
    good = procs.mock("m")
    flaky = procs.mock("m")
    router = procs.router(
        models_toml({"m": [good.url, flaky.url]})
        + f"\n[router]\neject_after_failures = 2\neject_cooldown_s = {cooldown_s}\nhealth_interval_s = 0.2\n"
    )
    httpx.post(flaky.url + "/mock/control", json={"fail_status": 500})
    api = client(router.url)
    started = time.monotonic()
    for _ in range(8):  # every request succeeds: the 500s are retried on the good replica
        answer = api.chat.completions.create(model="m", messages=MESSAGES)
        assert answer.system_fingerprint == f"mock:{good.port}"
    page = httpx.get(router.url + "/metrics").text
    took = time.monotonic() - started
    # Ejected once per cooldown at most: after each, a probe (its /health is fine) lets
    # the flaky replica back and its next two failures eject it again. Within one
    # cooldown, which these requests take on any but a very busy machine, exactly once,
    # and still out when the page was read.
    ejections = metric(page, "llmgw_replica_ejections_total", model="m", endpoint=flaky.url)
    assert 1 <= ejections <= 1 + took // cooldown_s, (ejections, took)
    out = metric(page, "llmgw_replica_available", model="m", endpoint=flaky.url) == 0
    assert out or took >= cooldown_s, took
    assert metric(page, "llmgw_upstream_retries_total", model="m") >= 2

    httpx.post(flaky.url + "/mock/control", json={"fail_status": 0})
    wait_until(
        lambda: (
            metric(
                httpx.get(router.url + "/metrics").text,
                "llmgw_replica_available",
                model="m",
                endpoint=flaky.url,
            )
            == 1
        ),
        what="the ejected replica to be probed back",
    )
    seen = {
        api.chat.completions.create(model="m", messages=MESSAGES).system_fingerprint
        for _ in range(10)
    }
    assert f"mock:{flaky.port}" in seen


def test_every_replica_failing_returns_the_engine_error(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-fail-status", "500")
    router = procs.router(models_toml({"m": [engine.url]}))
    response = httpx.post(router.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "mock engine failing as asked"


def test_client_disconnect_cancels_upstream(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "1000", "--mock-tokens-per-second", "20")
    router = procs.router(models_toml({"m": [engine.url]}))
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10
    ) as response:
        lines = response.iter_lines()  # kept: a dropped iterator would close the response
        next(lines)
        assert (
            metric(
                httpx.get(engine.url + "/metrics").text, "vllm:num_requests_running", model_name="m"
            )
            == 1
        )
    # The client closed after one line; the engine must stop generating long before its 50 s.
    wait_until(
        lambda: (
            metric(
                httpx.get(engine.url + "/metrics").text, "vllm:num_requests_running", model_name="m"
            )
            == 0
        ),
        timeout=5,
        what="the engine to see the request cancelled",
    )
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_replica_outstanding", model="m", endpoint=engine.url) == 0
    assert metric(page, "llmgw_requests_in_flight", model="m") == 0
    assert "Traceback" not in router.output()  # a client going away is no error


def test_stream_broken_mid_way_ends_with_an_error_event(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "20", "--mock-break-after-chunks", "3")
    router = procs.router(models_toml({"m": [engine.url]}))
    response = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 4
    assert json.loads(events[-1][6:])["error"]["type"] == "upstream_error"
    with pytest.raises(openai.APIError):
        for _ in client(router.url).chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
        ):
            pass


def raw_exchange(port: int, data: bytes, *, pause: float = 0.0, rest: bytes = b"") -> bytes:
    """Send raw bytes (optionally more after a pause) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if pause:
            time.sleep(pause)
            try:
                sock.sendall(rest)
            except OSError:
                pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_bad_input_gets_openai_errors_and_harms_nothing(procs: Procs) -> None:
    import hashlib

    engine = procs.mock("m")
    garbage = procs.mock("g", "--mock-garbage")
    digest = hashlib.sha256(b"sk-right").hexdigest()
    dead = f"http://127.0.0.1:{free_port()}"
    router = procs.router(
        models_toml({"m": [engine.url], "g": [garbage.url], "down": [dead]})
        + f'[auth]\napi_keys = ["sha256:{digest}"]\n',
        server="max_body_bytes = 4096",
    )
    # Timeouts are checked on a router of their own: a 0.5 s body deadline on the
    # router above would turn a slow (loaded) chunked upload into 408, not 413.
    hasty = procs.router(
        models_toml({"m": [engine.url]}), server="header_timeout_s = 0.5\nbody_timeout_s = 0.5"
    )
    url = router.url + "/v1/chat/completions"
    good = {"authorization": "Bearer sk-right"}

    def check(response: httpx.Response, status: int, code: str) -> None:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and error["message"] and error["type"]

    check(httpx.post(url, json=CHAT), 401, "invalid_api_key")
    check(
        httpx.post(url, json=CHAT, headers={"authorization": "Bearer sk-wrong"}),
        401,
        "invalid_api_key",
    )
    check(httpx.post(url, content=b"{not json", headers=good), 400, "bad_request")
    check(httpx.post(url, json=[1, 2], headers=good), 400, "bad_request")
    check(httpx.post(url, json={"messages": []}, headers=good), 404, "not_found")
    check(httpx.post(url, json={**CHAT, "model": "nope"}, headers=good), 404, "not_found")
    check(httpx.post(url, json={**CHAT, "model": "down"}, headers=good), 503, "no_healthy_replica")
    check(httpx.post(url, json={**CHAT, "model": "g"}, headers=good), 502, "bad_gateway")
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    check(httpx.post(url, json=big, headers=good), 413, "request_too_large")
    check(httpx.get(url, headers=good), 405, "method_not_allowed")
    check(httpx.get(router.url + "/nowhere"), 404, "not_found")

    # A chunked body that grows past the limit is cut off with 413 too.
    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b"x" * 1000

    check(httpx.post(url, content=chunks(), headers=good), 413, "request_too_large")

    # Headers that never finish, and a body that trickles in, time out with 408.
    answer = raw_exchange(hasty.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
    answer = raw_exchange(hasty.port, head + b"{", pause=1.0, rest=b"more")
    assert answer.startswith(b"HTTP/1.1 408 ")
    # A request line that is not HTTP gets 400 and a closed connection.
    assert raw_exchange(router.port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")

    # HEAD gets the head alone, on the same keep-alive connection as what follows.
    with httpx.Client() as http:
        headed = http.head(router.url + "/healthz")
        assert headed.status_code == 200 and headed.content == b"" and headed.headers["content-length"]
        assert http.get(router.url + "/healthz").json() == {"status": "ok"}

    # After all that, the router serves the next valid request.
    response = httpx.post(url, json=CHAT, headers=good)
    assert response.status_code == 200 and response.json()["choices"]
    models = httpx.get(router.url + "/v1/models", headers=good).json()
    assert sorted(m["id"] for m in models["data"]) == ["g", "m"]  # "down" has no healthy replica


def test_graceful_shutdown_finishes_the_request_in_flight(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "40", "--mock-tokens-per-second", "10")
    router = procs.router(models_toml({"m": [engine.url]}), server="shutdown_grace_s = 10")
    result: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream(
            "POST", router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=20
        ) as r:
            result["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(
        lambda: metric(router_metrics(router), "llmgw_requests_in_flight", model="m") == 1,
        what="the stream to be in flight",
    )
    router.signal(signal.SIGTERM)
    wait_until(lambda: refuses_connections(router.url), what="the router to stop listening")
    assert reader.is_alive()  # 40 tokens at 10/s: still streaming while the router drains
    reader.join(20)
    assert router.popen.wait(10) == 0
    lines = result["lines"]
    assert isinstance(lines, list) and lines[-1] == "data: [DONE]" and len(lines) == 40 + 3


def router_metrics(router: Proc) -> str:
    return httpx.get(router.url + "/metrics").text


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(url + "/healthz", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_config_errors_exit_2_without_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    cases = {
        '[[models]]\nname = "a"\nendpoints = ["http://x:1"]\n[[models]]\nname = "a"\nendpoints = ["http://y:1"]\n': "models[1].name: duplicates the model name 'a'",
        '[[models]]\nname = "a"\nendpoints = ["http://x:1", "ftp://y"]\n': "models[0].endpoints[1]:",
        '[[models]]\nname = "a"\nendpionts = ["http://x:1"]\n': "models[0].endpionts: is not a known key (did you mean 'endpoints'?)",
        '[server]\nlisten = "nowhere"\n[[models]]\nname = "a"\nendpoints = ["http://x:1"]\n': "server.listen:",
        '[[models]]\nname = "a"\nendpoints = "http://x:1"\n': "models[0].endpoints: must be an array of engine URLs",
        "[[models]\n": "is not valid TOML",
    }
    for i, (text, expected) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "llmgw_server", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, done
        assert expected in done.stderr and str(path) in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_an_engine_that_stalls_after_its_head_is_cut_off(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "5", "--mock-tokens-per-second", "0.2")
    router = procs.router(
        models_toml({"m": [engine.url]}) + "\n[router]\nread_idle_timeout_s = 0.5\n"
    )
    started = time.monotonic()
    response = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=20)
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert time.monotonic() - started < 10  # not the 25 s the engine would take
    error = json.loads(events[-1][6:])["error"]
    assert "sent nothing for 0.5 s" in error["message"]


def test_an_engine_with_no_answer_within_the_first_byte_limit_gets_504(procs: Procs) -> None:
    # A prompt that takes the engine seconds to prefill: the answer's head is that late.
    slow = procs.mock("m", "--mock-kv-blocks", "1000", "--mock-prefill-tps", "1")
    router = procs.router(
        models_toml({"m": [slow.url]}) + "\n[router]\nfirst_byte_timeout_s = 0.5\nretries = 0\n"
    )
    started = time.monotonic()
    response = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=20)
    waited = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert "sent no answer within 0.5 s" in response.json()["error"]["message"]
    assert 0.5 <= waited < 5, waited  # never early; not the engine's seconds either
    # The router goes on serving; the engine, once done with the prompt, is used again.
    assert httpx.get(router.url + "/healthz").status_code == 200


@pytest.mark.parametrize("pipelined", [b"", b"G"])
def test_a_client_gone_before_the_first_byte_cancels_the_engine_request(
    procs: Procs, pipelined: bytes
) -> None:
    # A plain request the engine takes seconds to start answering (a slow prefill): the
    # router writes nothing meanwhile, so only its watch on the client's socket can tell
    # that the client left, and the engine's work is cancelled with the request. Also
    # when the client sent a byte of a next request first, which the router keeps unread.
    engine = procs.mock("m", "--mock-kv-blocks", "1000", "--mock-prefill-tps", "1")
    router = procs.router(models_toml({"m": [engine.url]}))

    def engine_busy() -> float:
        page = httpx.get(engine.url + "/metrics").text
        return sum(
            metric(page, name, model_name="m")
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )

    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}
    body = json.dumps(long_prompt).encode()  # 300 s of prefill at 1 token/s
    with socket.create_connection(("127.0.0.1", router.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b%b" % (len(body), body, pipelined)
        )
        wait_until(lambda: engine_busy() == 1, timeout=5, what="the engine to take the request")
    wait_until(lambda: engine_busy() == 0, timeout=5, what="the engine to see it cancelled")
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_requests_in_flight", model="m") == 0
    assert "Traceback" not in router.output()
