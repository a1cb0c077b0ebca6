"""One live stream per node name (issue 34, finding 6), against the real control plane in
process, over mutual TLS with one node certificate: a second agent holding it (a cloned VM
image) is refused while the first one's stream answers, and the first keeps serving; a
node whose old stream no longer answers (a reboot without a FIN) takes its name back
within OLD_STREAM_ANSWER_S, and its registration with no shard withdraws no route."""

from __future__ import annotations

import logging
import random
import ssl
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
import trio_websocket

from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_core.awake_time import AwakeTime
from llmgw_core.catalog import Endpoint
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.config import parse_config
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, ShardReport, ShardState
from llmgw_core.wire import (
    PROTOCOL,
    Ack,
    DownMessage,
    Heartbeat,
    Register,
    ShardUpdate,
    Start,
    Welcome,
    decode_down,
    encode,
)
from llmgw_core.ws_frames import MIN_CUT_S
from llmgw_server.control_shell.agents import OLD_STREAM_ANSWER_S, REGISTER_TIMEOUT_S, answers
from llmgw_server.control_shell.controlplane import ControlPlane
from llmgw_server.wiring import Running, main
from tcp_relay import Relay

NODE = Inventory(
    name="n1",
    address="127.0.0.1",
    gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),),
    engines=(EngineInfo("mock", True, "1"),),
)


@attrs.frozen
class Certs:
    ca: Path
    server_crt: Path
    server_key: Path
    node_crt: Path
    node_key: Path

    def client(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.node_crt), str(self.node_key))
        return context


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    directory = tmp_path / "certs"
    init_ca(directory)
    crt, key, _ = issue_node(directory, NODE.name)
    return Certs(
        directory / "ca.crt", directory / "server.crt", directory / "server.key", crt, key
    )


def config(certs: Certs) -> dict[str, object]:
    return {
        "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
        "agents": {
            "ca": str(certs.ca),
            "cert": str(certs.server_crt),
            "key": str(certs.server_key),
        },
        "control": {"settle_after_start_s": 0.0},
        "models": [{"name": "m", "profile": {"engine": "mock", "model": "org/m"}}],
    }


@attrs.define
class FirstAgent:
    """The node's agent as the control plane sees it: registers, runs the replica it is
    told to start (ready at once), heartbeats, and keeps every message it is sent."""

    ws: trio_websocket.WebSocketConnection | None = None
    received: list[DownMessage] = attrs.Factory(list)
    closed: trio_websocket.CloseReason | None = None

    async def run(
        self, url: str, context: ssl.SSLContext, *, task_status: trio.TaskStatus[None]
    ) -> None:
        async with trio_websocket.open_websocket_url(url, context) as ws:
            self.ws = ws
            await ws.send_message(encode(Register(PROTOCOL, "t", NODE)))
            welcome = decode_down(await ws.get_message())
            assert isinstance(welcome, Welcome)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._heartbeat, welcome.heartbeat_interval_s / 5)
                try:
                    while True:
                        message = decode_down(await ws.get_message())
                        self.received.append(message)
                        if isinstance(message, Start):
                            await ws.send_message(encode(Ack(message.command_id)))
                            report = ShardReport(message.spec, ShardState.READY)
                            await ws.send_message(encode(ShardUpdate(report)))
                            task_status.started()
                except trio_websocket.ConnectionClosed as closed:
                    self.closed = closed.reason
                nursery.cancel_scope.cancel()

    async def _heartbeat(self, every_s: float) -> None:
        assert self.ws is not None
        seq = 0
        try:
            while True:
                await trio.sleep(every_s)
                seq += 1
                await self.ws.send_message(encode(Heartbeat(seq)))
        except trio_websocket.ConnectionClosed:
            pass


def served(plane: ControlPlane) -> tuple[Endpoint, ...]:
    return plane.reconciler.serving().get("m", ())


async def wait_for(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.01)


class SlowCeilings(random.Random):
    """Records each backoff ceiling the agent draws under, and waits a fiftieth of it:
    the ceilings show the production delays, the test does not sit through them."""

    def __init__(self) -> None:
        super().__init__(0)
        self.ceilings: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        self.ceilings.append(b)
        return b / 50


