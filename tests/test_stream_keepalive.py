"""Liveness costs no extra traffic: the control plane answers each heartbeat with a pong,
which the agent counts as hearing from it, so a healthy stream carries no ping at all.
A real server and a real agent in process, over a real socket."""

from __future__ import annotations

from pathlib import Path

import trio

from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_core.config import parse_config
from llmgw_core.inventory import Inventory
from llmgw_core.ws_frames import silence_bound
from llmgw_server.wiring import Running, main

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    # A heartbeat every 3 s: the agent would ping after 6 s of quiet. Not shorter: a
    # stall of this whole process (a starved CI machine: 2.5 s seen) must not look like
    # silence to the agent's watch (the heartbeat before it plus the stall) nor to the
    # server's unreachable timer.
    "control": {"unreachable_after_s": 9.0, "lost_after_s": 60.0},
    "models": [
        {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
    ],
}


async def test_a_healthy_stream_is_kept_alive_by_heartbeats_and_their_acks_alone(
    tmp_path: Path,
) -> None:
    stop = trio.Event()
    bound = silence_bound(3.0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            plane = running.plane
            assert plane is not None
            config = parse_agent_config(
                {
                    "name": "n1",
                    "server": f"ws://127.0.0.1:{running.control_port}/v1/agent",
                    "insecure": True,
                    "state_dir": str(tmp_path / "state"),
                },
                "<test>",
            )
            agent = Agent(config, Inventory(name="n1"))
            await nursery.start(agent.run)
            while "n1" not in plane.agents.streams:
                await trio.sleep(0.01)
            stream = plane.agents.streams["n1"]
            heartbeats = plane.metrics.frames[("in", "heartbeat")]
            # Quiet (no command) for half as long again as the agent's probe delay.
            quiet_until = trio.current_time() + 1.5 * bound.probe_after_s
            while trio.current_time() < quiet_until:
                await trio.sleep(0.05)
            assert plane.metrics.frames[("in", "heartbeat")] - heartbeats >= 2
            assert stream.ws.pings == 0  # every heartbeat's ack kept the agent's watch quiet
            assert plane.agents.streams["n1"] is stream and agent.registrations == 1
            nursery.cancel_scope.cancel()
        stop.set()
