"""Silence is a failure on both ends of the agent stream.

The agent cuts a stream on which nothing has come from the control plane for
its silence bound and dials again at once, if the stream was healthy for a
while; the server closes the stream of a node it declares unreachable, unless
the mass-loss guard holds (a control plane that stalled must not have the whole
fleet register again at once). Pure parts with an autojump clock, the two ends
in process over real sockets, and the whole with real processes and a relay
that black-holes the open connection while new ones get through.
"""

from __future__ import annotations

import functools
import logging
import random
import signal
import sys
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path

import attrs
import httpx
import pytest
import trio
import trio_websocket

from fleet import Fleet, wait_until
from llmgw_agent.agent import Agent
from llmgw_agent.config import AgentConfig, parse_agent_config
from llmgw_core.config import parse_config
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import (
    PROTOCOL,
    Ack,
    Heartbeat,
    Mark,
    Register,
    Welcome,
    decode_down,
    decode_up,
    encode,
)
from llmgw_core.ws_frames import (
    LONG_INTERVAL_SLACK_S,
    MAX_CUT_S,
    MIN_CUT_S,
    Heard,
    SilenceBound,
    cut_when_silent,
    silence_bound,
)
from llmgw_server.control.lifecycle import Lifecycle, NodeStatus, NodeTransition
from llmgw_server.control_shell.agents import silent_streams
from llmgw_server.wiring import Running, main
from procs import Proc, free_port
from tcp_relay import Relay

# -- the bound ----------------------------------------------------------------


def test_the_bound_follows_the_heartbeat_interval_and_keeps_the_30_s_promise() -> None:
    assert silence_bound(5.0) == SilenceBound(probe_after_s=10.0, cut_after_s=20.0)
    assert silence_bound(0.5) == SilenceBound(probe_after_s=1.0, cut_after_s=2.0)
    assert silence_bound(0.05).cut_after_s == MIN_CUT_S  # a busy peer is not cut at 0.2 s
    assert silence_bound(5.0).cut_after_s == MAX_CUT_S
    base = attrs.fields(AgentConfig).reconnect_base_s.default
    assert base is not None  # attrs types a default as optional: a field may have none
    for interval in (0.05, 0.5, 1, 4.9, 5):  # what a control plane within its pace gives
        bound = silence_bound(interval)
        assert 0 < bound.probe_after_s < bound.cut_after_s
        # Cut, then the redial of a session that registered: room left for the dial itself.
        assert bound.cut_after_s + base <= 25


def test_a_paced_fleets_long_interval_is_not_pinged_between_its_acks() -> None:
    # A large fleet's control plane gives longer intervals (heartbeat_pace): each
    # heartbeat's ack comes within the interval, so a healthy stream is never pinged,
    # and a dead one is cut after two intervals and the slack.
    assert silence_bound(50.0) == SilenceBound(probe_after_s=55.0, cut_after_s=110.0)
    assert silence_bound(3600).cut_after_s == 2 * 3600 + LONG_INTERVAL_SLACK_S
    for interval in (5.1, 7, 20, 60, 3600):
        bound = silence_bound(interval)
        assert interval < bound.probe_after_s < bound.cut_after_s
        assert MAX_CUT_S < bound.cut_after_s <= 2 * interval + LONG_INTERVAL_SLACK_S


# -- the watch, on an autojump clock ----------------------------------------------


class FakePeer:
    """Answers pings after a round trip, or never (a black-holed route)."""

    def __init__(self, answers: bool, closed: bool = False) -> None:
        self.answers = answers
        self.closed = closed
        self.pings: list[float] = []

    async def ping(self, payload: bytes | None = None) -> None:
        self.pings.append(trio.current_time())
        if self.closed:
            raise trio_websocket.ConnectionClosed(trio_websocket.CloseReason(1000, None))
        if not self.answers:
            await trio.sleep_forever()
        await trio.sleep(0.05)


async def watch(peer: FakePeer, heard: Heard, for_s: float) -> bool:
    """Run the watch for at most `for_s`; True when it cut the stream."""
    with trio.move_on_after(for_s):
        with trio.CancelScope() as cut:
            await cut_when_silent(peer, heard, silence_bound(5.0), cut)
            await trio.sleep_forever()  # returned without cutting
    return cut.cancelled_caught


