"""An engine that fails while the control plane is away: the agent's next registration
says so, and the failure's report with the engine's output tail follows its welcome (the
update that no stream took is not lost). A real agent and engine process, a control plane
of the test's own over loopback."""

from __future__ import annotations

from pathlib import Path

import trio
import trio_websocket

from llmgw_core.inventory import LaunchSpec, ShardState
from llmgw_core.wire import (
    PROTOCOL,
    Heartbeat,
    Register,
    ShardUpdate,
    Start,
    Welcome,
    decode_up,
    encode,
)
from procs import free_port
from test_engine_flags import HELP, vllm_agent

# vLLM's help for the agent's flag check; otherwise an engine that says a line, waits
# for the test's word, says its last one and exits 1.
FAILING_ENGINE = """\
import os, sys, time
if sys.argv[1:] == ["serve", "--help=all"]:
    sys.stdout.write(open(os.environ["FAKE_VLLM_HELP"]).read())
    sys.exit(0)
print("loading the weights", flush=True)
while not os.path.exists(os.environ["FAIL_NOW"]):
    time.sleep(0.05)
print("CUDA error: an illegal memory access was encountered", flush=True)
sys.exit(1)
"""


async def test_a_failure_while_away_is_registered_then_reported_with_its_tail(tmp_path: Path) -> None:
    engine = tmp_path / "engine.py"
    engine.write_text(FAILING_ENGINE)
    fail_now = tmp_path / "fail-now"
    spec = LaunchSpec(
        replica_id="r-1", model_name="m", engine="vllm", hf_model="org/m", args=(), env={},
        tensor_parallel=1, pipeline_parallel=1, rank=0, nodes=("n1",), gpu_indices=(0,),
        head_address="127.0.0.1", port=free_port(), dist_port=0,
    )  # fmt: skip
    away, back = trio.Event(), trio.Event()
    registered: list[Register] = []
    after_welcome: list[ShardUpdate] = []
    heartbeat = trio.Event()

    async def control_plane(request: trio_websocket.WebSocketRequest) -> None:
        if away.is_set():
            await back.wait()  # the agent's dial waits for the handshake meanwhile
        ws = await request.accept()
        register = decode_up(await ws.get_message())
        assert isinstance(register, Register)
        registered.append(register)
        # Back: a heartbeat soon, which the agent sends after what it queued at the welcome.
        await ws.send_message(encode(Welcome(PROTOCOL, 0.5 if away.is_set() else 5.0)))
        if not away.is_set():
            await ws.send_message(encode(Start(1, spec)))
            while True:  # until the engine runs, then away
                message = decode_up(await ws.get_message())
                if isinstance(message, ShardUpdate) and message.report.state is ShardState.STARTING:
                    break
            away.set()
            await ws.aclose()
            return
        while not isinstance(message := decode_up(await ws.get_message()), Heartbeat):
            if isinstance(message, ShardUpdate):
                after_welcome.append(message)
        heartbeat.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda **kw: trio_websocket.serve_websocket(control_plane, "127.0.0.1", 0, None, **kw)
            )
            env = {
                "FAKE_VLLM_HELP": str(HELP / "vllm-0.32.0-serve-help-all.txt"),
                "FAIL_NOW": str(fail_now),
            }
            reconnect = {"base_s": 0.1, "cap_s": 0.2}
            agent = vllm_agent(tmp_path, server.port, engine, env, reconnect=reconnect)
            await nursery.start(agent.run)
            await away.wait()
            while agent.connected.is_set():
                await trio.sleep(0.01)  # the agent has seen its stream end
            fail_now.touch()
            while agent.engines.shards[("r-1", 0)].state is not ShardState.FAILED:
                await trio.sleep(0.01)
            back.set()
            await heartbeat.wait()
            nursery.cancel_scope.cancel()

    first, again = registered
    assert first.shards == ()
    (carried,) = again.shards
    assert carried.spec == spec and carried.state is ShardState.FAILED
    (update,) = after_welcome
    assert update.report == carried
    assert update.output_tail[-1] == "CUDA error: an illegal memory access was encountered"
    assert "loading the weights" in update.output_tail
