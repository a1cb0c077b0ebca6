"""`make demo`: the whole system on one machine without a GPU.

The server with its control plane, two agents with simulated GPUs, and mock
engines that the control plane places and the agents launch through the vLLM
adapter, all as separate processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmgw_core.certs import init_ca, issue_node

CONF = Path(__file__).resolve().parents[2] / "conf"
MOCK = f'["{sys.executable}", "-m", "llmgw_core.mock_engine"]'


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # stop the whole demo on SIGTERM as on Ctrl-C
    port = int(os.environ.get("LLMGW_DEMO_PORT", "8080"))
    control = port + 1
    work = Path(tempfile.mkdtemp(prefix="llmgw-demo-"))
    certs = work / "certs"
    init_ca(certs)  # mutual TLS on the agent stream, as in production
    (work / "server.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        f'[agents]\nca = "{certs}/ca.crt"\ncert = "{certs}/server.crt"\n'
        f'key = "{certs}/server.key"\n'
        "[router]\nhealth_interval_s = 1.0\n"
        "[control]\nsettle_after_start_s = 1\nunreachable_after_s = 5\nlost_after_s = 30\n"
        '[[models]]\nname = "demo-model"\nreplicas = 2\n[models.profile]\nengine = "vllm"\n'
        'model = "demo/demo-8b"\ntensor_parallel = 1\ngpu_memory_gib = 20\n'
        '[[models]]\nname = "demo-big"\n[models.profile]\nengine = "vllm"\n'
        'model = "demo/demo-70b"\ntensor_parallel = 2\npipeline_parallel = 2\n'
    )
    for name, inventory in (("sim-node-1", "node-2xl4.toml"), ("sim-node-2", "node-8xh100.toml")):
        crt, key, _ = issue_node(certs, name)
        (work / f"{name}.toml").write_text(
            f'name = "{name}"\nserver = "wss://127.0.0.1:{control}/v1/agent"\n'
            f'state_dir = "{work / name}"\ninventory_file = "{CONF / "sim" / inventory}"\n'
            'fabric = { ib_domain = "demo" }\nbind_host = "127.0.0.1"\n'
            f'[tls]\nca = "{certs}/ca.crt"\ncert = "{crt}"\nkey = "{key}"\n'
            f'[engines.vllm]\ncommand = {MOCK}\nenv = {{ LLMGW_MOCK_TPS = "30" }}\n'
        )
    logs = work / "logs"
    logs.mkdir()
    procs = []

    def start(name: str, *argv: str) -> None:
        out = (logs / f"{name}.log").open("wb")
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    start("server", "-m", "llmgw_server", "--config", str(work / "server.toml"))
    for name in ("sim-node-1", "sim-node-2"):
        start(name, "-m", "llmgw_agent", "--config", str(work / f"{name}.toml"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                models = httpx.get(url + "/v1/models", timeout=1).json()["data"]
                if len(models) == 2:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if any(p.poll() is not None for p in procs):
                print(f"a demo process exited; see the logs in {logs}", file=sys.stderr)
                return 1
            time.sleep(0.3)
        print(
            f"\nllmgw demo: the router is at {url}/v1, the control plane at https://127.0.0.1:{control}\n"
            "two agents with simulated GPUs run mock engines the control plane placed\n"
            f"(demo-model: 2 replicas; demo-big: one replica across both nodes). Logs: {logs}\n\n"
            f"  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
            '    -d \'{"model": "demo-model", "stream": true, '
            '"messages": [{"role": "user", "content": "hello"}]}\'\n\n'
            f"  {sys.executable} -m llmgw_server \\\n"
            f"    --control https://127.0.0.1:{control} --ca {certs}/ca.crt status\n\n"
            "Ctrl-C stops it all.\n",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print(f"a demo process exited; see the logs in {logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        # Agents leave their engines serving when they stop; the demo ends them too.
        for record in work.glob("*/shards/*.json"):
            try:
                os.killpg(json.loads(record.read_text())["pid"], signal.SIGTERM)
            except (OSError, ValueError, KeyError):
                pass


if __name__ == "__main__":
    sys.exit(main())
