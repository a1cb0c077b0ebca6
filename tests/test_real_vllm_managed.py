"""A managed replica on real vLLM (CPU): the control plane places the tiny Llama on an
agent with a simulated inventory, and the agent runs vLLM through the adapter's own
`vllm serve MODEL ...` command line (tests/real_vllm.py's launcher in place of `vllm`).

One test walks the replica's life, since each start of vLLM costs a minute or more on
two cores (three starts in all; seven in `make test-long`'s soak): the exact command line and the engine key in its
environment only, a direct request without the key refused, a streamed chat through the
router with a client that never retries, the profile's LoRA adapter answering under its
own name otherwise than the base, a restarted agent adopting the engine with its
PID, a SIGKILL of the API server (five in `make test-long`), each reported (by the agent and the control plane)
and restarted with a fresh log, none of the killed engine's processes (EngineCore, the
resource tracker) left alive, nothing of the killed engines left in /dev/shm (vLLM's
processes share memory there: two segments and a semaphore, which its resource tracker
removes only when it is not killed first), the engine key in no log; a drain that moves
the replica to a second node make-before-break while a client that never retries keeps
asking (vLLM's one-process executor, a worker process less to start, for the second
node's engines and, in make test, for those of cpu-1's restarted agent); and a profile flag this vLLM's `serve --help=all` does not list, refused before
any launch (the agents read that help once for their own launches; the check reuses it).

Collected by every run (make test and CI); it fails, never skips, without the vLLM cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fleet import Fleet, wait_until
from llmgw_agent.inventory_probe import VERSION_TIMEOUT_S
from procs import Proc
from real_vllm import RealVllm, serving_env
from test_llamacpp_managed import chat_streamed, cmdline, engine_pid, environ, running, start_agent

MODEL = "tiny"
ADAPTER = "tiny-lora"  # the tiny model's LoRA adapter (tests/tiny_llama.py), a model of its own
KV_CACHE_BYTES = 64 * 1024 * 1024
ENGINE_UP_S = 420.0  # 35-143 s seen on this machine; a loaded one takes longer
# A restarted agent adopts its engine once its inventory probe (`vllm --version`, bounded
# by VERSION_TIMEOUT_S) is done; the rest (its start, registration, a health probe) is
# seconds, given 60 more for a starved machine.
ADOPT_S = VERSION_TIMEOUT_S + 60.0
# Between the chat loop's requests. vLLM's engine and its worker each read the other's
# queue in /dev/shm by spinning (sched_yield) for a second after each message before they
# sleep on a socket (shm_broadcast.SpinCondition): a request every half second kept both
# spinning through the drain, each taking its share of the loaded cores from the
# replacement that starts beside it. A few seconds apart, they sleep most of the time:
# at 3 s the old engine's worker still spun 20 s of CPU through a drain in make test. At
# 6 s, a drain as short as an idle machine's vLLM start (35 s) still meets 5 requests.
PACE_S = 6.0
PROFILE_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
# A model whose profile, once reloaded, has a typo in its args: vLLM 0.32.0 takes
# --max-model-len, not this (argparse would refuse it only after a minute of imports).
TYPO = "typo"
TYPO_FLAG = "--max-model-length"
# SIGKILLs of the API server in `make test`: the adopted engine's (its exit status is no
# child's of the agent: "the engine exited"). Each costs a start of vLLM, a minute of a
# core or more: the kills of the agent's own child ("killed by signal 9") are the soak's,
# `make test-long`'s; in `make test` that path is walked by a real llama-server
# (test_llamacpp_managed) and, with a group that leaves /dev/shm segments as vLLM's
# does, by test_shm_leftovers.
KILLS = 1
SOAK_KILLS = 5


def models(model: Path, lora: Path) -> str:
    args = ", ".join(f'"{a}"' for a in PROFILE_ARGS)
    return (
        f'\n[[models]]\nname = "{MODEL}"\n[models.profile]\nengine = "vllm"\n'
        f'model = "{model}"\nmax_model_len = 2048\nmax_lora_rank = 8\nargs = [{args}]\n'
        f'[[models.profile.lora]]\nname = "{ADAPTER}"\npath = "{lora}"\n'
        # No replica until the end of the test, where a reload asks for one.
        f'\n[[models]]\nname = "{TYPO}"\nreplicas = 0\n[models.profile]\nengine = "vllm"\n'
        f'model = "{model}"\nargs = ["--enforce-eager"]\n'
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


def group_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of a process group, each as "pid command line"
    (vLLM titles its engine process VLLM::EngineCore)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] in ("Z", "X"):
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        found.append(f"{entry} {argv.decode(errors='replace').strip()}")
    return found


def lines_with(proc: Proc, phrase: str, count: int) -> list[str] | None:
    """The lines of a process's output that hold `phrase`, once there are `count`."""
    lines = [line for line in proc.output().splitlines() if phrase in line]
    assert len(lines) <= count, lines
    return lines if len(lines) == count else None


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


