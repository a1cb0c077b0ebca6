"""A managed replica on real vLLM (CPU): the control plane places the tiny Llama on an
agent with a simulated inventory, and the agent runs vLLM through the adapter's own
`vllm serve MODEL ...` command line (tests/real_vllm.py's launcher in place of `vllm`).

One test walks the replica's life, since each start of vLLM costs a minute or more on
two cores: the exact command line and the engine key in its environment only, a direct
request without the key refused, a streamed chat through the router with a client that
never retries, and five SIGKILLs of the API server, each reported and restarted,
leaving nothing of the killed engines in /dev/shm (vLLM's processes share memory
there: two segments and a semaphore, which its resource tracker removes only when it
is not killed first).

Run when named, or in a whole run with LLMGW_REAL_VLLM=1 (conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx

from fleet import Fleet, wait_until
from real_vllm import RealVllm, serving_env
from test_llamacpp_managed import chat_streamed, cmdline, engine_pid, environ, running

MODEL = "tiny"
KV_CACHE_BYTES = 64 * 1024 * 1024
ENGINE_UP_S = 420.0  # 35-143 s seen on this machine; a loaded one takes longer
PROFILE_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))


def models(model: Path) -> str:
    args = ", ".join(f'"{a}"' for a in PROFILE_ARGS)
    return (
        f'\n[[models]]\nname = "{MODEL}"\n[models.profile]\nengine = "vllm"\n'
        f'model = "{model}"\nmax_model_len = 2048\nargs = [{args}]\n'
    )


def serving(fleet: Fleet, attempt: int = 0) -> dict[str, Any] | None:
    return next((r for r in fleet.serving(MODEL) if r["attempt"] >= attempt), None)


def shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_managed_vllm(fleet: Fleet, real_vllm: RealVllm, tmp_path: Path) -> None:
    fleet.server(models(real_vllm.model))
    env = ", ".join(f"{k} = {json.dumps(v)}" for k, v in serving_env(tmp_path).items())
    before = shm()
    # Its engines get the environment vLLM needs here, from [engines.vllm] env.
    agent = fleet.agent("cpu-1", "node-2xl4.toml", env=env, command=[str(real_vllm.vllm)])
    replica: dict[str, Any] = wait_until(lambda: serving(fleet), ENGINE_UP_S, "a ready vLLM")
    pid = engine_pid(agent)

    # The adapter's own command line, run by the launcher as `vllm` would be.
    argv = cmdline(pid)
    assert argv[1:4] == [str(real_vllm.vllm), "serve", str(real_vllm.model)], argv
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert argv[-3:] == list(PROFILE_ARGS)
    # The engine key is in its environment, never on its command line.
    key = environ(pid)["VLLM_API_KEY"]
    assert key and all(key not in a for a in argv)
    url = replica["url"]
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{url}/v1/models", headers=headers, timeout=30).status_code == 200

    assert chat_streamed(fleet, MODEL)
    first_run = shm() - before
    assert first_run, "vLLM made nothing in /dev/shm: this test would check nothing"
    print(f"\n/dev/shm while the first engine runs: {sorted(first_run)}", flush=True)

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
        again = engine_pid(agent, after=attempt)
        assert again != pid and running(again) and not running(pid)
        pid = again
        assert chat_streamed(fleet, MODEL)
        now = shm() - before
        assert not (earlier & now), (earlier, now)  # nothing of a killed engine is left
        assert len(now) == len(first_run), (first_run, now)  # the running one's own
        earlier |= now

    # The agent gone (engines outlive it, by design), the last engine stopped as an
    # operator would, by SIGTERM to its group: /dev/shm is as it was before the first.
    agent.signal(signal.SIGKILL)
    os.killpg(pid, signal.SIGTERM)
    wait_until(lambda: not group_alive(pid), 60.0, "the last vLLM's group stopped")
    assert shm() == before


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
