"""Agents follow the leader of control planes kept in a store (issue 35), and refuse what
a leader of an older epoch sends.

The pure choice of the next control plane (`llmgw_agent.following`) is tested alone; then
a real `Agent` dials small websocket servers written here, standing in for standbys (they
close with NOT_LEADER_CLOSE) and for leaders (a welcome with an epoch, then commands),
over real loopback sockets, since what is tested is the close codes and reasons. The
agent's random source records the jitter it draws, so the tests see which wait it chose
without sitting through a backoff. Last, a protocol-2 agent against an in-process
control plane.
"""

from __future__ import annotations

import json
import logging
import random
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio_websocket

from llmgw_agent.agent import Agent
from llmgw_agent.config import AgentConfig, parse_agent_config
from llmgw_agent.following import (
    ELECTION_JITTER_S,
    FAILOVER_DIAL_S,
    FAILOVER_WINDOW_S,
    LEADER_JITTER_S,
    ControlPlanes,
    Ended,
    lost_after,
    stale,
)
from llmgw_core.config import parse_config
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec
from llmgw_core.tomlshape import ConfigError
from llmgw_core.wire import (
    NOT_LEADER_CLOSE,
    PROTOCOL,
    STALE_EPOCH_CLOSE,
    Ack,
    DownMessage,
    Mark,
    Pace,
    Register,
    Start,
    Welcome,
    decode_down,
    decode_up,
    encode,
    not_leader_reason,
)
from llmgw_server.wiring import Running, main

A, B, C = (f"wss://cp-{n}.example:8081/v1/agent" for n in "abc")
ELECTION = ELECTION_JITTER_S


# -- the choice of the next control plane, pure -----------------------------------------


def test_a_leader_named_by_a_standby_is_dialled_next_at_once() -> None:
    planes = ControlPlanes((A, B, C))
    redial = planes.after(Ended.NOT_LEADER, now=0.0, rng=random.Random(1), leader=C)
    assert redial is not None and redial.delay_s is not None
    assert planes.current == C and 0 <= redial.delay_s <= LEADER_JITTER_S
    assert redial.why == f"{A} does not lead: the leader is"


def test_a_dial_during_a_failover_gives_up_on_a_frozen_control_plane_sooner() -> None:
    """Going down the list during a failover, the next control plane may be the one that
    froze, whose kernel still accepts: the dial's patience is short, so the agent moves
    on. A leader a standby named is waited for (a new leader queues the whole fleet),
    and so is any control plane outside a failover."""
    planes = ControlPlanes((A, B, C))
    assert planes.dial_patience_s(0.0, 45.0) == 45.0  # no failover
    planes.after(Ended.LEADER_LOST, now=0.0, rng=random.Random(1), welcomed=True, epoch=3)
    assert planes.current == B
    assert planes.dial_patience_s(1.0, 45.0) == FAILOVER_DIAL_S
    planes.after(Ended.NOT_LEADER, now=1.0, rng=random.Random(1), leader=C)
    assert planes.current == C and planes.dial_patience_s(1.5, 45.0) == 45.0  # named
    # The named leader did not answer in time: the backoff decides the wait (a whole
    # fleet dialling again at once would only feed what kept it from answering).
    redial = planes.after(Ended.FAILED, now=2.0, rng=random.Random(1))
    assert redial is not None and redial.delay_s is None and "did not answer" in redial.why
    assert planes.current == A and planes.dial_patience_s(2.5, 45.0) == FAILOVER_DIAL_S
    # Going down the list, a control plane that fails is passed after the short jitter.
    redial = planes.after(Ended.FAILED, now=3.0, rng=random.Random(1))
    assert redial is not None and redial.delay_s is not None and planes.current == B
    assert planes.dial_patience_s(FAILOVER_WINDOW_S + 1, 45.0) == 45.0  # the window ended
    alone = ControlPlanes((A,))
    alone.after(Ended.LEADER_LOST, now=0.0, rng=random.Random(1))
    assert alone.dial_patience_s(1.0, 45.0) == 45.0  # no other to try