def until_adopted(agent: Proc, check: Callable[[], Any], since: float, what: str) -> Any:
    """`check` true within ADOPT_S of `since` (before the agent's restart), or a failure
    that shows the agent's last lines and the fleet's view of its node."""
    left = round(max(0.0, since + ADOPT_S - time.monotonic()), 1)
    try:
        return wait_until(check, left, what)
    except AssertionError as exc:
        tail = "\n".join(agent.output().splitlines()[-30:])
        since_s = f"{ADOPT_S:g} s from the agent's restart"
        raise AssertionError(f"{exc} ({since_s}); the agent:\n{tail}") from None


def test_a_managed_vllm(fleet: Fleet, real_vllm: RealVllm, tmp_path: Path) -> None:
    """The walk with one SIGKILL, the adopted engine's, the rest as below."""
    walk(fleet, real_vllm, tmp_path, KILLS)


@pytest.mark.long
def test_a_managed_vllm_killed_five_times(fleet: Fleet, real_vllm: RealVllm, tmp_path: Path) -> None:
    """The same walk with five SIGKILLs: the adopted engine's, then four of the agent's
    own child (each reported in its own words), in `make test-long` (docs/development.md)."""
    walk(fleet, real_vllm, tmp_path, SOAK_KILLS)


def walk(fleet: Fleet, real_vllm: RealVllm, tmp_path: Path, kills: int) -> None:
    fleet.server(models(real_vllm.model, real_vllm.lora))
    env = engine_env(serving_env(tmp_path))
    # vLLM's one-process executor (taken by vLLM for CPU with its V1 multiprocessing
    # off): the model runs in the engine process, with no worker process of its own, so
    # a start imports torch and vLLM once less (12-20 s of CPU in make test) and no
    # worker spins on its /dev/shm queue beside a drain's replacement. cpu-2's agent
    # gives it to its engines, and in make test (one kill) so does cpu-1's restarted
    # agent: the kill walked there is the adopted engine's, started by the first agent
    # with vLLM's default executor, whose processes and /dev/shm segments are checked.
    # The soak's later kills are of the restarted agent's own engines, with the default.
    one_process = engine_env(serving_env(tmp_path) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    restarted_one_process = kills == 1
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
    first_agent = agent
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(30) == 0
    assert running(pid)  # vLLM serves on without its agent
    restarted_at = time.monotonic()
    config_1 = fleet.procs.tmp / "cpu-1.toml"
    if restarted_one_process:
        text = config_1.read_text()
        assert text.count(env) == 1, text
        config_1.write_text(text.replace(env, one_process))
    agent = start_agent(fleet, config_1, "cpu-1 again")
    # Adoption comes after the agent's inventory probe, which runs `vllm --version` (the
    # launcher answers it without vLLM's imports; a real vLLM's takes seconds idle, past
    # 20 s on a busy machine, and the probe's own bound is VERSION_TIMEOUT_S): waited for
    # as long as the agent itself would wait, from before the agent's start, and told
    # with what the agent said if it never comes.
    adopting = f"adopting engine pid {pid}"
    until_adopted(agent, lambda: adopting in agent.output(), restarted_at, "adoption")

    def reachable() -> bool:
        return bool(fleet.node("cpu-1")["status"] == "reachable")

    until_adopted(agent, reachable, restarted_at, "re-registration")
    adopted = until_adopted(agent, lambda: serving(fleet), restarted_at, "the adopted replica")
    assert (adopted["replica_id"], adopted["attempt"]) == (replica["replica_id"], replica["attempt"])
    assert ": starting pid" not in agent.output()
    assert running(pid) and environ(pid)["VLLM_API_KEY"] == key
    assert chat_streamed(fleet, MODEL)

    # The API server killed, `kills` times: each time the agent stops the rest of its group,
    # removes what it left in /dev/shm, reports the failure, and the control plane
    # starts it again with a fresh log. Only the engine running now holds anything there.
    rid = replica["replica_id"]
    log = fleet.procs.tmp / "cpu-1" / "logs" / f"{rid}.0.log"
    assert f" pid={pid})" in log.read_text()  # vLLM's own lines name their process
    server = fleet.server_proc
    assert server is not None
    earlier = set(first_run)
    # What an engine holds there, by executor: each engine holds as many as the first of
    # its kind did (the one-process executor's engines as many as each other).
    held_by_kind = {"default": len(first_run)}
    for attempt in range(1, kills + 1):
        group = group_members(pid)
        # The API server and its EngineCore at least: the check below means something.
        assert len(group) >= 2 and any("EngineCore" in p for p in group), group
        os.kill(pid, signal.SIGKILL)
        # Reported once the agent has ended the rest of the group. The engine adopted from
        # the first agent is no child of this one: its exit status is not this agent's to read.
        ended = "the engine exited" if attempt == 1 else "the engine was killed by signal 9 (SIGKILL)"
        reports = wait_until(
            lambda attempt=attempt: lines_with(agent, f"{rid} rank 0 failed: ", attempt),  # type: ignore[misc]
            60.0, f"the agent's report of kill {attempt}",
        )  # fmt: skip
        assert reports[-1].endswith(f"{rid} rank 0 failed: {ended}"), reports
        assert group_members(pid) == [], f"of the killed engine's {group}, some are left alive"
        notes = wait_until(
            lambda attempt=attempt: lines_with(server, f"replica {rid} of {MODEL} failed on ", attempt),  # type: ignore[misc]
            30.0, f"the control plane's note of kill {attempt}",
        )  # fmt: skip
        noted = rf"replica {rid} of {MODEL} failed on cpu-1( \(crash loop\))?: {re.escape(ended)}"
        assert re.search(rf"{noted}; restart in ", notes[-1]), notes
        wait_until(
            lambda attempt=attempt: serving(fleet, attempt),  # type: ignore[misc]
            ENGINE_UP_S,
            f"vLLM's start {attempt + 1}",
        )
        again = engine_pid(agent, after=attempt - 1)  # this agent started none before
        assert again != pid and running(again) and not running(pid)
        # A fresh log for the new engine; the killed one's is kept as .1.
        fresh, kept = log.read_text(), log.with_name(log.name + ".1").read_text()
        assert f" pid={again})" in fresh and f" pid={pid})" not in fresh
        assert f" pid={pid})" in kept and f" pid={again})" not in kept
        for text in (fresh, kept, agent.output(), first_agent.output(), server.output()):
            assert key not in text
        pid = again
        assert chat_streamed(fleet, MODEL)
        now = held(pid)
        assert not (earlier & shm()), (earlier, shm())  # nothing of a killed engine is left
        kind = "one process" if restarted_one_process else "default"
        assert held_by_kind.setdefault(kind, len(now)) == len(now), (held_by_kind, now)
        earlier |= now

    # A drain moves the replica to a second node make-before-break: the old engine
    # serves until the new one does, then is stopped; a client that never retries
    # meets no error throughout.
    # cpu-2's state directory starts with the engine flags cpu-1's agent kept: the same
    # vLLM program and version, whose help (10 s of CPU) cpu-1's first launch read and
    # its restarted agent took from the store; cpu-2 reading it too would repeat that.
    flags_read = fleet.procs.tmp / "cpu-1" / "engine-flags"
    shutil.copytree(flags_read, fleet.procs.tmp / "cpu-2" / "engine-flags")
    second = fleet.agent("cpu-2", "node-2xl4.toml", env=one_process, command=[str(real_vllm.vllm)])
    # The agent registers once its inventory probe ran `vllm --version` (a real vLLM's
    # imports: up to VERSION_TIMEOUT_S on a busy machine, as for adoption above).
    wait_until(
        lambda: fleet.node("cpu-2")["status"] == "reachable",
        timeout=ADOPT_S,
        what="cpu-2 to register",
    )
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
    assert not (earlier & shm()), (earlier, shm())  # nothing of the drained engine is left
    now = held(pid)  # cpu-2's own
    assert held_by_kind.setdefault("one process", len(now)) == len(now), (held_by_kind, now)
    earlier |= now

    # A profile whose args name a flag this vLLM does not take is refused before launch,
    # from the flags of the help the second agent's launch used: one replica of the typo
    # model asked for by a reload, placed on cpu-2 (cpu-1 is drained), never started.
    config = fleet.procs.tmp / "server.toml"
    text = config.read_text()
    typo = f'name = "{TYPO}"\nreplicas = 0\n'
    assert text.count(typo) == 1 and text.count('args = ["--enforce-eager"]\n') == 1
    config.write_text(
        text.replace(typo, f'name = "{TYPO}"\nreplicas = 1\n').replace(
            'args = ["--enforce-eager"]\n', f'args = ["--enforce-eager", "{TYPO_FLAG}", "2048"]\n'
        )
    )
    launched = second.output().count(": starting pid ")
    server.signal(signal.SIGHUP)
    refused = re.compile(
        rf"(\S+) rank 0 failed: the profile does not fit this node: the profile's args name "
        rf"{TYPO_FLAG}, which vllm( \S+)? does not take \(did you mean --max-model-len\?\)"
    )
    found = wait_until(lambda: refused.search(second.output()), 60.0, "the typo refused")
    typo_rid = found.group(1)
    noted = f"replica {typo_rid} of {TYPO} failed on cpu-2"
    wait_until(lambda: noted in server.output(), 30.0, "the control plane's note of it")
    assert second.output().count(": starting pid ") == launched  # nothing launched
    assert not list((fleet.procs.tmp / "cpu-2" / "logs").glob(f"{typo_rid}.*"))
    assert "the flags were not checked" not in second.output() + agent.output()

    # The agents gone (engines outlive them, by design), the last engine stopped as an
    # operator would, by SIGTERM to its group: nothing of any engine of this test is left
    # in /dev/shm (other tests' vLLM may run beside it, so not "as it was before").
    agent.signal(signal.SIGKILL)
    second.signal(signal.SIGKILL)
    os.killpg(pid, signal.SIGTERM)
    wait_until(lambda: not group_alive(pid), 60.0, "the last vLLM's group stopped")
    assert not (earlier & shm()), (earlier, shm())


def engine_env(env: dict[str, str]) -> str:
    """An agent's [engines.vllm] env, as TOML's inline table holds it."""
    return ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())


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
            # A client, not a load test: the cores are left to the replacement starting
            # beside the engine that answers it (PACE_S).
            self._stop.wait(PACE_S)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
