"""A control plane's port flooded with anonymous hellos that say they lost a leader
(llmgw_core.agent_lane's lost-leader ALPN name, no client certificate), over real
loopback sockets. From one address: the port's per-address bound (per_source_pending,
64) caps how many of them the seat holds for the election at once, and the budget gives
that address its share of the handshakes (HANDSHAKES_PER_SOURCE), no more; an agent that
fails over then, from an address of its own, still gets its handshake at once, its
stream held through the election and served by the winner. From enough addresses the
whole budget (HANDSHAKES_PER_LOST_LEADER) is spent, and no more: an agent that fails
over then takes the slower path (its hello waits for the election, without TLS, and is
sent to the winner, where it dials again for its handshake), and registers.

The seat is a real one, its election a stand-in (the standing is all it reads); the
port is the one every control plane serves (serve_control_listeners); the agent dials
with the agent's own code (open_agent_stream), from an address of its own."""

from __future__ import annotations

import ssl
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from llmgw_core.agent_lane import AGENT_ALPN, come_back_s, lost_leader_alpn, not_leader_url
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.config import Config, parse_config
from llmgw_core.dial import ConnectFailed, open_agent_stream
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import (
    MAX_FRAME_BYTES,
    PROTOCOL,
    DownMessage,
    Register,
    Welcome,
    decode_down,
    encode,
)
from llmgw_http.tls_admission import AdmissionLimits
from llmgw_server.control.hello_answer import HANDSHAKES_PER_LOST_LEADER, HANDSHAKES_PER_SOURCE
from llmgw_server.control_shell.controlplane import ControlPlane
from llmgw_server.control_shell.election import Member, Standing
from llmgw_server.control_shell.port import serve_control_listeners
from llmgw_server.control_shell.seat import Seat
from test_tls_admission import control_table

LOST = 41  # the epoch of the leadership the fleet lost
WON = 57  # the next one's (epochs are the leader key's create revisions)
PER_SOURCE_PENDING = AdmissionLimits().per_source_pending  # 64
FLOODERS = 96  # connections at once, more than one address may hold
FLOODER = "127.0.0.1"
AGENT = "127.0.0.2"  # the failing-over agent's node


@attrs.define
class StandingOnly:
    standing: Standing


def config_for(certs: Path) -> Config:
    store = {"store": {"endpoints": ["http://127.0.0.1:9"], "lease_ttl_s": 2}}
    return parse_config({**control_table(certs), "control": store}, "<test>")


def stand(seat: Seat, standing: Standing) -> None:
    """The election changed: the seat is told, as its election follower tells it."""
    seat.election = StandingOnly(standing)  # type: ignore[assignment]  # all it reads
    seat._signal()


def anonymous_hello(lost: int) -> bytes:
    """A ClientHello as a failing-over agent's dial sends it, from a peer with no
    certificate: Python's ssl (OpenSSL) writes it, and it is sent again on every
    connection (the port reads no more of it than its ALPN names)."""
    context = ssl.create_default_context()
    context.set_alpn_protocols([AGENT_ALPN.decode(), lost_leader_alpn(lost).decode()])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        conn.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def what_it_said(first: bytes) -> str:
    if first[:1] == b"\x16":  # a TLS handshake record: the server's flight
        return "handshake"
    if come_back_s(first) is not None:
        return "come_back"
    if not_leader_url(first) is not None:
        return "leader"
    return "nothing"