async def test_a_silent_peer_is_pinged_once_then_cut_at_the_bound(autojump_clock: object) -> None:
    start = trio.current_time()
    peer = FakePeer(answers=False)
    assert await watch(peer, Heard(start), 600)
    assert trio.current_time() - start == pytest.approx(20.0)
    assert [t - start for t in peer.pings] == [pytest.approx(10.0)]


async def test_a_quiet_peer_that_answers_pings_is_never_cut(autojump_clock: object) -> None:
    start = trio.current_time()
    peer = FakePeer(answers=True)
    assert not await watch(peer, Heard(start), 600)
    assert 55 <= len(peer.pings) <= 60  # one ping per 10 s of quiet, no more


async def test_frames_keep_a_stream_alive_without_any_ping(autojump_clock: object) -> None:
    heard = Heard(trio.current_time())
    peer = FakePeer(answers=False)  # would be cut if it were ever asked

    async def frames() -> None:
        while True:
            await trio.sleep(9.0)
            heard.now()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(frames)
        assert not await watch(peer, heard, 600)
        nursery.cancel_scope.cancel()
    assert peer.pings == []


@pytest.mark.parametrize("answers", [True, False])
async def test_a_stall_of_the_watchers_own_process_is_not_the_peers_silence(
    autojump_clock: trio.testing.MockClock, answers: bool
) -> None:
    """The watcher's process freezes for 3x the bound (the clock jumps; nothing runs),
    while the peer's frames wait in the socket: the watch pings and gives the answer its
    whole window from then, and the frame read meanwhile keeps the stream. A peer silent
    through and after the stall is cut one answer window after the ping, not at once."""
    bound = silence_bound(5.0)
    start = trio.current_time()
    heard = Heard(start)
    peer = FakePeer(answers=answers)

    async def stall_then_read() -> None:
        await trio.sleep(1.0)
        autojump_clock.jump(3 * bound.cut_after_s)
        await trio.sleep(0.01)  # the reader's turn after the watch woke
        if answers:
            heard.now()  # what the peer sent during the stall, read now

    with trio.move_on_after(30 + 3 * bound.cut_after_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stall_then_read)
            with trio.CancelScope() as cut:
                await cut_when_silent(peer, heard, bound, cut)
            nursery.cancel_scope.cancel()
    assert cut.cancel_called is not answers
    resumed = start + 1.0 + 3 * bound.cut_after_s
    assert peer.pings and peer.pings[0] == pytest.approx(resumed)
    if not answers:
        answer_window = bound.cut_after_s - bound.probe_after_s
        assert trio.current_time() == pytest.approx(resumed + answer_window)


async def test_a_closed_connection_is_left_to_the_reader(autojump_clock: object) -> None:
    peer = FakePeer(answers=True, closed=True)
    with trio.CancelScope() as cut:
        await cut_when_silent(peer, Heard(trio.current_time()), silence_bound(5.0), cut)
    assert not cut.cancel_called and len(peer.pings) == 1


def transition(node: str, old: NodeStatus | None, new: NodeStatus, reason: str) -> NodeTransition:
    return NodeTransition(node, old, new, 1.0, reason)


def test_only_open_streams_of_nodes_no_longer_reachable_are_closed() -> None:
    t = transition
    transitions = [
        t("a", NodeStatus.REACHABLE, NodeStatus.UNREACHABLE, "no heartbeat for 15 s"),
        t("b", NodeStatus.REACHABLE, NodeStatus.UNREACHABLE, "stream closed"),  # already gone
        t("c", NodeStatus.UNREACHABLE, NodeStatus.REACHABLE, "heartbeat"),
        t("d", None, NodeStatus.REACHABLE, "registered"),
        t("e", NodeStatus.UNREACHABLE, NodeStatus.LOST, "no heartbeat for 120 s"),
    ]
    assert silent_streams(transitions, {"a", "c", "d", "e"}, None) == [
        ("a", "declared unreachable: no heartbeat for 15 s"),
        ("e", "declared lost: no heartbeat for 120 s"),
    ]


def test_no_stream_closes_for_silence_while_the_mass_loss_guard_holds() -> None:
    t = transition
    transitions = [
        t("a", NodeStatus.REACHABLE, NodeStatus.UNREACHABLE, "no heartbeat for 15 s"),
        t("b", NodeStatus.REACHABLE, NodeStatus.UNREACHABLE, "no heartbeat for 15 s"),
        # Declared lost before the guard came on in the same step: silent for minutes.
        t("e", NodeStatus.UNREACHABLE, NodeStatus.LOST, "no heartbeat for 120 s"),
    ]
    guard = "2 of 3 nodes turned unreachable within 60 s (more than 50%): ..."
    assert silent_streams(transitions, {"a", "b", "e"}, guard) == [
        ("e", "declared lost: no heartbeat for 120 s")
    ]


