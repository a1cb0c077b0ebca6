"""A paced fleet end to end: the control port tells a node the fleet's longer interval
on one of its heartbeats, and the agent beats at the interval it was last told (a bad
one closes the stream, as any bad frame does)."""

from __future__ import annotations

from pathlib import Path

import trio
import trio_websocket

from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_core.config import parse_config
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import (
    PROTOCOL,
    Heartbeat,
    Pace,
    Register,
    UpMessage,
    Welcome,
    decode_down,
    encode,
)
from llmgw_core.ws_frames import Paced, silence_bound
from llmgw_server.wiring import Running, main

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    # One heartbeat a second for the fleet, 1 s at the least (unreachable_after_s / 3).
    "control": {"unreachable_after_s": 3, "heartbeats_per_s": 1},
    "models": [
        {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
    ],
}


def inventory(name: str) -> Inventory:
    return Inventory(name=name, gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),))


async def welcome(ws: trio_websocket.WebSocketConnection, name: str, protocol: int) -> float:
    await ws.send_message(encode(Register(protocol, "test", inventory(name))))
    message = decode_down(await ws.get_message())
    assert isinstance(message, Welcome)
    return message.heartbeat_interval_s


async def test_a_grown_fleet_paces_its_first_node_on_a_heartbeat() -> None:
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"
            async with (
                trio_websocket.open_websocket_url(url) as first,
                trio_websocket.open_websocket_url(url) as old,
                trio_websocket.open_websocket_url(url) as third,
            ):
                assert await welcome(first, "n1", PROTOCOL) == 1.0
                # One version behind (2) takes a pace too: version 1, which took none, is
                # refused since protocol 3.
                assert await welcome(old, "n2", PROTOCOL - 1) == 2.0
                assert await welcome(third, "n3", PROTOCOL) == 3.0
                # Three nodes at one a second: n1's 1 s is a third of the fleet's 3 s.
                await first.send_message(encode(Heartbeat(1)))
                assert decode_down(await first.get_message()) == Pace(3.0)
                # Told once: the next heartbeat brings nothing new.
                await first.send_message(encode(Heartbeat(2)))
                await old.send_message(encode(Heartbeat(1)))
                with trio.move_on_after(0.5):
                    got = await first.get_message()
                    raise AssertionError(f"a second pace: {got!r}")
                assert decode_down(await old.get_message()) == Pace(3.0)
            stop.set()


async def test_the_agents_heartbeat_follows_each_pace(autojump_clock: object, tmp_path: Path) -> None:
    config = {
        "name": "n1",
        "server": "ws://127.0.0.1:9/v1/agent",
        "insecure": True,
        "state_dir": str(tmp_path / "state"),
    }
    agent = Agent(parse_agent_config(config, "<test>"), Inventory(name="n1"))
    beats: list[float] = []

    def send(message: UpMessage) -> bool:
        assert isinstance(message, Heartbeat)
        beats.append(trio.current_time())
        return True

    agent._send = send  # type: ignore[method-assign]
    paced = Paced.at(1.0)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        nursery.start_soon(agent._heartbeat, paced)
        await trio.sleep(3.5)
        paced.set(10.0)  # the next one 10 s after the last (at 3), not 1 s
        await trio.sleep(1.5)
        assert len(beats) == 3
        paced.set(0.5)  # past due already (3 + 0.5 < 5): at once, then every 0.5 s
        await trio.sleep(1.1)
        nursery.cancel_scope.cancel()
    assert [round(b - start, 1) for b in beats] == [1.0, 2.0, 3.0, 5.0, 5.5, 6.0]


async def test_the_agent_takes_a_pace_and_closes_on_a_senseless_one(tmp_path: Path) -> None:
    closed: list[trio_websocket.CloseReason | None] = []
    stop = trio.Event()

    async def control_plane(request: trio_websocket.WebSocketRequest) -> None:
        if closed:
            await request.reject(503)  # the redial: nothing more to see
            return
        ws = await request.accept()
        await ws.get_message()  # the registration
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0)))
        await ws.send_message(encode(Pace(12.5)))
        await ws.send_message(encode(Pace(0.0)))
        try:
            while True:
                await ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            closed.append(exc.reason)
            stop.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda **kw: trio_websocket.serve_websocket(
                    control_plane, "127.0.0.1", 0, None, **kw
                )
            )
            config = {
                "name": "n1",
                "server": f"ws://127.0.0.1:{server.port}/v1/agent",
                "insecure": True,
                "state_dir": str(tmp_path / "state"),
            }
            agent = Agent(parse_agent_config(config, "<test>"), Inventory(name="n1"))
            nursery.start_soon(agent.run)
            await stop.wait()
            nursery.cancel_scope.cancel()
    (reason,) = closed
    assert reason is not None and reason.code == 1008 and "makes no sense" in (reason.reason or "")
    # The good pace was taken (its silence bound), the senseless one was not.
    assert agent._silence_s == silence_bound(12.5).cut_after_s