def test_a_failover_soon_after_the_last_gets_a_window_of_its_own() -> None:
    """A leader elected in a failover that is lost again before its session counted as
    healthy: the agent still dials the next control plane after the short jitter, not
    after the backoff of the first failover's spent window."""
    planes, rng = ControlPlanes((A, B, C)), random.Random(3)
    planes.after(Ended.LEADER_LOST, now=0.0, rng=rng, welcomed=True, epoch=5)  # the first
    # Registered with the new leader (epoch 9) late in the window; lost 5 s after, past it.
    late = FAILOVER_WINDOW_S - 1
    redial = planes.after(Ended.LEADER_LOST, now=late + 5, rng=rng, welcomed=True, epoch=9)
    assert redial is not None and redial.delay_s is not None  # a window of its own
    # The same leadership lost again (a flapping leader): the window is not renewed.
    spent = late + 5 + FAILOVER_WINDOW_S + 1
    again = planes.after(Ended.LEADER_LOST, now=spent, rng=rng, welcomed=True, epoch=9)
    assert again is not None and again.delay_s is None  # the backoff


def test_the_control_plane_named_as_lost_is_the_one_that_ended_the_stream_or_failed() -> None:
    assert lost_after(A, Ended.LEADER_LOST, True, None, busy=False) == A  # its stream broke
    assert lost_after(B, Ended.FAILED, False, A, busy=False) == B  # could not reach it
    assert lost_after(B, Ended.NOT_LEADER, False, A, busy=False) == A  # a standby: kept
    assert lost_after(B, Ended.STALE, False, A, busy=False) == A
    assert lost_after(B, Ended.FAILED, False, A, busy=True) == A  # busy lives


def test_a_leader_is_recognised_whatever_the_case_of_its_host_or_a_trailing_slash() -> None:
    planes = ControlPlanes((A, B, C))
    assert planes.configured("wss://CP-b.example:8081/v1/agent/") == 1
    assert planes.configured("wss://cp-b.example:8082/v1/agent") is None  # another port
    assert planes.configured("ws://cp-b.example:8081/v1/agent") is None  # plaintext
    assert planes.configured("wss://cp-b.example:bad/v1/agent") is None


def test_with_no_leader_the_next_control_plane_is_dialled_after_the_jitter_for_a_window() -> None:
    planes, rng = ControlPlanes((A, B, C)), random.Random(2)
    delays = []
    for at in (0.0, 1.0, 2.0):
        redial = planes.after(Ended.NOT_LEADER, now=at, rng=rng, reason="no leader is elected")
        assert redial is not None and redial.delay_s is not None
        delays.append(redial.delay_s)
    assert all(ELECTION[0] <= d <= ELECTION[1] for d in delays)
    assert planes.current == A  # round the list: B, C, then A again
    # Failed dials during the failover keep the short jitter, round the list.
    redial = planes.after(Ended.FAILED, now=FAILOVER_WINDOW_S - 1, rng=rng)
    assert redial is not None and redial.delay_s is not None and planes.current == B
    # Past the window the backoff decides (still moving on through the list).
    redial = planes.after(Ended.NOT_LEADER, now=FAILOVER_WINDOW_S, rng=rng)
    assert redial is not None and redial.delay_s is None and planes.current == C
    # A healthy session closes the spent window: the next failover gets a new one.
    redial = planes.after(Ended.LEADER_LOST, now=100.0, rng=rng, healthy=True, welcomed=True)
    assert redial is not None and redial.delay_s is not None and planes.current == A
    assert planes.failover_until == 100.0 + FAILOVER_WINDOW_S


def test_a_leader_outside_the_list_is_not_followed() -> None:
    planes = ControlPlanes((A, B))
    elsewhere = "wss://attacker.example:8081/v1/agent"
    redial = planes.after(Ended.NOT_LEADER, now=0.0, rng=random.Random(3), leader=elsewhere)
    assert redial is not None and redial.delay_s is not None
    assert planes.current == B and ELECTION[0] <= redial.delay_s <= ELECTION[1]
    assert redial.why == f"{A} names {elsewhere} as the leader, which is not one of this " \
        "agent's control planes (`server`): not followed"  # fmt: skip


def test_standbys_that_name_each_other_are_not_followed_at_once_forever() -> None:
    planes, rng = ControlPlanes((A, B)), random.Random(4)
    delays = []
    for hop in range(6):
        redial = planes.after(Ended.NOT_LEADER, now=hop, rng=rng, leader=(B, A)[hop % 2])
        assert redial is not None and redial.delay_s is not None
        delays.append(redial.delay_s)
    assert all(d <= LEADER_JITTER_S for d in delays[:2])  # one hop per control plane
    assert all(d >= ELECTION[0] for d in delays[2:])
    # A welcome starts the count over.
    planes.after(Ended.LEADER_LOST, now=7.0, rng=rng, welcomed=True)
    redial = planes.after(Ended.NOT_LEADER, now=8.0, rng=rng, leader=A)
    assert redial is not None and redial.delay_s is not None
    assert redial.delay_s <= LEADER_JITTER_S


