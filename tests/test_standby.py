"""What a standby answers on its control port (control_shell.standby), over real sockets:
the leader named at once when known; a stream held through an election and sent to its
winner the moment it is known, or served by this control plane's own term when it wins;
a peer never sent back to the leader it says it lost; held streams hold no place in the
port's admission."""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs
import trio
import trio_websocket

from llmgw_core.agent_lane import AGENT_ALPN
from llmgw_core.certs import init_ca
from llmgw_core.tls_config import AgentsTLS, server_context
from llmgw_core.wire import LOST_LEADER_HEADER, NOT_LEADER_CLOSE, leader_from_reason
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits
from llmgw_http.tls_admission import AGENTS, AdmissionLimits, Gate
from llmgw_http.ws_server import ServerWebSocket
from llmgw_server.control_shell.standby import StandbyAnswers

OLD = "ws://127.0.0.1:1"  # the leader that died: its key lives until its lease ends
NEW = "ws://127.0.0.1:2"


@attrs.define
class Election:
    leader_url: str | None
    why: str = "no leader is elected now"
    leading: bool = False  # this control plane leads (its term has begun)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def elect(self, url: str | None, *, here: bool = False) -> None:
        self.leader_url = url
        self.leading = here
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()


async def _nothing(request: Request, responder: Responder) -> None:
    await responder.whole(404, b"{}")


async def serve(
    answers: StandbyAnswers,
    gate: Gate | None = None,
    certs: Path | None = None,
    *,
    task_status: trio.TaskStatus[int],
) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    context = None
    if certs is not None:
        tls = AgentsTLS(ca=certs / "ca.crt", cert=certs / "server.crt", key=certs / "server.key")
        context = server_context(tls)
    server = HTTPServer(_nothing, ServerLimits(), upgrade=answers.upgrade, ssl_context=context)
    if gate is not None:
        server.tls_admission = gate
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


async def closed_with(port: int, lost: str | None = None) -> tuple[float, str | None]:
    """(when the standby closed the agent's stream, the leader its close names)."""
    headers = [] if lost is None else [(LOST_LEADER_HEADER, lost.encode())]
    async with trio_websocket.open_websocket(
        "127.0.0.1", port, "/v1/agent", use_ssl=False, extra_headers=headers
    ) as ws:
        try:
            await ws.get_message()
        except trio_websocket.ConnectionClosed as closed:
            assert closed.reason is not None and closed.reason.code == NOT_LEADER_CLOSE
            return trio.current_time(), leader_from_reason(closed.reason.reason)
    raise AssertionError("the standby sent a message")


async def held_agent(
    nursery: trio.Nursery, port: int, answers: StandbyAnswers, lost: str | None = None
) -> list[tuple[float, str | None]]:
    """An agent's stream, started and held by the standby; what `closed_with` says of
    it arrives in the list once the standby closes it."""
    results: list[tuple[float, str | None]] = []

    async def agent() -> None:
        results.append(await closed_with(port, lost))

    held = answers.held
    nursery.start_soon(agent)
    while answers.held <= held:
        await trio.sleep(0.01)
    return results


async def test_a_known_leader_is_named_at_once() -> None:
    election = Election(NEW)
    answers = StandbyAnswers(lambda: election, lambda: b"", election.changed, hold_s=5.0)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers)
            began = trio.current_time()
            at, leader = await closed_with(port)
            nursery.cancel_scope.cancel()
    assert leader == NEW + "/v1/agent" and at - began < 1.0


async def test_a_stream_is_held_through_the_election_and_sent_to_its_winner() -> None:
    election = Election(None)
    answers = StandbyAnswers(lambda: election, lambda: b"", election.changed, hold_s=5.0)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers)
            results = await held_agent(nursery, port, answers)
            await trio.sleep(0.3)  # an election takes a while: the stream stays held
            assert not results
            elected = trio.current_time()
            election.elect(NEW)
            while not results:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    ((at, leader),) = results
    assert leader == NEW + "/v1/agent" and at - elected < 1.0
    assert answers.held == 0


