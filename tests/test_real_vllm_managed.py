"""A managed replica on real vLLM (CPU): the control plane places the tiny Llama on an
agent with a simulated inventory, and the agent runs vLLM through the adapter's own
`vllm serve MODEL ...` command line (tests/real_vllm.py's launcher in place of `vllm`).

One test walks the replica's life, since each start of vLLM costs a minute or more on
two cores (seven starts in all): the exact command line and the engine key in its
environment only, a direct request without the key refused, a streamed chat through the
router with a client that never retries, the profile's LoRA adapter answering under its
own name otherwise than the base, a restarted agent adopting the engine with its
PID, five SIGKILLs of the API server, each reported and restarted, leaving nothing of
the killed engines in /dev/shm (vLLM's processes share memory there: two segments and a
semaphore, which its resource tracker removes only when it is not killed first), and a
drain that moves the replica to a second node make-before-break while a client that
never retries keeps asking.

Collected by every run (make test and CI); it fails, never skips, without the vLLM cache.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import openai

from fleet import Fleet, wait_until
from real_vllm import RealVllm, serving_env
from test_llamacpp_managed import chat_streamed, cmdline, engine_pid, environ, running, start_agent

MODEL = "tiny"
ADAPTER = "tiny-lora"  # the tiny model's LoRA adapter (tests/tiny_llama.py), a model of its own
KV_CACHE_BYTES = 64 * 1024 * 1024
ENGINE_UP_S = 420.0  # 35-143 s seen on this machine; a loaded one takes longer
PACE_S = 0.5  # between the chat loop's requests
PROFILE_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))


def models(model: Path, lora: Path) -> str:
    args = ", ".join(f'"{a}"' for a in PROFILE_ARGS)
    return (
        f'\n[[models]]\nname = "{MODEL}"\n[models.profile]\nengine = "vllm"\n'
        f'model = "{model}"\nmax_model_len = 2048\nmax_lora_rank = 8\nargs = [{args}]\n'
        f'[[models.profile.lora]]\nname = "{ADAPTER}"\npath = "{lora}"\n'
    )


def chat_plain(fleet: Fleet, model: str) -> str:
    """The same chat for the base and its adapter: greedy, a fixed number of tokens."""
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=8,
        temperature=0,
        extra_body={"min_tokens": 8, "ignore_eos": True},  # vLLM's: all 8 tokens, always
    )
    assert answer.model == model, answer  # vLLM answers under the adapter's own name
    assert answer.usage is not None and answer.usage.completion_tokens == 8, answer.usage
    return answer.choices[0].message.content or ""


def serving(fleet: Fleet, attempt: int = 0) -> dict[str, Any] | None:
    return next((r for r in fleet.serving(MODEL) if r["attempt"] >= attempt), None)


def shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def held(pgid: int) -> set[str]:
    """What the processes of one engine's group map from /dev/shm (its segments and
    semaphores): an engine's own, told apart from another test's vLLM running beside it."""
    names: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            maps = Path(f"/proc/{entry}/maps").read_text()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1]
            if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                names.add(path.removeprefix("/dev/shm/"))
    return names


def test_a_managed_vllm(fleet: Fleet, real_vllm: RealVllm, tmp_path: Path) -> None:
    fleet.server(models(real_vllm.model, real_vllm.lora))
    env = ", ".join(f"{k} = {json.dumps(v)}" for k, v in serving_env(tmp_path).items())
    # Its engines get the environment vLLM needs here, from [engines.vllm] env.
    agent = fleet.agent("cpu-1", "node-2xl4.toml", env=env, command=[str(real_vllm.vllm)])
    replica: dict[str, Any] = wait_until(lambda: serving(fleet), ENGINE_UP_S, "a ready vLLM")
    pid = engine_pid(agent)

    # The adapter's own command line, run by the launcher as `vllm` would be.
    argv = cmdline(pid)
    assert argv[1:4] == [str(real_vllm.vllm), "serve", str(real_vllm.model)], argv
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    lora = argv.index("--enable-lora")
    assert argv[lora : lora + 5] == ["--enable-lora", "--lora-modules", f"{ADAPTER}={real_vllm.lora}", "--max-lora-rank", "8"]
    assert argv[-3:] == list(PROFILE_ARGS)
    # The engine key is in its environment, never on its command line.
    key = environ(pid)["VLLM_API_KEY"]
    assert key and all(key not in a for a in argv)
    url = replica["url"]
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    headers = {"Authorization": f"Bearer {key}"}
    listed = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    assert listed.status_code == 200
    assert {c["id"]: c["parent"] for c in listed.json()["data"]} == {MODEL: None, ADAPTER: MODEL}

    assert chat_streamed(fleet, MODEL)
    # The adapter, started with the engine, answers under its own name through the
    # router, otherwise than its base to the same greedy request.
    base, adapted = chat_plain(fleet, MODEL), chat_plain(fleet, ADAPTER)
    print(f"\nthe base says {base!r}, its adapter {adapted!r}", flush=True)
    assert base and adapted and base != adapted
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert {m.id: (m.model_extra or {}).get("parent") for m in client.models.list()} == {
        MODEL: None,
        ADAPTER: MODEL,
    }
    first_run = held(pid)
    assert first_run, "vLLM made nothing in /dev/shm: this test would check nothing"
    print(f"\n/dev/shm while the first engine runs: {sorted(first_run)}", flush=True)

    # A restarted agent adopts the engine it launched through the launcher script: the
    # same PID and replica, nothing started again, the key still its own.
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(30) == 0
    assert running(pid)  # vLLM serves on without its agent
    agent = start_agent(fleet, fleet.procs.tmp / "cpu-1.toml", "cpu-1 again")
    wait_until(lambda: f"adopting engine pid {pid}" in agent.output(), what="adoption")
    wait_until(lambda: fleet.node("cpu-1")["status"] == "reachable", what="re-registration")
    adopted = wait_until(lambda: serving(fleet), what="the adopted replica serving")
    assert (adopted["replica_id"], adopted["attempt"]) == (replica["replica_id"], replica["attempt"])
    assert ": starting pid" not in agent.output()
    assert running(pid) and environ(pid)["VLLM_API_KEY"] == key
    assert chat_streamed(fleet, MODEL)

    # The API server killed, five times: each time the agent stops the rest of its group,
    # removes what it left in /dev/shm, reports the failure, and the control plane
    # starts it again. Only the engine running now holds anything there.
    earlier = set(first_run)
    for attempt in range(1, 6):
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda attempt=attempt: serving(fleet, attempt),  # type: ignore[misc]
            ENGINE_UP_S,
            f"vLLM's start {attempt + 1}",
        )
        again = engine_pid(agent, after=attempt - 1)  # this agent started none before
        assert again != pid and running(again) and not running(pid)
        pid = again
        assert chat_streamed(fleet, MODEL)
        now = held(pid)
        assert not (earlier & shm()), (earlier, shm())  # nothing of a killed engine is left
        assert len(now) == len(first_run), (first_run, now)  # the running one's own
        earlier |= now

    # A drain moves the replica to a second node make-before-break: the old engine
    # serves until the new one does, then is stopped; a client that never retries
    # meets no error throughout.
    second = fleet.agent("cpu-2", "node-2xl4.toml", env=env, command=[str(real_vllm.vllm)])
    wait_until(lambda: fleet.node("cpu-2")["status"] == "reachable", what="cpu-2 to register")
    (old,) = fleet.serving(MODEL)
    with ChatLoop(fleet.url) as loop:
        wait_until(lambda: loop.done >= 2, 120.0, "requests before the drain")
        drain = fleet.cli("drain", "cpu-1", timeout=ENGINE_UP_S + 60)
        during = loop.done
        wait_until(lambda: loop.done >= during + 2, 120.0, "requests after the drain")
    assert drain.returncode == 0, drain.stderr
    assert loop.errors == [], loop.errors
    lines = drain.stdout.splitlines()
    rid = old["replica_id"]
    waits = lines.index(f"{rid} ({MODEL}): serves on cpu-1 until its replacement serves")
    (serves,) = [i for i, line in enumerate(lines) if line.endswith("replacement on cpu-2: serves")]
    stopped = lines.index(f"{rid} ({MODEL}): stopped, off cpu-1")
    assert waits < serves < stopped and lines[-1] == "cpu-1: drained, no replica left on it", lines
    assert during >= 4, "the old engine served while the new one started"
    (moved,) = fleet.serving(MODEL)
    assert moved["shards"][0]["node"] == "cpu-2"
    wait_until(lambda: not group_alive(pid), 60.0, "the drained engine's group stopped")
    pid = engine_pid(second)
    now = held(pid)
    assert not (earlier & shm()) and len(now) == len(first_run), (earlier, now)
    earlier |= now

    # The agents gone (engines outlive them, by design), the last engine stopped as an
    # operator would, by SIGTERM to its group: nothing of any engine of this test is left
    # in /dev/shm (other tests' vLLM may run beside it, so not "as it was before").
    agent.signal(signal.SIGKILL)
    second.signal(signal.SIGKILL)
    os.killpg(pid, signal.SIGTERM)
    wait_until(lambda: not group_alive(pid), 60.0, "the last vLLM's group stopped")
    assert not (earlier & shm()), (earlier, shm())


class ChatLoop:
    """Chats through the router one after another, from a thread, streamed and plain by
    turns, with a client that never retries: every failure is kept."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ChatLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(150)
        assert not self._thread.is_alive(), "the chat loop hangs"

    def _run(self) -> None:
        messages: list[Any] = [{"role": "user", "content": "Say hello"}]
        while not self._stop.is_set():
            try:
                if self.done % 2:
                    stream = self.client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=8, stream=True
                    )
                    chunks = list(stream)
                    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
                else:
                    answer = self.client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=8
                    )
                    assert answer.choices[0].finish_reason in ("length", "stop")
            except (openai.APIError, AssertionError) as exc:
                self.errors.append(f"request {self.done}: {exc!r}")
            self.done += 1
            # A client, not a load test: a few requests a second leave the cores to the
            # replacement starting beside the engine that answers them.
            self._stop.wait(PACE_S)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
