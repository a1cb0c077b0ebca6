"""The whole system as separate processes: server, agents with simulated GPUs, mock engines
launched through the vLLM adapter's real argument construction."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from fleet import Fleet, wait_until
from llmgw_mock_engine.engine import answer_text

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello fleet"}]


def model(name: str, *, replicas: int = 1, tp: int = 1, pp: int = 1, extra: str = "") -> str:
    return (
        f'\n[[models]]\nname = "{name}"\nreplicas = {replicas}\n[models.profile]\nengine = "vllm"\n'
        f'model = "org/{name}"\ntensor_parallel = {tp}\npipeline_parallel = {pp}\ngpu_memory_gib = 20\n{extra}\n'
    )


def test_agents_register_a_replica_is_placed_and_serves_streams(fleet: Fleet) -> None:
    fleet.server(model("chat"))
    fleet.agent("gpu-1", "node-2xl4.toml")
    fleet.agent("gpu-2", "node-2xl4.toml")
    wait_until(lambda: len(fleet.status()["nodes"]) == 2, what="both agents to register")
    wait_until(lambda: fleet.serving("chat"), what="a ready replica")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: [m.id for m in client.models.list()] == ["chat"], what="the router to follow")
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model="chat", messages=CHAT, stream=True)
        if chunk.choices
    )
    assert len(text.split()) == 16
    node = next(n for n in fleet.status()["nodes"] if any(g["used"] for g in n["gpus"]))
    assert node["status"] == "reachable" and node["fabric"] == {"ib_domain": "pod-a"}
    cli = fleet.cli("status")
    assert cli.returncode == 0, cli.stderr
    assert "gpu-1" in cli.stdout and "gpu-2" in cli.stdout and "chat" in cli.stdout
    assert "yes" in cli.stdout  # the replica serves


def test_two_node_replica_gets_ranks_and_the_heads_address(fleet: Fleet) -> None:
    # 2 x 2 GPUs: does not fit on one 2-GPU node, so TP 2 within each node, PP 2 across two.
    fleet.server(model("big", tp=2, pp=2))
    fleet.agent("gpu-1", "node-2xl4.toml")
    fleet.agent("gpu-2", "node-2xl4.toml")
    fleet.agent("gpu-3", "node-2xl4.toml", fabric="pod-b")
    replica = wait_until(lambda: fleet.serving("big"), what="the two-node replica")[0]
    shards = {s["rank"]: s for s in replica["shards"]}
    assert sorted(shards) == [0, 1]
    assert shards[0]["node"] != shards[1]["node"] and "gpu-3" not in (shards[0]["node"], shards[1]["node"])
    head_log = fleet.agents[shards[0]["node"]].output()
    worker_log = fleet.agents[shards[1]["node"]].output()
    port = replica["url"].rsplit(":", 1)[1]
    assert f"--port {port}" in head_log and "--nnodes 2 --node-rank 0 --master-addr 127.0.0.1" in head_log
    assert "--nnodes 2 --node-rank 1 --master-addr 127.0.0.1" in worker_log and "--headless" in worker_log
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 2" in worker_log
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: client.chat.completions.create(model="big", messages=CHAT).choices, what="traffic")


def test_a_crashing_engine_is_reported_with_its_output_and_restarted(fleet: Fleet) -> None:
    fleet.server(model("flaky"))
    fleet.agent("gpu-1", "node-2xl4.toml", env='LLMGW_MOCK_EXIT_AFTER = "1.5"')
    failed = wait_until(
        lambda: [
            r for r in fleet.status()["replicas"] if r["failures"] >= 1 and r["shards"][0]["output_tail"]
        ],
        what="the crash to be reported with the engine's last lines",
    )[0]
    shard = failed["shards"][0]
    assert "exited with status 3" in shard["detail"]
    assert any("exiting after 1.5 s" in line for line in shard["output_tail"])
    restarted = wait_until(
        lambda: [r for r in fleet.status()["replicas"] if r["attempt"] >= 1 and r["shards"][0]["state"] in ("starting", "ready")],
        what="a restart after the backoff",
    )[0]
    assert restarted["model"] == "flaky"
    assert len(set(fleet.engine_pids())) >= 2  # a new process for the new attempt


def test_a_killed_agent_goes_unreachable_then_lost_and_the_explanation_says_why(fleet: Fleet) -> None:
    fleet.server(model("h100-only", extra='gpu_model = "H100"'))
    fleet.agent("gpu-1", "node-8xh100.toml")
    fleet.agent("gpu-2", "node-2xl4.toml")
    wait_until(lambda: fleet.serving("h100-only"), what="the replica on the H100 node")
    fleet.agents["gpu-1"].signal(signal.SIGKILL)
    wait_until(lambda: fleet.node("gpu-1")["status"] == "unreachable", timeout=5, what="unreachable")
    wait_until(lambda: fleet.node("gpu-1")["status"] == "lost", timeout=10, what="lost")
    why = wait_until(
        lambda: next(m for m in fleet.status()["models"] if m["name"] == "h100-only")["unplaced"],
        what="an explanation",
    )
    text = why["explanation"]
    assert text.startswith("0 of 2 nodes fit: ") and "1 lost (gpu-1)" in text and "gpu-2" in text
    cli = fleet.cli("explain", "h100-only")
    assert cli.returncode == 0 and "1 lost (gpu-1)" in cli.stdout


def test_a_restarted_server_adopts_running_engines_without_restarting_them(fleet: Fleet) -> None:
    models = model("chat", replicas=2)
    server = fleet.server(models)
    fleet.agent("gpu-1", "node-2xl4.toml")
    fleet.agent("gpu-2", "node-2xl4.toml")
    wait_until(lambda: len(fleet.serving("chat")) == 2, what="two ready replicas")
    before = {r["replica_id"]: r["url"] for r in fleet.serving("chat")}
    pids = sorted(fleet.engine_pids())
    server.signal(signal.SIGTERM)
    assert server.popen.wait(10) == 0
    for pid in pids:
        os.kill(pid, 0)  # the engines serve on without the control plane
    fleet.server(models)
    after = wait_until(lambda: {r["replica_id"]: r["url"] for r in fleet.serving("chat")} if len(fleet.serving("chat")) == 2 else None, what="adoption")
    assert after == before
    assert sorted(fleet.engine_pids()) == pids  # nothing was started again
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: client.chat.completions.create(model="chat", messages=CHAT).choices, what="traffic")


class RequestLoop:
    """Requests through the router one after another, from a thread, plain and streamed,
    with a client that never retries: every failure is recorded."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.done = 0
        self.errors: list[str] = []
        self.served_by: set[str] = set()  # the engines' fingerprints, "mock:PORT"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the request loop hangs"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.done % 2:
                    stream = self.client.chat.completions.create(
                        model="chat",
                        messages=CHAT,
                        stream=True,
                    )
                    words = []
                    for chunk in stream:
                        self.served_by.add(chunk.system_fingerprint or "")
                        words += [c.delta.content or "" for c in chunk.choices]
                    assert len("".join(words).split()) == 16, words
                else:
                    answer = self.client.chat.completions.create(model="chat", messages=CHAT)
                    self.served_by.add(answer.system_fingerprint or "")
            except (openai.APIError, AssertionError) as exc:
                self.errors.append(f"request {self.done}: {exc!r}")
            self.done += 1