async def flood_hello(port: int, hello: bytes, source: str = FLOODER) -> str:
    """One anonymous hello: what the port answered first; then gone, as a flooder is."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    try:
        await stream.send_all(hello)
        first = await stream.receive_some(512)
    except trio.BrokenResourceError:
        first = b""
    finally:
        await trio.aclose_forcefully(stream)
    return what_it_said(first)


async def until(condition: Callable[[], bool]) -> None:
    """Wait for `condition()` (under the caller's deadline)."""
    while not condition():
        await trio.sleep(0.01)


async def fail_over(
    url: str, lost: int, agent_tls: ssl.SSLContext, certs: Path, welcomed: Callable[[], bool]
) -> tuple[DownMessage, bool, list[ConnectFailed]]:
    """An agent that lost the leadership of `lost` dials `url` as the agent does, from
    AGENT (a node of its own), follows what it is told, and registers: what welcomed it,
    `welcomed()` while its stream is open, and the answers it had before."""
    told: list[ConnectFailed] = []
    inventory = Inventory(name="node-1", gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),))
    lost_epoch: int | None = lost
    while True:
        try:
            async with open_agent_stream(
                url,
                agent_tls,
                ca=certs / "ca.crt",
                connect_timeout_s=10,
                disconnect_timeout_s=1,
                max_message_size=MAX_FRAME_BYTES,
                local_address=AGENT,
                lost_epoch=lost_epoch,
            ) as ws:
                await ws.send_message(encode(Register(PROTOCOL, "test", inventory)))
                return decode_down(await ws.get_message()), welcomed(), told
        except* ConnectFailed as group:
            failed = group.exceptions[0]
            assert isinstance(failed, ConnectFailed)
            told.append(failed)
        assert len(told) < 4, told
        if failed.leader is not None:
            url, lost_epoch = failed.leader, None  # named: dialled with a leader's patience
        else:
            assert failed.come_back_s is not None, failed
            await trio.sleep(failed.come_back_s)  # the wait the port asked for


@attrs.define
class FailingOver:
    """node-1, which lost the leadership of LOST, failing over to a port: its `answer`
    once registered on the `plane` that won (appended by the test)."""

    plane: list[ControlPlane] = attrs.Factory(list)
    answer: list[tuple[DownMessage, bool, list[ConnectFailed]]] = attrs.Factory(list)

    def registered(self) -> bool:
        return "node-1" in self.plane[0].agents.streams

    async def run(self, url: str, agent_tls: ssl.SSLContext, certs: Path) -> None:
        welcome = await fail_over(url + "/v1/agent", LOST, agent_tls, certs, self.registered)
        self.answer.append(welcome)


@attrs.define
class Port:
    """A control plane's port, its seat standing by while an election runs: the seat's
    answers counted as the gate asks for them."""

    seat: Seat
    config: Config
    url: str = ""
    number: int = 0  # the port's
    in_seat: int = 0  # hellos the seat is answering now (waiting for the election)
    most_in_seat: int = 0
    agent_asked: trio.Event = attrs.field(factory=trio.Event)

    async def answer(self, lost: int | None, source: str) -> bytes | None:
        if source == AGENT:
            self.agent_asked.set()
        self.in_seat += 1
        self.most_in_seat = max(self.most_in_seat, self.in_seat)
        try:
            return await self.seat._answer_agent(lost, source)
        finally:
            self.in_seat -= 1

    async def serve(self, nursery: trio.Nursery) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = await serve_control_listeners(
            self.config, listeners, self.seat.handle, self.seat.upgrade, nursery=nursery,
            leader_for_agents=self.answer,
        )  # fmt: skip
        self.number = port
        self.seat.url = self.url = f"wss://127.0.0.1:{port}"

    async def wins(self, nursery: trio.Nursery) -> ControlPlane:
        """The election ends: this control plane leads, its term begun."""
        plane = ControlPlane(self.config, heartbeat_interval_s=5.0, epoch=WON)
        await nursery.start(plane.run)
        self.seat.plane = plane
        me = Member(id="me", url=self.url, catalog_digest="", started_at=0)
        stand(self.seat, Standing(True, WON, me, None, "elected", True))
        return plane


def port_for(tmp_path: Path) -> tuple[Port, ssl.SSLContext, Path]:
    """A seat standing by while an election runs (the store names nobody), and the TLS
    context of the agent node-1."""
    certs = tmp_path / "certs"
    init_ca(certs)
    crt, key, _ = issue_node(certs, "node-1")
    agent_tls = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    agent_tls.load_cert_chain(str(crt), str(key))
    config = config_for(certs)
    seat = Seat(config, None)
    stand(seat, Standing(False, 0, None, None, "no leader is elected now", True))
    return Port(seat, config), agent_tls, certs


