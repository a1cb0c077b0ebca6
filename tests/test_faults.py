"""Faults with real processes: the control plane killed mid-stream, engines that outlive it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from fleet import Fleet, wait_until

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "stream": True}


def model(name: str) -> str:
    return (
        f'\n[[models]]\nname = "{name}"\n[models.profile]\nengine = "vllm"\n'
        f'model = "org/{name}"\ntensor_parallel = 1\n'
    )


def test_server_killed_mid_stream_the_client_sees_an_error_and_engines_are_adopted(fleet: Fleet) -> None:
    server = fleet.server(model("chat"))
    fleet.agent("gpu-1", "node-2xl4.toml", env='LLMGW_MOCK_TPS = "20", LLMGW_MOCK_TOKENS = "200"')
    replica = wait_until(lambda: fleet.serving("chat"), what="a ready replica")[0]
    wait_until(lambda: httpx.get(fleet.url + "/v1/models").json()["data"], what="the router")
    pids = fleet.engine_pids()
    lines: list[str] = []
    error: Exception | None = None
    try:
        with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=CHAT, timeout=10) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    server.signal(signal.SIGKILL)
    except httpx.HTTPError as exc:
        error = exc
    # The stream ends without [DONE]: a broken connection, never a clean end.
    assert error is not None and "data: [DONE]" not in lines
    for pid in pids:
        os.kill(pid, 0)  # the engine still runs
    fleet.server(model("chat"))
    adopted = wait_until(lambda: fleet.serving("chat"), what="adoption")[0]
    assert adopted["replica_id"] == replica["replica_id"] and fleet.engine_pids() == pids
    answer = wait_until(
        lambda: httpx.post(fleet.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=20),
        what="traffic through the new server",
    )
    assert answer.status_code == 200


def test_a_partitioned_node_turns_unreachable_and_is_not_lost_when_it_comes_back(fleet: Fleet) -> None:
    import sys

    from procs import Proc, free_port

    fleet.server(model("chat"))
    relay_port = free_port()
    relay = Proc([sys.executable, str(Path(__file__).parent / "tcp_relay.py"), str(relay_port), str(fleet.control_port)], relay_port)
    fleet.procs.all.append(relay)
    wait_until(lambda: "relaying" in relay.output(), what="the relay")
    fleet.agent("gpu-1", "node-2xl4.toml", via=relay_port)
    fleet.agent("gpu-2", "node-2xl4.toml")  # so the partitioned node is not most of the fleet
    wait_until(lambda: len([n for n in fleet.status()["nodes"] if n["status"] == "reachable"]) == 2, what="two nodes")
    before = {r["replica_id"] for r in fleet.status()["replicas"]}
    relay.signal(signal.SIGUSR1)  # stop forwarding; every socket stays open
    wait_until(lambda: fleet.node("gpu-1")["status"] == "unreachable", timeout=5, what="unreachable")
    relay.signal(signal.SIGUSR2)  # back within lost_after (4 s)
    wait_until(lambda: fleet.node("gpu-1")["status"] == "reachable", timeout=5, what="reachable again")
    server_log = fleet.server_proc.output() if fleet.server_proc else ""
    assert "gpu-1: unreachable -> lost" not in server_log
    assert {r["replica_id"] for r in fleet.status()["replicas"]} == before  # nothing was moved