def test_a_drain_moves_replicas_before_it_stops_them_and_loses_no_request(fleet: Fleet) -> None:
    fleet.server(model("chat", replicas=2))
    # Engines that take a while to load, and answers that take a while to stream: without
    # make-before-break the loop would meet 503s, and a stop before the drain cut streams.
    slow = 'LLMGW_MOCK_STARTUP_DELAY = "1.5", LLMGW_MOCK_TPS = "40"'
    fleet.agent("gpu-1", "node-2xl4.toml", env=slow)
    old = wait_until(
        lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None,
        what="both replicas on gpu-1",
    )
    fleet.agent("gpu-2", "node-2xl4.toml", env=slow)
    wait_until(lambda: fleet.node("gpu-2")["status"] == "reachable", what="gpu-2 to register")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: [m.id for m in client.models.list()] == ["chat"], what="the router to follow")
    with RequestLoop(client) as loop:
        wait_until(lambda: loop.done >= 4, what="requests before the drain")
        drain = fleet.cli("drain", "gpu-1", timeout=60)
        after = loop.done
        wait_until(lambda: loop.done >= after + 4, what="requests after the drain")
    assert drain.returncode == 0, drain.stderr
    assert loop.errors == []
    lines = drain.stdout.splitlines()
    for replica in old:
        rid = replica["replica_id"]
        assert f"{rid} (chat): serves on gpu-1 until its replacement serves" in lines, lines
        assert f"{rid} (chat): stopped, off gpu-1" in lines, lines
    assert len([line for line in lines if line.endswith("replacement on gpu-2: serves")]) == 2
    assert lines[-1] == "gpu-1: drained, no replica left on it"
    new = fleet.serving("chat")
    assert [r["shards"][0]["node"] for r in new] == ["gpu-2", "gpu-2"] and fleet.node("gpu-1")["draining"]
    ports = {"mock:" + r["url"].rsplit(":", 1)[1] for r in old + new}
    assert loop.served_by == ports  # the loop ran on the old replicas, then on the new ones
    # The router sends each engine its key; a request that goes around the router has none.
    direct = httpx.post(
        new[0]["url"] + "/v1/chat/completions", json={"model": "chat", "messages": CHAT}
    )
    assert direct.status_code == 401
    unknown = fleet.cli("cordon", "no-such-node")
    assert unknown.returncode == 1 and "no node 'no-such-node'" in unknown.stderr


