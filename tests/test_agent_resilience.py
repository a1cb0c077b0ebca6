"""The agent outlives any control plane: bad frames, silence, refusals. Its engines never
depend on one connection."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing
import trio_websocket

from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_core.inventory import Inventory
from llmgw_core.wire import PROTOCOL, Welcome, encode

# JSON has no NaN or infinities, but Python's json module reads and writes them, so a
# control plane may send them as a heartbeat interval.
NON_FINITE = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}


async def test_the_agent_reconnects_through_bad_frames_silence_and_refusals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    """On trio's autojump clock: the agent's 10 s wait for a welcome passes at once.
    Everything runs in this one trio loop over loopback (an address, no resolver
    thread), so time jumps only when every task waits for a timer."""
    caplog.set_level(logging.ERROR, logger="llmgw.agent")
    intervals = [f"interval {token}" for token in NON_FINITE]
    behaviours = ["garbage after welcome", "no welcome", "garbage instead of welcome", "refuse", *intervals]
    seen: list[str] = []

    async def control_plane(request: trio_websocket.WebSocketRequest) -> None:
        what = behaviours[len(seen) % len(behaviours)]
        seen.append(what)
        if what == "refuse":
            await request.reject(403)
            return
        ws = await request.accept()
        await ws.get_message()  # the registration
        if what == "garbage after welcome":
            await ws.send_message(encode(Welcome(PROTOCOL, 5.0)))
            await ws.send_message("this is not json")
        elif what == "garbage instead of welcome":
            await ws.send_message("{]")
        elif what in intervals:
            frame = encode(Welcome(PROTOCOL, 7.25))
            assert frame.count(":7.25,") == 1
            await ws.send_message(frame.replace(":7.25,", f":{what.split()[1]},"))
        await trio.sleep(30)  # "no welcome": the agent gives up waiting on its own

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            servers = await nursery.start(lambda **kw: trio_websocket.serve_websocket(control_plane, "127.0.0.1", 0, None, **kw))
            port = servers.port
            config = parse_agent_config(
                {
                    "name": "n1",
                    "server": f"ws://127.0.0.1:{port}/v1/agent",
                    "insecure": True,
                    "state_dir": str(tmp_path / "state"),
                    "reconnect": {"base_s": 0.01, "cap_s": 0.05},
                },
                "<test>",
            )
            agent = Agent(config, Inventory(name="n1"))
            await nursery.start(agent.run)
            while len(seen) < len(behaviours) + 1:  # every behaviour, then one more dial
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert seen[: len(behaviours)] == behaviours
    # Each interval was refused as such, not left to break the session further on.
    refused = [r.getMessage() for r in caplog.records if "heartbeat interval" in r.getMessage()]
    assert refused == [
        f"the control plane sent a bad frame: a heartbeat interval of {value} s makes no sense"
        for value in NON_FINITE.values()
    ]
