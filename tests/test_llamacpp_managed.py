"""A managed replica on the real llama-server: the control plane places gemma-3-270m on an
agent with a simulated inventory, and the agent runs llama.cpp's llama-server on CPU.

One test walks the whole life of the replica, since each start of the engine costs
seconds on two cores: the exact command line, the key it requires, a streamed chat
through the router with a client that never retries, SIGKILL of the engine reported
and restarted, and a restarted agent adopting the engine with its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

from fleet import SIM, Fleet, wait_until
from llmgw_core.certs import issue_node
from procs import Proc

MODEL = "gemma"
# Small enough for two shared cores: a 2,048-token context (rather than the 32k the model
# was trained with) and one thread, given as the profile's own arguments. (Two threads
# wait on each other by spinning: twice the CPU per answer, taken from the other tests.)
PROFILE_ARGS = ("-c", "2048", "-t", "1")
ENGINE_UP_S = 120.0  # loading takes ~3 s on an idle machine; these two cores are shared


def models(gguf: Path) -> str:
    args = ", ".join(f'"{a}"' for a in PROFILE_ARGS)
    return (
        f'\n[[models]]\nname = "{MODEL}"\n[models.profile]\nengine = "llamacpp"\n'
        f'model = "{gguf}"\nargs = [{args}]\n'
    )


def agent_config(fleet: Fleet, name: str, llama_server: Path) -> Path:
    """An agent like fleet.py's, whose llamacpp engine is the real llama-server."""
    path = fleet.procs.tmp / f"{name}.toml"
    crt, key, _ = issue_node(fleet.certs, name)
    path.write_text(
        f'name = "{name}"\nserver = "wss://127.0.0.1:{fleet.control_port}/v1/agent"\n'
        f'state_dir = "{fleet.procs.tmp / name}"\ninventory_file = "{SIM / "node-2xl4.toml"}"\n'
        'bind_host = "127.0.0.1"\nstop_grace_s = 5\n'
        f'[tls]\nca = "{fleet.certs}/ca.crt"\ncert = "{crt}"\nkey = "{key}"\n'
        "[reconnect]\nbase_s = 0.1\ncap_s = 0.5\n"
        f'[engines.llamacpp]\ncommand = ["{llama_server}"]\n'
    )
    return path


def start_agent(fleet: Fleet, config: Path, tag: str) -> Proc:
    proc = Proc([sys.executable, "-m", "llmgw_agent", "--config", str(config)], 0)
    fleet.procs.all.append(proc)
    fleet.agents[tag] = proc
    fleet.every_agent.append(proc)  # the fixture kills the engines its log names at the end
    return proc


def serving(fleet: Fleet, attempt: int = 0) -> dict[str, Any] | None:
    for replica in fleet.serving(MODEL):
        if replica["attempt"] >= attempt:
            return replica
    return None


def engine_pid(agent: Proc, after: int = 0) -> int:
    """The PID of the engine the agent started last ("... starting pid N")."""
    pids = [int(line.rsplit(" ", 1)[1]) for line in agent.output().splitlines() if ": starting pid " in line]
    assert len(pids) > after, agent.output()
    return pids[-1]


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")[:-1]
    return dict(p.split("=", 1) for p in pairs)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def chat_streamed(fleet: Fleet, model: str = MODEL) -> str:
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop"), chunks
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def expected_version(llama_server: Path) -> str:
    done = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True, timeout=30)
    line = next(x for x in (done.stdout + done.stderr).splitlines() if x.startswith("version: "))
    return line.removeprefix("version: ")


