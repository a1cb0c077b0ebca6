"""200 real agents reconnect after the server restarts: jitter spreads them, all get in."""

from __future__ import annotations

import signal
import statistics
import sys

import httpx
import trio

from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_core.inventory import Gpu, Inventory
from procs import Proc, Procs, free_port

AGENTS = 200


async def test_200_agents_come_back_spread_by_jitter_and_are_all_admitted(procs: Procs) -> None:
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
            server.signal(signal.SIGKILL)
            await trio.to_thread.run_sync(server.popen.wait)
            while any(agent.connected.is_set() for agent in agents):
                await trio.sleep(0.01)  # every agent has seen its stream break
            restarted = trio.current_time()
            start_server()
            back: dict[int, float] = {}
            while len(back) < AGENTS:
                for i, agent in enumerate(agents):
                    if i not in back and agent.connected.is_set():
                        back[i] = trio.current_time() - restarted
                await trio.sleep(0.01)
            while await registered(client) < AGENTS:  # the server admitted every one
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    times = sorted(back.values())
    deciles = statistics.quantiles(times, n=10)
    print("re-registration deciles (s):", [round(d, 2) for d in deciles])
    # Full jitter: the returns spread over the backoff window instead of arriving at once.
    assert deciles[-1] - deciles[0] > 0.5, deciles
    per_100ms = [sum(1 for t in times if k / 10 <= t < (k + 1) / 10) for k in range(int(times[-1] * 10) + 1)]
    assert max(per_100ms) < AGENTS / 2, per_100ms