def test_a_broken_leader_stream_tries_the_next_one_and_one_control_plane_keeps_its_backoff() -> (
    None
):
    planes = ControlPlanes((A, B, C), index=1)
    redial = planes.after(Ended.LEADER_LOST, now=0.0, rng=random.Random(5), welcomed=True)
    assert redial is not None and redial.delay_s is not None
    assert planes.current == C and ELECTION[0] <= redial.delay_s <= ELECTION[1]
    alone = ControlPlanes((A,))
    assert alone.after(Ended.LEADER_LOST, now=0.0, rng=random.Random(), welcomed=True) is None
    assert alone.after(Ended.FAILED, now=0.0, rng=random.Random()) is None


def test_a_busy_control_plane_is_dialled_again_at_its_turn_during_a_failover() -> None:
    planes = ControlPlanes((A, B, C))
    planes.after(Ended.NOT_LEADER, now=0.0, rng=random.Random(6), leader=B)
    redial = planes.after(Ended.FAILED, now=1.0, rng=random.Random(6), come_back_s=3.0)
    assert redial is not None and redial.delay_s is not None
    assert planes.current == B and 3.0 + ELECTION[0] <= redial.delay_s <= 3.0 + ELECTION[1]


def test_epoch_0_is_never_stale_and_a_lower_epoch_always_is() -> None:
    assert not stale(0, 9)  # a control plane without a store: never fenced
    assert not stale(9, 9) and not stale(10, 9) and not stale(1, 0)
    assert stale(8, 9) and stale(1, 2)


# -- the agent's `server`: one URL or a list ---------------------------------------------


def agent_config(server: object, **more: object) -> AgentConfig:
    return parse_agent_config({"name": "n1", "insecure": True, "server": server, **more}, "<a>")


def test_server_takes_one_url_as_before_or_a_list_of_control_planes() -> None:
    one = agent_config("ws://127.0.0.1:8081/v1/agent")
    assert one.servers == ("ws://127.0.0.1:8081/v1/agent",)
    assert one.server == "ws://127.0.0.1:8081/v1/agent"
    three = [f"ws://10.0.0.{i}:8081/v1/agent" for i in (1, 2, 3)]
    config = agent_config(three, advertise_host="10.0.0.9")
    assert config.servers == tuple(three) and config.server == three[0]
    # 127.0.0.1 goes without saying only when every control plane is on this machine.
    assert agent_config(["ws://127.0.0.1:1/v1/agent", "ws://[::1]:2/v1/agent"]).advertise_host == (
        "127.0.0.1"
    )


@pytest.mark.parametrize(
    ("server", "more", "error"),
    [
        ([], {}, "server: must name at least one control plane's ws:// or wss:// URL"),
        (3, {}, "server: must be a URL or an array of URLs, not an integer"),
        (["ws://10.0.0.1:1/v1/agent", 3], {}, r"server\[1\]: must be a string, not an integer"),
        (
            ["ws://10.0.0.1:1/v1/agent", "http://10.0.0.2:1/v1/agent"],
            {},
            r"server\[1\]: 'http://10.0.0.2:1/v1/agent' must be a ws:// or wss:// URL",
        ),
        (
            ["ws://10.0.0.1:1/v1/agent", "ws://<cp>:1/v1/agent"],
            {},
            r"server\[1\]: .*'<cp>' is not a host name",
        ),
        (
            ["ws://10.0.0.1:1/v1/agent", "ws://10.0.0.1:1/v1/agent"],
            {},
            r"server\[1\]: 'ws://10.0.0.1:1/v1/agent' is listed twice",
        ),
        (
            ["ws://10.0.0.1:1/v1/agent", "wss://10.0.0.2:1/v1/agent"],
            {},
            r"server\[1\]: .*give every control plane the same scheme",
        ),
        (
            ["ws://127.0.0.1:1/v1/agent", "ws://10.0.0.2:1/v1/agent"],
            {"advertise_host": "127.0.0.1"},
            "advertise_host: '127.0.0.1' is a loopback address, but the control plane is at "
            "10.0.0.2",
        ),
        (
            ["ws://127.0.0.1:1/v1/agent", "ws://10.0.0.2:1/v1/agent"],
            {},
            "advertise_host: is required",
        ),
    ],
)
def test_a_server_list_is_checked_as_one_url_is(
    server: object, more: dict[str, object], error: str
) -> None:
    with pytest.raises(ConfigError, match=error):
        agent_config(server, **more)


