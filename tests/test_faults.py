"""Faults with real processes: the control plane killed mid-stream, engines that outlive it."""

from __future__ import annotations

import os
import signal
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

from fleet import Fleet, wait_until
from forwarder import Forwarder
from procs import free_port

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "stream": True}


def model(name: str) -> str:
    return (
        f'\n[[models]]\nname = "{name}"\n[models.profile]\nengine = "vllm"\n'
        f'model = "org/{name}"\ntensor_parallel = 1\n'
    )


def engine_pids_by_node(fleet: Fleet) -> dict[str, list[int]]:
    """The PIDs of the engines each agent started, from its log ("... starting pid N")."""
    return {
        name: [int(line.rsplit(" ", 1)[1]) for line in proc.output().splitlines() if ": starting pid " in line]
        for name, proc in fleet.agents.items()
    }


def layout(replicas: list[dict[str, Any]]) -> dict[str, list[tuple[str, int]]]:
    """Each replica id and where its shards run."""
    return {r["replica_id"]: sorted((s["node"], s["rank"]) for s in r["shards"]) for r in replicas}


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


def test_stragglers_back_within_lost_after_of_the_guards_release_keep_their_replicas(
    fleet: Fleet,
) -> None:
    """Three of four agents killed at once: the mass-loss guard holds. They come back one after
    another; the first back releases the guard, and the others, silent for longer than
    lost_after by then, get a fresh lost_after from the release: none is declared lost,
    every engine is adopted with its PID, nothing is rescheduled."""
    big = model("big").replace("tensor_parallel = 1", "tensor_parallel = 2\npipeline_parallel = 2")
    chat = model("chat").replace("tensor_parallel = 1", "tensor_parallel = 2")
    fleet.server(big + chat.replace('name = "chat"', 'name = "chat"\nreplicas = 2'))
    control = tomllib.loads((fleet.procs.tmp / "server.toml").read_text())["control"]
    lost_after = float(control["lost_after_s"])
    names = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
    for name in names:
        fleet.agent(name, "node-2xl4.toml")

    def all_serving() -> list[dict[str, Any]]:
        replicas: list[dict[str, Any]] = fleet.status()["replicas"]
        return replicas if len(replicas) == 3 and all(r["serving"] for r in replicas) else []

    before = layout(wait_until(all_serving, timeout=30, what="a two-node and two one-node replicas"))
    pids = engine_pids_by_node(fleet)
    assert sorted(len(p) for p in pids.values()) == [1, 1, 1, 1]  # an engine (shard) on each node
    (two_node,) = [shards for shards in before.values() if len(shards) == 2]
    head, worker = two_node[0][0], two_node[1][0]
    survivor, first_back = [n for n in names if n not in (head, worker)]
    order = [first_back, head, worker]  # the two-node replica's nodes last, as in the issue

    for name in order:
        fleet.agents[name].signal(signal.SIGKILL)  # their engines run on
    guard = wait_until(lambda: fleet.status()["guard"], timeout=10, what="the mass-loss guard")
    assert guard.startswith("3 of 4 nodes turned unreachable")
    # Silent for longer than lost_after while the guard holds: without a fresh grace they
    # would be declared lost the moment it releases.
    wait_until(
        lambda: all(fleet.node(n)["last_seen_s_ago"] > lost_after + 0.5 for n in order),
        timeout=lost_after + 10,
        what="the killed nodes silent for longer than lost_after",
    )
    statuses = {n["name"]: n["status"] for n in fleet.status()["nodes"]}
    assert statuses == {**{n: "unreachable" for n in order}, survivor: "reachable"}

    # The stragglers' agents start now, dialling a port where nothing listens, and reach
    # the control plane once the way opens after the release: within lost_after of it
    # must fit their redial, not the start-up of two Python processes (seconds each on
    # a busy machine).
    way = Forwarder(free_port(), fleet.control_port)
    for straggler in order[1:]:
        fleet.agent(straggler, "node-2xl4.toml", via=way.listen_port)
    fleet.agent(first_back, "node-2xl4.toml")
    wait_until(lambda: fleet.status()["guard"] is None, timeout=10, what="the guard's release")
    released = time.monotonic()
    way.open()
    # Whether they were back within lost_after is the server's to say ("-> lost" below),
    # not this process's clock: a starved test process would count its own stall here.
    for straggler in order[1:]:
        wait_until(
            lambda: fleet.node(straggler)["status"] == "reachable",  # noqa: B023 (called at once)
            timeout=lost_after + 10,
            what=f"{straggler} back",
        )
    took = time.monotonic() - released
    way.close()  # the connections made stay up; no new one is needed

    server_log = fleet.server_proc.output() if fleet.server_proc else ""
    assert "mass-loss guard released" in server_log
    assert "-> lost" not in server_log, (
        f"the stragglers were back {took:.1f} s after the release (lost_after "
        f"{lost_after:g} s)\n{server_log}"
    )
    for name in order:
        agent_log = fleet.agents[name].output()
        (pid,) = pids[name]
        assert f"adopting engine pid {pid}" in agent_log, agent_log
        assert ": starting pid" not in agent_log, agent_log  # nothing was started again
        os.kill(pid, 0)
    after = wait_until(all_serving, timeout=10, what="every replica serving again")
    assert layout(after) == before  # the same replica ids on the same nodes
    assert all(r["attempt"] == 0 for r in after)