def test_a_control_plane_that_stalled_past_unreachable_after_closes_no_stream() -> None:
    """The reviewer's storm: the control plane stalls for longer than unreachable_after
    while every agent's heartbeats wait unread in its sockets. The first tick declares
    every node unreachable; the guard holds, so no stream closes, and the heartbeats
    read next bring every node back on the stream it has."""
    settings = ControlSection()
    lifecycle = Lifecycle(settings, started_at=0.0)
    names = [f"n{i}" for i in range(10)]
    for name in names:
        lifecycle.register(Inventory(name=name), 0.0)
    for name in names:
        lifecycle.heartbeat(name, 5.0)
    stalled_until = 5.0 + settings.unreachable_after_s + 3.0
    transitions = lifecycle.advance(stalled_until)
    assert {t.node for t in transitions if t.new is NodeStatus.UNREACHABLE} == set(names)
    assert lifecycle.guard is not None
    assert silent_streams(transitions, set(names), lifecycle.guard) == []
    for name in names:  # the heartbeats queued during the stall
        revived = lifecycle.heartbeat(name, stalled_until + 0.01)
        assert [t.new for t in revived] == [NodeStatus.REACHABLE]
        assert silent_streams(revived, set(names), lifecycle.guard) == []
    # One node falling silent on its own is still a dead stream.
    for name in names[1:]:
        lifecycle.heartbeat(name, stalled_until + settings.unreachable_after_s)
    later = stalled_until + settings.unreachable_after_s + 0.5
    transitions = lifecycle.advance(later)
    assert lifecycle.guard is None
    assert silent_streams(transitions, set(names), lifecycle.guard) == [
        ("n0", f"declared unreachable: no heartbeat for {settings.unreachable_after_s:g} s")
    ]


# -- the agent's end, in process ------------------------------------------------------


class Ceilings(random.Random):
    """Records each backoff's ceiling and waits not at all, so the test shows which
    ceiling the redial after a cut gets without sitting through it."""

    def __init__(self) -> None:
        super().__init__(0)
        self.ceilings: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        self.ceilings.append(b)
        return a


def agent_config(tmp_path: Path, port: int) -> AgentConfig:
    return parse_agent_config(
        {
            "name": "n1",
            "server": f"ws://127.0.0.1:{port}/v1/agent",
            "insecure": True,
            "state_dir": str(tmp_path / "state"),
            "reconnect": {"base_s": 0.5, "cap_s": 30.0},
        },
        "<test>",
    )


async def answer_for_a_while(
    ws: trio_websocket.WebSocketConnection, bound: SilenceBound, interval: float
) -> None:
    """Be a healthy control plane for half the bound after the welcome, as the agent
    counts it: send a command once the agent's heartbeats show that much time passed
    since it read the welcome (its k-th comes k intervals after, by its own clock), and
    return once the agent acknowledged it. (Half the bound on this side's clock raced the
    agent: a welcome read late made the command arrive too soon, by the agent's count.)"""
    beats = 0
    while beats * interval < bound.probe_after_s:
        if isinstance(decode_up(await ws.get_message()), Heartbeat):
            beats += 1
    await ws.send_message(encode(Mark(1, cordoned=False, draining=False)))
    while not isinstance(decode_up(await ws.get_message()), Ack):
        pass  # heartbeats


