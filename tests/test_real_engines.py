"""The router against the HTTP servers users actually run, with a client that never retries.

uvicorn (vLLM's and SGLang's HTTP server) closes a keep-alive connection idle for 5 s;
llama.cpp's llama-server closes one after every stream and after 5 s idle, and answers
501 for what it was not started to serve. Every request must still succeed, and no
replica may be ejected.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from procs import Proc, Procs, free_port, metric, models_toml
from real_engine import RealEngine

TESTS = Path(__file__).parent
# Idle pauses around the engines' 5 s keep-alive: past it, and right at it, where the
# engine's close and the next request may cross. The pause is the condition under test.
PAUSES_S = (5.5, 5.0)
ROUNDS = len(PAUSES_S) + 1


def uvicorn_engine(procs: Procs) -> Proc:
    port = free_port()
    argv = [
        sys.executable, "-m", "uvicorn", "uvicorn_engine:app", "--app-dir", str(TESTS),
        "--http", "httptools", "--timeout-keep-alive", "5", "--no-access-log",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return procs.engine(argv, port)


def llama_server(procs: Procs, real_engine: RealEngine, *extra: str) -> Proc:
    """One thread: two wait on each other by spinning, twice the CPU per answer (0.3 s
    against 0.5-0.7 s for 8 tokens), taken from the tests that share these two cores."""
    port = free_port()
    argv = [
        str(real_engine.server), "-m", str(real_engine.model), "--alias", "g",
        "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-t", "1", *extra,
    ]  # fmt: skip
    return procs.engine(argv, port, timeout=120)


def routers(procs: Procs, model: str, engine: Proc) -> list[Proc]:
    """One router with the default idle limit, and one that reuses any pooled connection,
    so that engines closing connections under it are met for real."""
    config = models_toml({model: [engine.url]})
    return [
        procs.router(config),
        procs.router(config + "\n[router]\nupstream_idle_s = 3600\n"),
    ]


def client_of(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def one_round(clients: list[openai.OpenAI], model: str) -> int:
    """Plain and streamed chats and completions through every router; the count sent."""
    sent = 0
    for client in clients:
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
        pieces = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=4, stream=True
        )
        assert [c for c in pieces if c.choices and c.choices[0].finish_reason]
        done = client.completions.create(model=model, prompt="One, two,", max_tokens=4)
        assert done.choices[0].text is not None
        stream = client.completions.create(model=model, prompt="A", max_tokens=4, stream=True)
        assert len(list(stream)) >= 1
        sent += 4
    return sent


def concurrent_streams(clients: list[openai.OpenAI], model: str, n: int) -> int:
    def stream(client: openai.OpenAI) -> int:
        chunks = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Go"}], max_tokens=4, stream=True
        )
        return len(list(chunks))

    with ThreadPoolExecutor(n) as pool:
        counts = list(pool.map(stream, [c for c in clients for _ in range(n // len(clients))]))
    assert all(counts)
    return len(counts)


def assert_all_served(router: Proc, model: str, sent: int, **others: int) -> None:
    """Every request answered 200 (or as listed in `others`), none ejected or retried.

    The openai client closes a stream once it has read `data: [DONE]`, which can be
    before the engine's last chunk reaches the router: counted as status 0, client gone.
    """
    text = httpx.get(router.url + "/metrics").text
    counts = {
        line.split('status="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f'llmgw_requests_total{{model="{model}"')
    }
    counts["200"] = counts.get("200", 0) + counts.pop("0", 0)
    assert counts == {"200": sent, **{k: v for k, v in others.items()}}, text
    assert "llmgw_replica_ejections_total{" not in text, text
    assert "llmgw_upstream_retries_total{" not in text, text
    assert metric(text, "llmgw_replica_available", model=model) == 1


def test_uvicorn_closing_idle_connections_fails_nothing(procs: Procs) -> None:
    engine = uvicorn_engine(procs)
    both = routers(procs, "u", engine)
    clients = [client_of(r) for r in both]
    sent = 0
    for i in range(ROUNDS):
        sent += one_round(clients, "u")
        sent += concurrent_streams(clients, "u", 4)
        if i < len(PAUSES_S):
            procs_idle(PAUSES_S[i])
    for router in both:
        assert_all_served(router, "u", sent // 2)


def test_llama_server_streams_idle_pauses_and_501(procs: Procs, real_engine: RealEngine) -> None:
    engine = llama_server(procs, real_engine)
    both = routers(procs, "g", engine)
    clients = [client_of(r) for r in both]
    sent = 0
    for i in range(ROUNDS):
        sent += one_round(clients, "g")
        sent += concurrent_streams(clients, "g", 4)
        for client in clients:  # every stream ends with llama-server closing the connection
            for _ in range(3):
                chunks = client.chat.completions.create(
                    model="g", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
                )
                assert list(chunks)
                sent += 1
        if i < len(PAUSES_S):
            procs_idle(PAUSES_S[i])
    # Not started with --embeddings: the engine's 501 reaches the client as it is, and
    # is the engine's answer, not a sign of a broken replica.
    for client in clients:
        for _ in range(4):
            with pytest.raises(openai.APIStatusError) as caught:
                client.embeddings.create(model="g", input="hello")
            assert caught.value.status_code == 501
            assert "embeddings" in caught.value.message
    assert one_round(clients, "g")
    sent += 4 * len(clients)
    for router in both:
        assert_all_served(router, "g", sent // 2, **{"501": 4})
        assert "501 for g from replica" in router.output()  # every 5xx relayed is logged


def test_models_through_router_with_llama_server(procs: Procs, real_engine: RealEngine) -> None:
    engine = llama_server(procs, real_engine)
    router = procs.router(models_toml({"g": [engine.url]}))
    models = client_of(router).models.list()
    assert [m.id for m in models.data] == ["g"]


def procs_idle(seconds: float) -> None:
    """Leave every connection idle for `seconds`: the engines' keep-alive limit passes."""
    import time

    time.sleep(seconds)