async def test_a_flood_from_one_address_takes_its_share_and_an_agent_still_gets_its_handshake(
    tmp_path: Path,
) -> None:
    port, agent_tls, certs = port_for(tmp_path)
    seat = port.seat
    hello = anonymous_hello(LOST)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await port.serve(nursery)

            # 1. The flood, FLOODERS connections at a time, until its share is spent.
            said: Counter[str] = Counter()

            async def flooder() -> None:
                while seat.handshakes.left(LOST, FLOODER) > 0:
                    said[await flood_hello(port.number, hello)] += 1

            async with trio.open_nursery() as flood:
                for _ in range(FLOODERS):
                    flood.start_soon(flooder)
            handshakes = seat.metrics.hellos_answered["handshake"]
            assert handshakes == HANDSHAKES_PER_SOURCE  # its share, no more
            assert 0 < said["handshake"] <= handshakes, said
            assert seat.handshakes.left(LOST, AGENT) == HANDSHAKES_PER_SOURCE  # the rest kept

            # 2. Its share spent, its hellos wait for the election: the port lets
            # per_source_pending of them reach the seat at once from one address, and
            # answers the rest at once (come back), no TLS.
            at_once: Counter[str] = Counter()
            more = 192

            async def one_more() -> None:
                at_once[await flood_hello(port.number, hello)] += 1

            for _ in range(more):
                nursery.start_soon(one_more)
            await until(lambda: at_once.total() + port.in_seat == more)
            assert 0 < port.in_seat <= PER_SOURCE_PENDING, (port.in_seat, at_once)
            assert set(at_once) == {"come_back"}, at_once
            assert port.most_in_seat <= PER_SOURCE_PENDING
            assert seat.metrics.hellos_answered["handshake"] == handshakes

            # 3. An agent that fails over now, from its own address, gets its handshake
            # at once; its stream is held through the election, and served by this
            # control plane's term when it wins.
            agent = FailingOver()
            nursery.start_soon(agent.run, port.url, agent_tls, certs)
            await until(lambda: seat.standby.held == 1)
            assert seat.metrics.hellos_answered["handshake"] == handshakes + 1
            agent.plane.append(await port.wins(nursery))
            await until(lambda: bool(agent.answer))
            ((welcome, was_registered, told),) = agent.answer
            assert isinstance(welcome, Welcome) and welcome.epoch == WON and was_registered
            assert told == [] and seat.standby.adopted == 1
            nursery.cancel_scope.cancel()


async def test_floods_from_many_addresses_spend_the_budget_and_no_more_and_an_agent_registers(
    tmp_path: Path,
) -> None:
    port, agent_tls, certs = port_for(tmp_path)
    seat = port.seat
    hello = anonymous_hello(LOST)
    addresses = HANDSHAKES_PER_LOST_LEADER // HANDSHAKES_PER_SOURCE  # 32
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await port.serve(nursery)

            # 1. The flood, from `addresses` addresses, until each one's share is spent.
            said: Counter[str] = Counter()

            async def flooder(source: str) -> None:
                while seat.handshakes.left(LOST, source) > 0:
                    said[await flood_hello(port.number, hello, source)] += 1

            async with trio.open_nursery() as flood:
                for n in range(FLOODERS):
                    flood.start_soon(flooder, f"127.0.1.{1 + n % addresses}")
            handshakes = seat.metrics.hellos_answered["handshake"]
            assert handshakes == HANDSHAKES_PER_LOST_LEADER  # the whole budget, no more
            assert 0 < said["handshake"] <= handshakes, said
            assert seat.handshakes.left(LOST, AGENT) == 0

            # 2. An agent that fails over now waits for the election (no handshake left);
            # it ends, this control plane leads, and the agent is sent to it, dials it
            # again and registers.
            agent = FailingOver()
            nursery.start_soon(agent.run, port.url, agent_tls, certs)
            await port.agent_asked.wait()
            agent.plane.append(await port.wins(nursery))
            await until(lambda: bool(agent.answer))
            ((welcome, was_registered, told),) = agent.answer
            assert isinstance(welcome, Welcome) and welcome.epoch == WON and was_registered
            assert [(t.leader, t.come_back_s) for t in told] == [(port.url + "/v1/agent", None)]
            assert seat.metrics.hellos_answered["handshake"] == handshakes
            assert seat.metrics.hellos_answered["this_leader"] >= 1
            nursery.cancel_scope.cancel()