async def test_the_agent_cuts_a_black_holed_stream_and_redials_without_the_backoff_cap(
    tmp_path: Path,
) -> None:
    refusals = 8  # enough failed dials to push the backoff to its 30 s cap
    interval = 0.5
    bound = silence_bound(interval)
    registered: list[float] = []
    answered = trio.Event()

    async def control_plane(request: trio_websocket.WebSocketRequest) -> None:
        if refusals > len(ceilings.ceilings):
            await request.reject(503)
            return
        ws = await request.accept()
        await ws.get_message()  # the registration
        await ws.send_message(encode(Welcome(PROTOCOL, interval)))
        registered.append(trio.current_time())
        try:
            if len(registered) == 1:
                await answer_for_a_while(ws, bound, interval)
                answered.set()
            while True:
                await ws.get_message()  # heartbeats; its library answers pings
        except trio_websocket.ConnectionClosed:
            pass

    ceilings = Ceilings()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda **kw: trio_websocket.serve_websocket(
                    control_plane, "127.0.0.1", 0, None, **kw
                )
            )
            relay = Relay(server.port)
            relay_port = await nursery.start(relay.serve)
            agent = Agent(agent_config(tmp_path, relay_port), Inventory(name="n1"))
            agent.rng = ceilings
            await nursery.start(agent.run)
            await answered.wait()
            assert ceilings.ceilings[-1] == 30.0  # the failed dials reached the cap
            # The stream was healthy; now it goes silent, while new connections get through.
            silence_began = trio.current_time()
            relay.black_hole_open_connections()
            with trio.fail_after(bound.cut_after_s + 2.0):
                while len(registered) < 2:
                    await trio.sleep(0.01)
            back_after = registered[1] - silence_began
            # This one goes silent right after its welcome: no sign the control plane is
            # healthy, so its cut counts as a failure (a stalled control plane looks so).
            relay.black_hole_open_connections()
            with trio.fail_after(bound.cut_after_s + 2.0):
                while len(registered) < 3:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    # Not before the bound: a ping after half of it went unanswered first.
    assert back_after >= bound.cut_after_s - 0.1
    assert agent.registrations == 3
    # The redial after the healthy stream's cut starts the backoff over: at most base_s,
    # not the cap; after the stream silent from its welcome, the backoff grows again.
    assert ceilings.ceilings[refusals:] == [0.5, 1.0]


async def test_sessions_that_end_right_after_the_welcome_do_not_reset_the_backoff(
    tmp_path: Path,
) -> None:
    """A control plane that admits the agent and then fails it, over and over (it closes
    the stream, or sends garbage): each such session is one more failure, so the delays
    grow as for refused dials; one healthy session starts them over."""
    interval = 0.5
    bound = silence_bound(interval)
    behaviours = ["close", "garbage", "close", "garbage", "close", "healthy", "close"]
    seen: list[str] = []

    async def control_plane(request: trio_websocket.WebSocketRequest) -> None:
        what = behaviours[len(seen)] if len(seen) < len(behaviours) else "close"
        seen.append(what)
        ws = await request.accept()
        await ws.get_message()  # the registration
        await ws.send_message(encode(Welcome(PROTOCOL, interval)))
        if what == "garbage":
            await ws.send_message("this is not json")
        elif what == "healthy":
            await answer_for_a_while(ws, bound, interval)
        await ws.aclose()

    ceilings = Ceilings()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                lambda **kw: trio_websocket.serve_websocket(
                    control_plane, "127.0.0.1", 0, None, **kw
                )
            )
            agent = Agent(agent_config(tmp_path, server.port), Inventory(name="n1"))
            agent.rng = ceilings
            await nursery.start(agent.run)
            while len(ceilings.ceilings) < len(behaviours):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert seen[: len(behaviours)] == behaviours
    assert agent.registrations >= len(behaviours)
    # Base 0.5 s doubling per failure (as a refused dial would), then the healthy session.
    assert ceilings.ceilings[: len(behaviours)] == [1.0, 2.0, 4.0, 8.0, 16.0, 0.5, 1.0]


# -- the server's end, in process ------------------------------------------------------

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "control": {"unreachable_after_s": 1.0, "lost_after_s": 60.0},
    "models": [
        {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
    ],
}


def inventory(name: str) -> Inventory:
    return Inventory(name=name, gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),))