async def test_the_leader_a_peer_lost_is_not_named_to_it_again() -> None:
    """The dead leader's key lives until its lease ends: the standby still has it as the
    leader, but a peer that lost it waits for the next one instead of dialing it again."""
    election = Election(OLD)
    suspected: list[str] = []
    answers = StandbyAnswers(
        lambda: election, lambda: b"", election.changed, hold_s=5.0, suspect=suspected.append
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers)
            _, other = await closed_with(port)  # a peer that lost nothing: named at once
            assert other == OLD + "/v1/agent" and suspected == []
            results = await held_agent(nursery, port, answers, lost=OLD + "/v1/agent/")
            # The seat is asked to check whether that leader's process is gone.
            assert suspected == [OLD]
            election.elect(None)  # the old key expired: still nobody to name
            await trio.sleep(0.2)
            assert not results
            election.elect(NEW)
            while not results:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert results[0][1] == NEW + "/v1/agent"


async def test_a_hold_ends_after_its_bound_saying_why() -> None:
    election = Election(None, why="the store is unreachable: etcd-1: refused")
    answers = StandbyAnswers(lambda: election, lambda: b"", election.changed, hold_s=0.3)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers)
            began = trio.current_time()
            at, leader = await closed_with(port)
            nursery.cancel_scope.cancel()
    assert leader is None and 0.3 <= at - began < 2.0


HERE = "ws://127.0.0.1:3"  # the standby under test, once it wins


async def test_a_stream_held_by_the_winner_is_served_by_its_term_on_the_same_connection() -> None:
    """The standby that wins the election serves the streams it held itself: the agent's
    register, sent after the 101, is read by the new term, which welcomes it on the same
    connection (before: closed naming no leader once the hold ran out, then dialled
    again, a second TLS handshake for half the fleet, seconds later)."""
    election = Election(None)
    adopted: list[str | bytes] = []

    async def adopt(request: Request, raw: trio.abc.Stream, rest: bytes) -> bool:
        ws = ServerWebSocket(raw, rest, 1 << 16)
        adopted.append(await ws.receive())
        await ws.send("welcome")
        await ws.close(1000, "done")
        return True

    answers = StandbyAnswers(
        lambda: election, lambda: b"", election.changed, hold_s=5.0, adopt=adopt, here=lambda: HERE
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers)
            async with trio_websocket.open_websocket(
                "127.0.0.1", port, "/v1/agent", use_ssl=False
            ) as ws:
                await ws.send_message("register")
                while answers.held < 1:
                    await trio.sleep(0.01)
                election.elect(None, here=True)
                assert await ws.get_message() == "welcome"
            nursery.cancel_scope.cancel()
    assert adopted == ["register"] and answers.adopted == 1 and answers.held == 0


async def test_a_held_stream_the_winners_term_does_not_take_is_sent_to_it_again() -> None:
    election = Election(None)

    async def adopt(request: Request, raw: trio.abc.Stream, rest: bytes) -> bool:
        return False  # a router's feed, or no turn among the registrations

    answers = StandbyAnswers(
        lambda: election, lambda: b"", election.changed, hold_s=5.0, adopt=adopt, here=lambda: HERE
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers)
            results = await held_agent(nursery, port, answers)
            elected = trio.current_time()
            election.elect(None, here=True)
            while not results:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    ((at, leader),) = results
    assert leader == HERE + "/v1/agent" and at - elected < 1.0


async def test_held_streams_hold_no_place_in_the_agents_admission_lane(tmp_path: Path) -> None:
    """A held stream waits on the election, not on this process: its place goes to the
    next agent. With one place (held for 30 s until answered) a second agent is held
    beside the first; before, it queued behind the hold and a standby refused a storm."""
    certs = tmp_path / "certs"
    init_ca(certs)
    gate = Gate(AdmissionLimits(agents_in_flight=(1, 1), in_flight_s=30.0))
    election = Election(None)
    answers = StandbyAnswers(lambda: election, lambda: b"", election.changed, hold_s=20.0)
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.check_hostname = False
    context.set_alpn_protocols([AGENT_ALPN.decode()])
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve, answers, gate, certs)
            results: list[str | None] = []

            async def agent() -> None:
                async with trio_websocket.open_websocket(
                    "127.0.0.1", port, "/v1/agent", use_ssl=context
                ) as ws:
                    try:
                        await ws.get_message()
                    except trio_websocket.ConnectionClosed as closed:
                        assert closed.reason is not None
                        results.append(leader_from_reason(closed.reason.reason))

            nursery.start_soon(agent)
            nursery.start_soon(agent)
            while answers.held < 2:
                await trio.sleep(0.01)
            assert gate.core.lanes[AGENTS].in_flight == 0
            election.elect(NEW)
            while len(results) < 2:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert results == [NEW + "/v1/agent"] * 2