def test_the_answer_window_is_the_agents_own_shortest_silence() -> None:
    """A live agent answers a ping from its websocket library's reader: the window is the
    shortest silence the agent takes for a dead stream, and leaves the newcomer its
    answer well before it or the control plane give up on the registration."""
    assert OLD_STREAM_ANSWER_S == MIN_CUT_S
    assert OLD_STREAM_ANSWER_S * 4 <= REGISTER_TIMEOUT_S


async def test_a_second_agent_with_the_nodes_certificate_is_refused_and_the_first_keeps_serving(
    certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(config(certs), "<test>"), stop=stop, **kw)
            )
            plane = running.plane
            assert plane is not None
            url = f"wss://127.0.0.1:{running.control_port}/v1/agent"
            first = FirstAgent()
            await nursery.start(first.run, url, certs.client())
            await wait_for(lambda: bool(served(plane)))
            routes, stream = served(plane), plane.agents.streams[NODE.name]

            # The clone: the real agent, from a copy of the node's name and certificate,
            # with no engine of its own (its registration carries no shard).
            clone_config = parse_agent_config(
                {
                    "name": NODE.name,
                    "server": url,
                    "state_dir": str(tmp_path / "clone-state"),
                    "tls": {
                        "ca": str(certs.ca),
                        "cert": str(certs.node_crt),
                        "key": str(certs.node_key),
                    },
                    "reconnect": {"base_s": 0.5, "cap_s": 30.0},
                },
                "<test>",
            )
            clone = Agent(clone_config, NODE)
            clone.rng = ceilings = SlowCeilings()
            nursery.start_soon(clone.run)

            def refusals() -> list[str]:
                return [
                    r.getMessage()
                    for r in caplog.records
                    if r.name == "llmgw.agent" and "refused this agent" in r.getMessage()
                ]

            await wait_for(lambda: len(refusals()) >= 4)
            # The first agent kept its stream and its node; its replica serves as before,
            # and nothing was sent to stop, drain or start anything.
            assert first.closed is None
            assert plane.agents.streams[NODE.name] is stream
            assert served(plane) == routes
            assert [type(m).__name__ for m in first.received] == ["Start"]
            assert clone.registrations == 0
            assert plane.metrics.streams_refused["duplicate"] >= 4
            nursery.cancel_scope.cancel()
        stop.set()
    # The agent says why, as an error, and backs off as after a refused dial: its delays
    # grow (base 0.5 s, doubling per refusal), it does not spin.
    said = refusals()[0]
    assert f"node {NODE.name} is connected from 127.0.0.1:" in said
    assert "this second agent with its name is refused" in said
    assert f"Two machines run an agent as node '{NODE.name}'" in said
    assert ceilings.ceilings[:4] == [1.0, 2.0, 4.0, 8.0]
    server_said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "llmgw.agentsvc" and r.levelno == logging.WARNING
    ]
    assert any(
        "closing the stream of 127.0.0.1:" in line
        and f"node {NODE.name} is connected from 127.0.0.1:" in line
        and "(a cloned machine or certificate?)" in line
        for line in server_said
    ), server_said
    assert not any("did not answer a ping" in line for line in server_said)