async def test_the_server_closes_the_stream_of_a_node_it_declares_unreachable() -> None:
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            assert running.plane is not None
            streams = running.plane.agents.streams
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"

            async def status() -> dict[str, str]:
                async with httpx.AsyncClient() as client:
                    answer = await client.get(
                        f"http://127.0.0.1:{running.control_port}/v1/admin/status"
                    )
                return {n["name"]: n["status"] for n in answer.json()["nodes"]}

            async with (
                trio_websocket.open_websocket_url(url) as live,
                trio_websocket.open_websocket_url(url) as silent,
            ):
                await live.send_message(encode(Register(PROTOCOL, "t", inventory("live"))))
                welcome = decode_down(await live.get_message())
                assert isinstance(welcome, Welcome)

                async def heartbeats() -> None:
                    seq = 0
                    while True:
                        await trio.sleep(welcome.heartbeat_interval_s)
                        seq += 1
                        await live.send_message(encode(Heartbeat(seq)))

                nursery.start_soon(heartbeats)
                # Registers, then sends nothing more, and never closes. Timed from before
                # its register, which the server hears after: however late this task runs
                # after the welcome, the 1 s from it are all inside what is measured.
                registering = trio.current_time()
                await silent.send_message(encode(Register(PROTOCOL, "t", inventory("silent"))))
                assert isinstance(decode_down(await silent.get_message()), Welcome)
                assert set(streams) == {"live", "silent"}
                # 10 s, not 5: a starved machine (CI's) delays the close by seconds, and
                # lost_after (60 s) is far past it.
                with trio.fail_after(10):
                    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                        await silent.get_message()
                # Not before unreachable_after: the decision is the lifecycle's.
                assert trio.current_time() - registering >= 1.0 - 0.05
                assert closed.value.reason is not None
                reason = closed.value.reason.reason or ""
                assert reason == "declared unreachable: no heartbeat for 1 s", reason
                # Its task is gone; the node it served stays known as unreachable.
                with trio.fail_after(5):
                    while "silent" in streams:
                        await trio.sleep(0.01)
                assert await status() == {"live": "reachable", "silent": "unreachable"}
                assert set(streams) == {"live"} and live.closed is None
                nursery.cancel_scope.cancel()
            stop.set()


async def fleet_in_a_thread(
    url: str, names: list[str], registered: threading.Event, stop: threading.Event
) -> None:
    """Agents that register, then heartbeat on time whatever the server does: run by
    their own trio loop in another thread, so a stalled server loop does not stop them."""
    async with AsyncExitStack() as stack:
        streams = [
            await stack.enter_async_context(trio_websocket.open_websocket_url(url))
            for _ in names
        ]
        interval = 0.0
        for ws, name in zip(streams, names, strict=True):
            await ws.send_message(encode(Register(PROTOCOL, "t", inventory(name))))
            welcome = decode_down(await ws.get_message())
            assert isinstance(welcome, Welcome)
            interval = welcome.heartbeat_interval_s
        registered.set()
        seq = 0
        while not stop.is_set():
            await trio.sleep(interval)
            seq += 1
            for ws in streams:
                await ws.send_message(encode(Heartbeat(seq)))
        assert all(ws.closed is None for ws in streams), [ws.closed for ws in streams]