def test_a_drain_stops_a_replica_still_streaming_once_drain_timeout_s_has_passed(
    fleet: Fleet,
) -> None:
    """A stream longer than drain_timeout_s (2 s here) on a drained replica: the old
    engine serves it until the timeout, counted from when the replacement serves, and is
    then stopped under it; the log says why, and the client's stream goes on from the
    replacement (issue 39): a drain ends no request."""
    fleet.server(model("chat"))
    slow = 'LLMGW_MOCK_TPS = "50", LLMGW_MOCK_TOKENS = "400"'  # an answer: 8 s
    fleet.agent("gpu-1", "node-2xl4.toml", env=slow)
    (old,) = wait_until(lambda: fleet.serving("chat"), what="the replica on gpu-1")
    fleet.agent("gpu-2", "node-2xl4.toml", env=slow)
    wait_until(lambda: fleet.node("gpu-2")["status"] == "reachable", what="gpu-2 to register")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    chunks: list[float] = []
    words: list[str] = []
    broke: list[str] = []
    started = threading.Event()

    def long_stream() -> None:
        try:
            stream = client.chat.completions.create(
                model="chat", messages=CHAT, max_tokens=400, stream=True
            )
            for chunk in stream:
                chunks.append(time.monotonic())
                words.extend(c.delta.content or "" for c in chunk.choices)
                started.set()
        except openai.APIError as exc:
            broke.append(str(exc))
        finally:
            started.set()

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    assert started.wait(20) and not broke, broke
    drain = fleet.cli("drain", "gpu-1", timeout=60)
    reader.join(40)
    assert drain.returncode == 0, drain.stderr
    assert f"{old['replica_id']} (chat): stopped, off gpu-1" in drain.stdout.splitlines()
    assert fleet.server_proc is not None
    log = fleet.server_proc.output()
    timed_out = f"replica {old['replica_id']}: drain_timeout_s (2 s) passed with requests still"
    assert timed_out in log, log
    # Served past the drain's timeout, whole: the old engine's part, then the new one's.
    assert not broke and not reader.is_alive(), broke
    assert "".join(words) == answer_text({"messages": CHAT}, 400)
    assert chunks[-1] - chunks[0] >= 2.0
    page = httpx.get(fleet.url + "/metrics").text
    assert 'llmgw_stream_migrations_total{model="chat",cause="drain",outcome="continued"} 1' in page, page