def test_llama_server_behind_every_endpoint_clients_call(
    procs: Procs, real_engine: RealEngine
) -> None:
    """Issue 21 against llama.cpp itself: the Responses API and Anthropic's Messages with
    their own clients, plain and streamed, tokens counted for both; /tokenize relayed;
    rerank and audio, which this llama-server was not started to serve, come back as
    llama-server's own answers, not the router's."""
    import anthropic

    engine = llama_server(procs, real_engine)
    router = procs.router(models_toml({"g": [engine.url]}))
    client = client_of(router)
    answer = client.responses.create(model="g", input="Say hi", max_output_tokens=8)
    assert answer.status == "completed" and answer.output_text is not None
    stream = client.responses.create(model="g", input="Hi", max_output_tokens=4, stream=True)
    events = [e.type for e in stream]
    assert events[0] == "response.created" and events[-1] == "response.completed", events

    claude = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=60)
    ask = {"model": "g", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi"}]}
    message = claude.messages.create(**ask)  # type: ignore[call-overload]
    assert message.type == "message" and message.usage.input_tokens > 0
    with claude.messages.stream(**ask) as events_of:  # type: ignore[arg-type]
        streamed = events_of.get_final_message()
    assert streamed.usage.output_tokens > 0

    tokenize = {"model": "g", "content": "hello world"}
    tokenized = httpx.post(router.url + "/tokenize", json=tokenize, timeout=30)
    assert tokenized.status_code == 200 and tokenized.json()["tokens"], tokenized.text
    rerank = httpx.post(
        router.url + "/v1/rerank", json={"model": "g", "query": "a", "documents": ["b"]}, timeout=30
    )
    assert rerank.status_code == 501 and "--reranking" in rerank.text, rerank.text
    audio = ("a.wav", b"RIFF0000WAVE", "audio/wav")
    url = router.url + "/v1/audio/transcriptions"
    heard = httpx.post(url, data={"model": "g"}, files={"file": audio}, timeout=30)
    # The form reached it whole: llama-server read its model and its file, then refused.
    assert heard.status_code == 501 and "audio input" in heard.text, heard.text

    page = httpx.get(router.url + "/metrics").text
    # Two Responses and two Messages requests each counted their prompt tokens.
    assert metric(page, "llmgw_tokens_total", model="g", kind="prompt") > 0
    assert metric(page, "llmgw_tokens_total", model="g", kind="completion") > 0