async def test_a_control_plane_stalled_past_unreachable_after_declares_no_node_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server's own loop stalls for twice unreachable_after while four agents heartbeat
    on time (their frames wait unread in its sockets). The stall is not the nodes'
    silence: the first step after it, before a heartbeat is read, declares nothing; no
    guard holds, no stream is closed, and the stall is logged and counted."""
    caplog.set_level(logging.INFO, logger="llmgw.control")
    names = ["n0", "n1", "n2", "n3"]
    stop, registered = trio.Event(), threading.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(CONFIG, "<test>"), stop=stop, **kw)
            )
            plane = running.plane
            assert plane is not None
            url = f"ws://127.0.0.1:{running.control_port}/v1/agent"
            stop_agents = threading.Event()
            agents_done = trio.Event()

            async def agents() -> None:
                try:
                    await trio.to_thread.run_sync(
                        functools.partial(
                            trio.run, fleet_in_a_thread, url, names, registered, stop_agents
                        )
                    )
                finally:
                    agents_done.set()

            nursery.start_soon(agents)
            try:
                while not registered.is_set() or len(plane.agents.streams) < len(names):
                    await trio.sleep(0.01)
                streams = dict(plane.agents.streams)
                before = plane.now()
                # The fault itself: the whole server loop blocks, past unreachable_after.
                time.sleep(1.0 + 1.0)
                # The stall is not awake time, but for the watch's tick and slack.
                assert plane.now() - before <= plane.clock.tick_s + plane.clock.slack_s
                # The first step after the stall, before a heartbeat is read: each stream's
                # task reads and dispatches at once, so it may otherwise come first.
                plane.apply(plane.reconciler.tick(plane.now()))

                def notes() -> list[str]:
                    return [r.getMessage() for r in caplog.records]

                # The stall's watch runs and says so; every node stays reachable throughout.
                with trio.fail_after(5):
                    while not any("loop stalled for" in n for n in notes()):
                        await trio.sleep(0.01)
                await trio.sleep(2 * 1.0)  # unreachable_after of awake time, heard through
                lifecycle = plane.reconciler.lifecycle
                assert all(n.status is NodeStatus.REACHABLE for n in lifecycle.nodes.values())
                assert not any("unreachable" in n or "mass-loss" in n for n in notes()), notes()
                assert plane.metrics.stalled_s >= 1.5
                assert not any(s.cancel_scope.cancel_called for s in streams.values())
                assert plane.agents.streams == streams
            finally:
                stop_agents.set()
            await agents_done.wait()  # it checked that none of its streams was closed
            nursery.cancel_scope.cancel()
        stop.set()


# -- both ends, with real processes ------------------------------------------------


def test_a_black_holed_agent_stream_is_back_within_30_s_with_the_default_timers(
    fleet: Fleet,
) -> None:
    """The control plane's default timers (unreachable after 15 s, a heartbeat every 5 s,
    so the agent cuts after 20 s): what a fleet runs, so the 30 s are the real ones.
    A second node, on a direct route, keeps the silent one a minority: alone, it would
    be all of the fleet, the mass-loss guard would hold, and its stream would stay open
    on the server until the agent's new one replaced it."""
    relay_port = free_port()
    relay = Proc(
        [sys.executable, str(Path(__file__).parent / "tcp_relay.py"), str(relay_port), str(fleet.control_port)],
        relay_port,
    )
    fleet.procs.all.append(relay)
    wait_until(lambda: "relaying" in relay.output(), what="the relay")
    path = fleet.procs.tmp / "server.toml"
    path.write_text(
        f'[server]\nlisten = "127.0.0.1:{fleet.port}"\n'
        f'control_listen = "127.0.0.1:{fleet.control_port}"\nshutdown_grace_s = 2\n'
        f'[agents]\nca = "{fleet.certs}/ca.crt"\ncert = "{fleet.certs}/server.crt"\n'
        f'key = "{fleet.certs}/server.key"\n'
        # A model no node fits: the test is about the stream, not engines.
        '[[models]]\nname = "m"\n[models.profile]\nengine = "vllm"\nmodel = "org/m"\n'
        'gpu_model = "B300"\n'
    )
    server = Proc([sys.executable, "-m", "llmgw_server", "--config", str(path)], fleet.port)
    fleet.procs.all.append(server)
    server.wait_http("/healthz")
    agent = fleet.agent("gpu-1", "node-2xl4.toml", via=relay_port)
    fleet.agent("gpu-2", "node-2xl4.toml")
    wait_until(
        lambda: {n["name"]: n["status"] for n in fleet.status()["nodes"]}
        == {"gpu-1": "reachable", "gpu-2": "reachable"},
        what="registration",
    )

    silence_began = time.monotonic()
    relay.signal(signal.SIGHUP)  # the open stream goes silent; new connections get through
    wait_until(lambda: "black-holed 1 connections" in relay.output(), timeout=5, what="the black hole")

    def back_on_a_new_stream() -> bool:
        # Registered again (the agent says so), then reachable: the new stream's doing.
        # (Not last_seen_s_ago: it counts the control plane's awake time, no stall in it.)
        again = agent.output().count("INFO llmgw.agent registered with") >= 2
        return again and fleet.node("gpu-1")["status"] == "reachable"

    wait_until(back_on_a_new_stream, timeout=30 - (time.monotonic() - silence_began), what="gpu-1 back")
    back_after = time.monotonic() - silence_began
    assert back_after < 30, back_after
    assert "not even a pong: dialing again" in agent.output()
    # The server closed the silent stream: once it declared the node unreachable, or, where
    # its own stalls kept 15 s of awake time from passing first, when the node came back.
    closed = "closing the stream of gpu-1: declared unreachable: no heartbeat for 15 s"
    replaced = "closing the stream of gpu-1: node gpu-1 connected again"
    assert closed in server.output() or replaced in server.output()
    assert "mass-loss guard holds" not in server.output()
    assert fleet.node("gpu-2")["status"] == "reachable" and "gpu-2:" not in server.output()
    assert "black-holed 1 connections" in relay.output() and relay.popen.poll() is None
    print(f"back on a new stream {back_after:.1f} s after the silence began")
