"""Registrations are served a few at a time, in order, on either control port: the
others wait their turn before their 101 instead of sharing the server's CPU with
thousands of half-done registrations (issue 17, finding 12: 5,000 nodes on the
plaintext port, with no admission in front, registered 573 in 90 s)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import pytest
import trio
import trio_websocket

from llmgw_core.config import parse_config
from llmgw_core.dial import open_agent_stream
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import MAX_FRAME_BYTES, PROTOCOL, Register, Welcome, decode_down, encode
from llmgw_server.control_shell import agents
from llmgw_server.wiring import Running, main


async def test_a_registration_waits_its_turn_and_is_then_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agents, "REGISTRATIONS_AT_ONCE", 1)
    monkeypatch.setattr(agents, "REGISTER_TIMEOUT_S", 2.0)
    config = parse_config(
        {
            "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
            "agents": {"insecure": True},
            "models": [
                {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
            ],
        },
        "<test>",
    )
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"

            def stream() -> AbstractAsyncContextManager[trio_websocket.WebSocketConnection]:
                return open_agent_stream(
                    url, None, connect_timeout_s=10, disconnect_timeout_s=1,
                    max_message_size=MAX_FRAME_BYTES,
                )

            # The first agent takes the only turn and never registers: it holds the turn
            # until the server gives up on it (REGISTER_TIMEOUT_S). Timed from before
            # the first's connect, so that its 2 s are all inside what is measured.
            t0 = trio.current_time()
            async with stream():
                async with stream() as ws:
                    waited = trio.current_time() - t0  # its 101 came with its turn
                    inventory = Inventory(
                        name="node-b", gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),)
                    )
                    await ws.send_message(encode(Register(PROTOCOL, "test", inventory)))
                    assert isinstance(decode_down(await ws.get_message()), Welcome)
                # Today's code: at once, no turns. Below 8 s, not 6: a starved machine
                # (CI's) delays the turn by seconds; a turn never given back would fail
                # the second's connect at 10 s.
                assert 1.5 < waited < 8.0, waited
            stop.set()
            nursery.cancel_scope.cancel()