async def test_a_half_open_old_stream_is_replaced_within_the_window_and_no_route_goes(
    certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    """The node's stream goes through a relay that then black-holes it (no FIN, no RST:
    a node that rebooted, a route gone). Its next registration, with no shard (its
    agent's state gone with it, say), waits for the old stream's answer to a ping and
    takes the node within OLD_STREAM_ANSWER_S; the replica that served keeps its route
    (the control plane has not decided its shard is gone), and nothing is started."""
    caplog.set_level(logging.INFO)
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(config(certs), "<test>"), stop=stop, **kw)
            )
            plane = running.plane
            assert plane is not None
            assert running.control_port is not None
            relay = Relay(running.control_port)
            relay_port = await nursery.start(relay.serve)
            first = FirstAgent()
            await nursery.start(
                first.run, f"wss://127.0.0.1:{relay_port}/v1/agent", certs.client()
            )
            await wait_for(lambda: bool(served(plane)))
            routes, old = served(plane), plane.agents.streams[NODE.name]
            relay.black_hole_open_connections()

            url = f"wss://127.0.0.1:{running.control_port}/v1/agent"
            async with trio_websocket.open_websocket_url(url, certs.client()) as rebooted:
                registering = trio.current_time()
                await rebooted.send_message(encode(Register(PROTOCOL, "t", NODE)))
                # Bounded for a starved machine: the window, and room for the loop.
                with trio.fail_after(OLD_STREAM_ANSWER_S + 5):
                    welcome = decode_down(await rebooted.get_message())
                welcomed_after = trio.current_time() - registering
                assert isinstance(welcome, Welcome)
                new = plane.agents.streams[NODE.name]
                assert new is not old and old.cancel_scope.cancel_called
                # The next reconcile, made now: the registration left the replica out.
                plane.apply(plane.reconciler.tick(plane.now()))
                assert served(plane) == routes
                (replica,) = plane.reconciler.view().replicas
                assert [s.unconfirmed for s in replica.shards] == [True]
                assert not plane.reconciler.view().unplaced  # no replacement placed
            nursery.cancel_scope.cancel()
        stop.set()
    # It waited for the ping's window, and not much past it.
    assert welcomed_after >= OLD_STREAM_ANSWER_S - 0.1, welcomed_after
    said = [r.getMessage() for r in caplog.records if r.name == "llmgw.agentsvc"]
    assert any(
        f"node {NODE.name} connected again from 127.0.0.1:" in line
        and f"did not answer a ping within {OLD_STREAM_ANSWER_S:g} s" in line
        for line in said
    ), said
    control = [r.getMessage() for r in caplog.records if r.name == "llmgw.control"]
    assert any(f"node {NODE.name} registered without replica" in line for line in control)


# -- the answer window on trio's autojump clock -------------------------------------------


@attrs.define
class FakePeer:
    """The old stream: its pong arrives `answer_after_s` after the ping, when it does."""

    answer_after_s: float | None
    stall_s: float = 0.0  # the control plane's own process stalls as the pong arrives
    clock: trio.testing.MockClock | None = None
    pinged: list[bytes] = attrs.Factory(list)

    async def ping(self, payload: bytes, answered: trio.Event) -> None:
        self.pinged.append(payload)
        if self.answer_after_s is not None:
            trio.lowlevel.spawn_system_task(self._answer, answered)

    async def _answer(self, answered: trio.Event) -> None:
        assert self.answer_after_s is not None
        await trio.sleep(self.answer_after_s)
        if self.stall_s:
            assert self.clock is not None
            # Time passes with no task running: the pong waits unread in the socket...
            self.clock.jump(self.stall_s)
            # ...and is read in a later turn of the loop, with every timer due at once.
            await trio.lowlevel.checkpoint()
        answered.set()


async def watched(clock: AwakeTime) -> None:
    """The control plane's stall watch (ControlPlane._watch_stalls, without the log)."""
    while True:
        await trio.sleep(clock.tick_s)
        clock.watched(trio.current_time())


async def asked(peer: FakePeer) -> tuple[bool, float]:
    clock = AwakeTime(trio.current_time())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watched, clock)
        began = trio.current_time()
        answered = await answers(peer, trio.Event(), OLD_STREAM_ANSWER_S, clock)
        nursery.cancel_scope.cancel()
    return answered, trio.current_time() - began


async def test_an_answer_within_the_window_counts_and_none_is_given_up_at_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    answered, after = await asked(FakePeer(0.05))
    assert answered and after == pytest.approx(0.05)
    answered, after = await asked(FakePeer(OLD_STREAM_ANSWER_S - 0.1))
    assert answered and after == pytest.approx(OLD_STREAM_ANSWER_S - 0.1)
    answered, after = await asked(FakePeer(None))
    assert not answered and after == pytest.approx(OLD_STREAM_ANSWER_S)
    answered, _ = await asked(FakePeer(OLD_STREAM_ANSWER_S + 1))
    assert not answered


async def test_a_stall_of_the_control_plane_is_not_the_old_streams_silence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The control plane stalls for 5 s just as the old stream's pong arrives: every timer
    is due when it runs again, before the pong is read. The window is awake time: the
    answer counts, the live agent keeps its node and the newcomer is refused."""
    peer = FakePeer(0.5, stall_s=5.0, clock=autojump_clock)
    answered, _ = await asked(peer)
    assert answered
    assert len(peer.pinged) == 1  # asked once
