"""200 real agents reconnect after the server restarts: jitter spreads them, all get in.

The spread is read from the delays the agents chose, not from when they got back: on a
shared machine a stall of this process or of the server bunches the arrivals whatever
the agents chose (seen in CI: 123 of 200 back in one 100 ms window, after a 1.5 s
stall). The delay function's own spread is test_agent_backoff's."""

from __future__ import annotations

import random
import signal
import statistics
import sys

import httpx
import pytest
import trio

from llmgw_agent import agent as agent_module
from llmgw_agent.agent import Agent, reconnect_delay
from llmgw_agent.config import parse_agent_config
from llmgw_core.inventory import Gpu, Inventory
from procs import Proc, Procs, free_port

AGENTS = 200


async def test_200_agents_come_back_spread_by_jitter_and_are_all_admitted(
    procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The delays the agents choose, each agent's under its own generator.
    chosen: dict[int, list[float]] = {}

    def recorded_delay(
        attempt: int, come_back_s: float | None, base_s: float, cap_s: float, rng: random.Random
    ) -> float:
        delay = reconnect_delay(attempt, come_back_s, base_s, cap_s, rng)
        chosen.setdefault(id(rng), []).append(delay)
        return delay

    monkeypatch.setattr(agent_module, "reconnect_delay", recorded_delay)
    port, control = free_port(), free_port()
    config = procs.tmp / "server.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        "[agents]\ninsecure = true\n[control]\nunreachable_after_s = 30\nlost_after_s = 120\n"
        '[[models]]\nname = "m"\n[models.profile]\nengine = "vllm"\nmodel = "org/m"\ngpu_model = "B300"\n'
    )

    def start_server() -> Proc:
        proc = Proc([sys.executable, "-m", "llmgw_server", "--config", str(config)], port)
        procs.all.append(proc)
        return proc

    agents = [
        Agent(
            parse_agent_config(
                {
                    "name": f"n{i:03d}",
                    "server": f"ws://127.0.0.1:{control}/v1/agent",
                    "insecure": True,
                    "state_dir": str(procs.tmp / f"n{i:03d}"),
                    "reconnect": {"base_s": 0.5, "cap_s": 30.0},
                },
                "<test>",
            ),
            Inventory(name=f"n{i:03d}", gpus=(Gpu(0, f"GPU-{i}", "NVIDIA L4", 23034, 22500),)),
        )
        for i in range(AGENTS)
    ]
    for i, agent in enumerate(agents):
        agent.rng = random.Random(i)

    async def registered(client: httpx.AsyncClient) -> int:
        try:
            status = (await client.get(f"http://127.0.0.1:{control}/v1/admin/status")).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return sum(n["status"] == "reachable" for n in status["nodes"])

    with trio.fail_after(120):
        server = start_server()
        async with httpx.AsyncClient(timeout=5) as client, trio.open_nursery() as nursery:
            for agent in agents:
                await nursery.start(agent.run)
            while await registered(client) < AGENTS:
                await trio.sleep(0.2)
            before = [len(chosen.get(id(agent.rng), [])) for agent in agents]
            killed = trio.current_time()
            server.signal(signal.SIGKILL)
            await trio.to_thread.run_sync(server.popen.wait)
            while any(agent.connected.is_set() for agent in agents):
                await trio.sleep(0.01)  # every agent has seen its stream break
            restarted = trio.current_time()
            start_server()
            back: dict[int, float] = {}  # since the restart
            since_kill: dict[int, float] = {}
            while len(back) < AGENTS:
                for i, agent in enumerate(agents):
                    if i not in back and agent.connected.is_set():
                        back[i] = trio.current_time() - restarted
                        since_kill[i] = trio.current_time() - killed
                await trio.sleep(0.01)
            while await registered(client) < AGENTS:  # the server admitted every one
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert all(agent.registrations >= 2 for agent in agents)
    returns = statistics.quantiles(sorted(back.values()), n=10)
    print("re-registration deciles (s), for the log:", [round(d, 2) for d in returns])
    # Each agent's first redial after the break waited a delay of its own drawing: full
    # jitter over a window of at least base_s (2 * base_s unless the stream had been
    # healthy for a while), so the fleet's dials spread instead of coming all at once.
    # Uniform over even the smallest window (0.5 s), the middle 80% span 0.4 s.
    first = [chosen[id(agent.rng)][k] for agent, k in zip(agents, before, strict=True)]
    deciles = statistics.quantiles(first, n=10)
    print("first redial delays, deciles (s):", [round(d, 2) for d in deciles])
    assert deciles[-1] - deciles[0] > 0.3, deciles
    per_100ms = [sum(1 for t in first if k / 10 <= t < (k + 1) / 10) for k in range(int(max(first) * 10) + 1)]
    assert max(per_100ms) < AGENTS / 2, per_100ms
    # And each waited it: none was back before its delay had passed since the kill.
    # (A lower bound only, which no stall of this machine can break.)
    early = [i for i in range(AGENTS) if since_kill[i] < first[i]]
    assert not early, [(since_kill[i], first[i]) for i in early]