def test_a_managed_llama_server(fleet: Fleet, real_engine: Any) -> None:
    fleet.server(models(real_engine.model))
    config = agent_config(fleet, "cpu-1", real_engine.server)
    agent = start_agent(fleet, config, "cpu-1")
    pids: list[int] = []
    try:
        replica = wait_until(lambda: serving(fleet), ENGINE_UP_S, "a ready llama-server replica")
        pid = engine_pid(agent)
        pids.append(pid)

        # The node reports llama-server's version from the line that carries it.
        (engine,) = [e for e in fleet.node("cpu-1")["engines"] if e["name"] == "llamacpp"]
        assert engine == {"name": "llamacpp", "found": True, "version": expected_version(real_engine.server)}

        # The exact command line: -m for a local GGUF, the profile's -c and -t, no -c 0,
        # and no key on it.
        port = int(replica["url"].rsplit(":", 1)[1])
        assert replica["url"] == f"http://127.0.0.1:{port}"
        assert cmdline(pid) == [
            str(real_engine.server), "-m", str(real_engine.model),
            "--host", "127.0.0.1", "--port", str(port),
            "--alias", MODEL, "-ngl", "999", "--metrics", *PROFILE_ARGS,
        ]  # fmt: skip
        env = environ(pid)
        key = env["LLAMA_API_KEY"]  # the control plane gave the replica a key
        assert len(key) >= 24 and env["CUDA_VISIBLE_DEVICES"] == "0"

        # A streamed chat through the router, which sends the key.
        assert chat_streamed(fleet)

        # The engine refuses anyone who reaches it directly without its key.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        direct = f"{replica['url']}/v1/chat/completions"
        assert httpx.post(direct, json=body, timeout=60).status_code == 401
        wrong = {"authorization": "Bearer not-the-key"}
        assert httpx.post(direct, json=body, headers=wrong, timeout=60).status_code == 401
        right = {"authorization": f"Bearer {key}"}
        assert httpx.post(direct, json=body, headers=right, timeout=60).status_code == 200

        # The key is in no log and in no file another user can read.
        state = fleet.procs.tmp / "cpu-1"
        (record,) = (state / "shards").glob("*.json")
        assert record.stat().st_mode & 0o077 == 0 and key in record.read_text()
        (log,) = (state / "logs").glob("*.log")
        assert log.stat().st_mode & 0o077 == 0
        assert key not in log.read_text() and key not in agent.output()
        assert key not in (fleet.server_proc.output() if fleet.server_proc else "")

        # SIGKILL: the engine is reported failed and started again, with a fresh log.
        os.killpg(pid, signal.SIGKILL)
        wait_until(
            lambda: "the engine was killed by signal 9 (SIGKILL)" in agent.output(), what="the failure report"
        )
        restarted = wait_until(lambda: serving(fleet, attempt=1), ENGINE_UP_S, "the engine restarted")
        assert restarted["replica_id"] == replica["replica_id"]
        pid = engine_pid(agent, after=1)
        pids.append(pid)
        port = int(restarted["url"].rsplit(":", 1)[1])
        assert cmdline(pid)[:6] == [str(real_engine.server), "-m", str(real_engine.model), "--host", "127.0.0.1", "--port"]
        assert cmdline(pid)[6] == str(port)
        assert f"127.0.0.1:{port}" in log.read_text()
        assert f"127.0.0.1:{port}" not in log.with_name(log.name + ".1").read_text()
        assert chat_streamed(fleet)

        # A restarted agent adopts the running engine: same PID, nothing started again.
        agent.signal(signal.SIGTERM)
        assert agent.popen.wait(15) == 0
        assert running(pid)  # the engine serves on without its agent
        again = start_agent(fleet, config, "cpu-1 again")
        wait_until(lambda: f"adopting engine pid {pid}" in again.output(), what="adoption")
        wait_until(lambda: fleet.node("cpu-1")["status"] == "reachable", what="re-registration")
        adopted = wait_until(lambda: serving(fleet, attempt=1), what="the adopted replica serving")
        assert adopted["replica_id"] == replica["replica_id"] and adopted["attempt"] == restarted["attempt"]
        assert ": starting pid" not in again.output()
        assert running(pid) and environ(pid)["LLAMA_API_KEY"] == key
        assert chat_streamed(fleet)
    finally:
        for p in pids:
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