def test_a_plaintext_list_needs_insecure() -> None:
    with pytest.raises(ConfigError, match=r"server: 'ws://10.0.0.1:1/v1/agent', .* plaintext"):
        parse_agent_config(
            {"name": "n1", "server": ["ws://10.0.0.1:1/v1/agent", "ws://10.0.0.2:1/v1/agent"]},
            "<a>",
        )


# -- a real agent against standbys and leaders -------------------------------------------


class Jitter(random.Random):
    """Records each uniform(a, b) the agent draws and answers a: the tests see which wait
    was chosen (a leader's, an election's, the backoff's) without sitting through it."""

    def __init__(self) -> None:
        super().__init__(0)
        self.drawn: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.drawn.append((a, b))
        return a


Behaviour = Callable[[trio_websocket.WebSocketConnection], Awaitable[None]]


class Stub:
    """A control plane stand-in on a loopback port: what it does with each stream."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.dials = 0
        self.port = 0
        self.closed: list[trio_websocket.CloseReason] = []  # how the agent closed streams

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/agent"

    async def start(self, nursery: trio.Nursery) -> Stub:
        async def handler(request: trio_websocket.WebSocketRequest) -> None:
            self.dials += 1
            ws = await request.accept()
            try:
                await self.behaviour(ws)
            except trio_websocket.ConnectionClosed as closed:
                if closed.reason is not None:
                    self.closed.append(closed.reason)

        server = await nursery.start(
            lambda **kw: trio_websocket.serve_websocket(handler, "127.0.0.1", 0, None, **kw)
        )
        self.port = server.port
        return self


def standby(leader: Callable[[], str | None]) -> Behaviour:
    async def behaviour(ws: trio_websocket.WebSocketConnection) -> None:
        assert isinstance(decode_up(await ws.get_message()), Register)
        await ws.aclose(code=NOT_LEADER_CLOSE, reason=not_leader_reason(leader()))

    return behaviour


def hasty_standby(leader: Callable[[], str | None]) -> Behaviour:
    """Closes at once, before the agent's register arrives (as StandbyAnswers does)."""

    async def behaviour(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.aclose(code=NOT_LEADER_CLOSE, reason=not_leader_reason(leader()))

    return behaviour


def leader(epoch: int, *then: DownMessage, acks: list[Ack] | None = None) -> Behaviour:
    """Welcomes with `epoch`, sends `then`, collects the acks, and reads until closed."""

    async def behaviour(ws: trio_websocket.WebSocketConnection) -> None:
        assert isinstance(decode_up(await ws.get_message()), Register)
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0, epoch=epoch)))
        for message in then:
            await ws.send_message(encode(message))
        while True:
            up = decode_up(await ws.get_message())
            if isinstance(up, Ack) and acks is not None:
                acks.append(up)

    return behaviour


GPU = Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500)
INVENTORY = Inventory(name="n1", gpus=(GPU,), engines=(EngineInfo("mock", True, "1"),))


def agent_for(tmp_path: Path, *servers: str) -> Agent:
    config = parse_agent_config(
        {
            "name": "n1",
            "server": list(servers),
            "insecure": True,
            "state_dir": str(tmp_path / "state"),
            # A backoff this long would show: the tests end well within it.
            "reconnect": {"base_s": 30.0, "cap_s": 60.0},
        },
        "<test>",
    )
    agent = Agent(config, INVENTORY)
    agent.rng = Jitter()
    return agent


async def registered(agent: Agent, count: int = 1) -> None:
    while agent.registrations < count:
        await trio.sleep(0.01)


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.agent"]


async def test_the_agent_goes_from_a_standby_to_the_leader_it_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            lead = await Stub(leader(5)).start(nursery)
            passed_over = await Stub(standby(lambda: None)).start(nursery)
            first = await Stub(standby(lambda: lead.url)).start(nursery)
            agent = agent_for(tmp_path, first.url, passed_over.url, lead.url)
            await nursery.start(agent.run)
            await registered(agent)
            nursery.cancel_scope.cancel()
    assert (first.dials, passed_over.dials, lead.dials) == (1, 0, 1)
    assert isinstance(agent.rng, Jitter) and agent.rng.drawn == [(0, LEADER_JITTER_S)]
    assert agent.epoch == 5
    lines = logged(caplog)
    assert f"{first.url} does not lead: the leader is: dialing {lead.url} in 0.00 s" in lines
    assert f"registered with {lead.url} (epoch 5, 0 shards)" in lines