@pytest.mark.long
def test_a_stream_on_a_lost_node_goes_on_from_the_other_replica(fleet: Fleet) -> None:
    """The serving node vanishes (its agent killed, its engine stopped mid-answer and
    silent, as a host that loses power): once the control plane declares it lost, the
    router cuts the stream it was reading from there and continues it on the other
    replica, long before read_idle_timeout_s (issue 39)."""
    fleet.server(model("chat", replicas=2), control="spread = true")
    slow = 'LLMGW_MOCK_TPS = "20", LLMGW_MOCK_TOKENS = "300"'  # an answer: 15 s
    agents = {name: fleet.agent(name, "node-2xl4.toml", env=slow) for name in ("gpu-1", "gpu-2")}
    wait_until(lambda: len(fleet.serving("chat")) == 2, what="a replica on each node")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: [m.id for m in client.models.list()] == ["chat"], what="the router to follow")
    words: list[str] = []
    broke: list[str] = []
    started = threading.Event()

    def long_stream() -> None:
        try:
            for chunk in client.chat.completions.create(model="chat", messages=CHAT, stream=True):
                words.extend(c.delta.content or "" for c in chunk.choices)
                started.set()
        except openai.APIError as exc:
            broke.append(str(exc))
        finally:
            started.set()

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    assert started.wait(20) and not broke, broke
    serving = None
    for replica in fleet.serving("chat"):
        page = httpx.get(replica["url"] + "/metrics").text
        running = [line for line in page.splitlines() if line.startswith("vllm:num_requests_running")]
        if any(float(line.rsplit(" ", 1)[1]) > 0 for line in running):
            serving = replica
    assert serving is not None
    node = serving["shards"][0]["node"]
    (engine_pid,) = [
        int(line.rsplit(" ", 1)[1]) for line in agents[node].output().splitlines()
        if ": starting pid " in line
    ]  # fmt: skip
    agents[node].signal(signal.SIGKILL)
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        reader.join(40)
        assert not broke and not reader.is_alive(), broke
        assert "".join(words) == answer_text({"messages": CHAT}, 300)
        assert fleet.node(node)["status"] == "lost"
        page = httpx.get(fleet.url + "/metrics").text
        lost = 'llmgw_stream_migrations_total{model="chat",cause="lost",outcome="continued"} 1'
        assert lost in page, page
    finally:
        os.kill(engine_pid, signal.SIGKILL)
        os.kill(engine_pid, signal.SIGCONT)


def test_a_drain_that_would_take_a_model_offline_is_refused_unless_forced(fleet: Fleet) -> None:
    fleet.server(model("solo"))
    fleet.agent("gpu-1", "node-2xl4.toml")
    (replica,) = wait_until(lambda: fleet.serving("solo"), what="the replica")
    rid = replica["replica_id"]
    refused = fleet.cli("drain", "gpu-1")
    assert refused.returncode == 1 and refused.stdout == ""
    assert (
        f"draining gpu-1 would take replicas offline: replica {rid} of solo fits nowhere else: "
        "there is no other node" in refused.stderr
    )
    assert "--force drains anyway" in refused.stderr
    assert not fleet.node("gpu-1")["draining"] and fleet.serving("solo")
    forced = fleet.cli("drain", "gpu-1", "--force", timeout=60)
    assert forced.returncode == 0, forced.stderr
    lines = forced.stdout.splitlines()
    assert f"{rid} (solo): stopped, off gpu-1" in lines and lines[-1] == "gpu-1: drained, no replica left on it"
    assert fleet.status()["replicas"] == []
    (solo,) = fleet.status()["models"]
    assert solo["unplaced"]["explanation"] == "0 of 1 nodes fit: 1 draining (gpu-1)"
