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
    wait_until(lambda: fleet.serving("chat"), what="a ready replica")
    before = {r["replica_id"] for r in fleet.status()["replicas"]}
    relay.signal(signal.SIGUSR1)  # stop forwarding; every socket stays open
    wait_until(lambda: fleet.node("gpu-1")["status"] == "unreachable", timeout=5, what="unreachable")
    relay.signal(signal.SIGUSR2)  # back within lost_after (4 s)
    wait_until(lambda: fleet.node("gpu-1")["status"] == "reachable", timeout=5, what="reachable again")
    server_log = fleet.server_proc.output() if fleet.server_proc else ""
    assert "gpu-1: unreachable -> lost" not in server_log
    assert {r["replica_id"] for r in fleet.status()["replicas"]} == before  # nothing was moved


def test_a_restarted_agent_adopts_its_running_engines_and_reports_dead_ones(fleet: Fleet) -> None:
    fleet.server(model("chat"))
    agent = fleet.agent("gpu-1", "node-2xl4.toml")
    replica = wait_until(lambda: fleet.serving("chat"), what="a ready replica")[0]
    (pid,) = fleet.engine_pids()
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(10) == 0
    os.kill(pid, 0)  # the engine serves on without its agent
    agent = fleet.agent("gpu-1", "node-2xl4.toml")  # the same config and state directory
    wait_until(lambda: "adopting engine pid" in agent.output(), what="adoption")
    wait_until(lambda: fleet.node("gpu-1")["status"] == "reachable", what="re-registration")
    again = wait_until(lambda: fleet.serving("chat"), what="the replica serving")[0]
    assert again["replica_id"] == replica["replica_id"] and again["attempt"] == 0
    assert ": starting pid" not in agent.output()  # nothing was started again

    # An engine that dies while its agent is away is reported as failed, then restarted.
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(10) == 0
    os.killpg(pid, signal.SIGKILL)
    agent = fleet.agent("gpu-1", "node-2xl4.toml")
    wait_until(lambda: f"the engine (pid {pid}) ended while the agent was away" in agent.output(), what="the report")
    restarted = wait_until(lambda: [r for r in fleet.serving("chat") if r["attempt"] >= 1], what="a restart")[0]
    assert restarted["replica_id"] == replica["replica_id"]


def test_a_lost_node_that_comes_back_has_its_old_shard_drained_and_stopped(fleet: Fleet) -> None:
    fleet.server(model("chat"))
    first = fleet.agent("gpu-1", "node-2xl4.toml")
    wait_until(lambda: fleet.serving("chat"), what="a ready replica on gpu-1")
    (old_pid,) = fleet.engine_pids()
    fleet.agent("gpu-2", "node-2xl4.toml")
    wait_until(lambda: fleet.node("gpu-2")["status"] == "reachable", what="gpu-2")
    first.signal(signal.SIGKILL)  # the engine on gpu-1 keeps running, holding its GPU
    wait_until(lambda: fleet.node("gpu-1")["status"] == "lost", timeout=15, what="gpu-1 lost")
    wait_until(lambda: [r for r in fleet.serving("chat") if r["shards"][0]["node"] == "gpu-2"], what="the replica moved")
    os.kill(old_pid, 0)
    fleet.agent("gpu-1", "node-2xl4.toml")  # comes back, and finds its old engine
    wait_until(lambda: fleet.node("gpu-1")["status"] == "reachable", what="gpu-1 back")

    def old_engine_gone() -> bool:
        try:
            os.kill(old_pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{old_pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"

    wait_until(old_engine_gone, what="the old engine stopped")
    wait_until(
        lambda: all(r["shards"][0]["node"] == "gpu-2" for r in fleet.status()["replicas"]),
        what="only the replacement left",
    )
    assert fleet.serving("chat")[0]["shards"][0]["node"] == "gpu-2"