async def test_a_standby_that_closes_before_the_register_still_names_the_leader(
    tmp_path: Path,
) -> None:
    """The standby's close may reach the agent before its register is sent: the close
    still says where the leader is (not a failed dial, which takes the next one)."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            lead = await Stub(leader(5)).start(nursery)
            passed_over = await Stub(hasty_standby(lambda: None)).start(nursery)
            first = await Stub(hasty_standby(lambda: lead.url)).start(nursery)
            agent = agent_for(tmp_path, first.url, passed_over.url, lead.url)
            await nursery.start(agent.run)
            await registered(agent)
            nursery.cancel_scope.cancel()
    assert (first.dials, passed_over.dials, lead.dials) == (1, 0, 1)


async def test_with_no_leader_the_agent_tries_the_next_control_plane_after_the_jitter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            lead = await Stub(leader(2)).start(nursery)
            electing = await Stub(standby(lambda: None)).start(nursery)
            agent = agent_for(tmp_path, electing.url, lead.url)
            await nursery.start(agent.run)
            began = trio.current_time()
            await registered(agent)
            took = trio.current_time() - began
            nursery.cancel_scope.cancel()
    assert isinstance(agent.rng, Jitter) and agent.rng.drawn == [ELECTION]
    assert took >= ELECTION[0]  # the jitter was waited (its lower end, as drawn here)
    assert (
        f"{electing.url} does not lead (no leader is elected now): "
        f"dialing {lead.url} in {ELECTION[0]:.2f} s"
    ) in logged(caplog)


async def test_a_leader_outside_the_agents_list_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            elsewhere = await Stub(leader(1)).start(nursery)  # would take the agent
            lead = await Stub(leader(1)).start(nursery)
            hostile = await Stub(standby(lambda: elsewhere.url)).start(nursery)
            agent = agent_for(tmp_path, hostile.url, lead.url)
            await nursery.start(agent.run)
            await registered(agent)
            nursery.cancel_scope.cancel()
    assert (hostile.dials, elsewhere.dials, lead.dials) == (1, 0, 1)
    assert (
        f"{hostile.url} names {elsewhere.url} as the leader, which is not one of this agent's "
        f"control planes (`server`): not followed: dialing {lead.url} in {ELECTION[0]:.2f} s"
    ) in logged(caplog)


async def test_when_the_leaders_stream_breaks_the_agent_tries_the_next_one_at_once(
    tmp_path: Path,
) -> None:
    async def leads_then_breaks(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.get_message()
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0, epoch=3)))
        await ws.aclose(code=1011, reason="gone")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            second = await Stub(leader(4)).start(nursery)
            first = await Stub(leads_then_breaks).start(nursery)
            agent = agent_for(tmp_path, first.url, second.url)
            await nursery.start(agent.run)
            await registered(agent, 2)
            nursery.cancel_scope.cancel()
    assert (first.dials, second.dials) == (1, 1)
    # The election's jitter, not the backoff (whose base is 30 s here).
    assert isinstance(agent.rng, Jitter) and agent.rng.drawn == [ELECTION]
    assert agent.epoch == 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def mock_spec(port: int) -> LaunchSpec:
    return LaunchSpec(
        replica_id="m-1",
        model_name="m",
        engine="mock",
        hf_model="org/m",
        args=(),
        env={},
        tensor_parallel=1,
        pipeline_parallel=1,
        rank=0,
        nodes=("n1",),
        gpu_indices=(0,),
        head_address="127.0.0.1",
        port=port,
        dist_port=0,
    )


async def test_commands_of_a_lower_epoch_are_refused_and_nothing_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    acks: list[Ack] = []
    stale_ones: list[DownMessage] = [
        Start(1, mock_spec(free_port()), epoch=6),  # one that would start
        Mark(2, True, False, epoch=6),
        Pace(0.5, epoch=6),
    ]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            lead = Stub(leader(7, *stale_ones, Mark(3, True, False, epoch=7), acks=acks))
            await lead.start(nursery)
            agent = agent_for(tmp_path, lead.url)
            await nursery.start(agent.run)
            while len(acks) < 3:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    refused = "stale epoch 6: this agent follows epoch 7"
    assert acks == [Ack(1, ok=False, error=refused), Ack(2, ok=False, error=refused), Ack(3)]
    assert agent.stale_commands_refused == 3  # the pace too, which has nothing to ack
    assert agent.cordoned  # by the current leader's mark, after the stale one
    # Nothing started: no shard, no record or log of an engine in the state directory.
    state = tmp_path / "state"
    assert agent.engines.shards == {}
    assert not (state / "shards").exists() and not (state / "logs").exists()
    lines = logged(caplog)
    assert f"refused a start: {refused}" in lines
    assert sum("refused a" in line for line in lines) == 1  # one line per 10 s, counted


async def test_a_stale_welcome_is_closed_and_the_highest_epoch_survives_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            old = await Stub(leader(6)).start(nursery)
            agent = agent_for(tmp_path, old.url)
            await nursery.start(agent.run)
            await registered(agent)
            nursery.cancel_scope.cancel()
    flags = tmp_path / "state" / "flags.json"
    assert json.loads(flags.read_text()) == {"cordoned": False, "draining": False, "epoch": 6}

    # A new agent process on the same node: it follows epoch 6 before it dials.
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            paused = await Stub(leader(5, Mark(1, True, True, epoch=5))).start(nursery)
            lead = await Stub(leader(8)).start(nursery)
            agent = agent_for(tmp_path, paused.url, lead.url)
            assert agent.epoch == 6
            await nursery.start(agent.run)
            await registered(agent)
            nursery.cancel_scope.cancel()
    assert [(c.code, c.reason) for c in paused.closed] == [
        (STALE_EPOCH_CLOSE, "stale epoch 5: this agent follows epoch 6")
    ]
    assert not agent.cordoned and agent.registrations == 1
    assert agent.epoch == 8 and json.loads(flags.read_text())["epoch"] == 8
    assert isinstance(agent.rng, Jitter) and agent.rng.drawn == [ELECTION]
    assert (
        f"{paused.url} welcomed this agent with epoch 5, but it follows epoch 6 (that control "
        "plane led once and no longer does): closing the stream"
    ) in logged(caplog)


def test_a_flags_file_of_an_older_agent_means_epoch_0(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "flags.json").write_text('{"cordoned": true, "draining": false}')
    agent = agent_for(tmp_path, "ws://127.0.0.1:1/v1/agent")
    assert agent.epoch == 0 and agent.cordoned
    (tmp_path / "state" / "flags.json").write_text('{"cordoned": true, "epoch": -3}')
    assert agent_for(tmp_path, "ws://127.0.0.1:1/v1/agent").epoch == 0


# -- the control plane's end ---------------------------------------------------------

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "models": [
        {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
    ],
}


async def test_a_protocol_2_agent_registers_and_every_message_carries_the_planes_epoch() -> None:
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            plane = running.plane
            assert plane is not None and plane.epoch == 0  # no store: unfenced
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"
            async with trio_websocket.open_websocket_url(url) as unfenced:
                await unfenced.send_message(encode(Register(PROTOCOL, "t", Inventory(name="a"))))
                assert decode_down(await unfenced.get_message()) == Welcome(PROTOCOL, 5.0)
            plane.epoch = 7  # as an election won makes it
            async with (
                trio_websocket.open_websocket_url(url) as old,
                trio_websocket.open_websocket_url(url) as new,
            ):
                # A protocol-2 agent's register, as its code wrote it (no key of version 3).
                v2 = {
                    "protocol": 2,
                    "agent_version": "0.9",
                    "inventory": {"name": "n2"},
                    "type": "register",
                }
                await old.send_message(json.dumps(v2))
                welcome = json.loads(await old.get_message())
                # Welcomed in its own version; the epoch is a key it does not know and skips.
                assert welcome == {
                    "type": "welcome",
                    "protocol": 2,
                    "heartbeat_interval_s": 5.0,
                    "epoch": 7,
                }
                await new.send_message(encode(Register(PROTOCOL, "t", Inventory(name="n3"))))
                assert decode_down(await new.get_message()) == Welcome(PROTOCOL, 5.0, epoch=7)
                for node, ws in (("n2", old), ("n3", new)):
                    command_id = plane.agents.next_command_id()
                    assert plane.agents.send(node, Mark(command_id, True, False))
                    assert decode_down(await ws.get_message()) == Mark(
                        command_id, True, False, epoch=7
                    )
            stop.set()
