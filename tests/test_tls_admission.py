"""The control port's TLS admission: no anonymous peer can close the port (silent,
trickling or stalled handshakes are cut within 3 s and hold no slot), and a
connection the server cannot serve soon is refused before it costs a handshake."""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from llmgw_core.agent_lane import (
    AGENT_ALPN,
    COME_BACK_PREFIX,
    LOST_LEADER_ALPN,
    MAX_COME_BACK_S,
    MAX_LEADER_URL_BYTES,
    NOT_LEADER_PREFIX,
    ROUTER_ALPN,
    come_back_line,
    come_back_s,
    lost_epoch,
    lost_leader_alpn,
    not_leader_line,
    not_leader_url,
)
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.config import Config, parse_config
from llmgw_core.dial import ConnectFailed, Target, dial, open_agent_stream
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.tls_config import AgentsTLS, server_context
from llmgw_core.wire import MAX_FRAME_BYTES, PROTOCOL, Register, Welcome, decode_down, encode
from llmgw_http import sockio
from llmgw_http.server import JSON, HTTPServer, Request, Responder, ServerLimits
from llmgw_http.tls_admission import (
    AGENTS,
    HELLO_MAX_BYTES,
    OTHERS,
    REFUSED_BUSY,
    REFUSED_FULL,
    REFUSED_LATE,
    REFUSED_SOURCE,
    REFUSED_SOURCE_QUEUED,
    ROUTERS,
    SHED_LATE,
    AdmissionLimits,
    Gate,
    TLSAdmission,
    hello_bytes_needed,
    lane_of,
    offered_alpn,
    source_key,
)
from llmgw_server.wiring import Running, main

# -- the pure parts ----------------------------------------------------------------


def client_hello(alpn: list[str] | None = None) -> bytes:
    """A real ClientHello, as Python's ssl (OpenSSL) sends it."""
    context = ssl.create_default_context()
    if alpn:
        context.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def test_the_hello_is_whole_only_once_every_byte_is_there(tmp_path: Path) -> None:
    hello = client_hello()
    assert hello[0] == 0x16 and 100 < len(hello) < 4096
    for cut in range(len(hello)):
        needed = hello_bytes_needed(hello[:cut])
        assert cut < needed <= len(hello), cut
    assert hello_bytes_needed(hello) == 0
    assert hello_bytes_needed(hello + b"more") == 0


def test_a_hello_over_two_records_is_whole_after_the_second() -> None:
    message = b"\x01\x00\x01\x00" + bytes(256)  # ClientHello, 256 bytes of body
    first, second = message[:100], message[100:]
    records = (
        b"\x16\x03\x01" + len(first).to_bytes(2, "big") + first
        + b"\x16\x03\x01" + len(second).to_bytes(2, "big") + second
    )
    for cut in range(len(records)):
        assert hello_bytes_needed(records[:cut]) > cut
    assert hello_bytes_needed(records) == 0


def test_bytes_that_are_no_tls_hello_go_straight_to_openssl_or_are_refused() -> None:
    assert hello_bytes_needed(b"GET / HTTP/1.1\r\n") == 0  # logged as plaintext HTTP
    assert hello_bytes_needed(b"\x16\x03\x01\x00\x00") == 0  # an empty record
    huge = b"\x16\x03\x01\xff\xff"  # 64 KiB in one record: no real hello
    assert hello_bytes_needed(huge) == -1
    many = b"".join(b"\x16\x03\x01\x40\x00" + bytes(0x4000) for _ in range(2))
    assert hello_bytes_needed(b"\x16\x03\x01\x40\x00\x01\xff\xff\xff" + many[9:]) == -1
    assert HELLO_MAX_BYTES >= 16 * 1024


def begin(core: TLSAdmission, lane: str, now: float, deadline: float) -> bool:
    """The next queued hello granted its place, and begun if it can finish in time."""
    source = core.grant(lane)
    assert source is not None
    return core.start(lane, source, now, deadline)


def test_admission_bounds_pending_connections_in_all_and_per_source() -> None:
    core = TLSAdmission(AdmissionLimits(max_pending=5, per_source_pending=3))
    assert [core.arrive("10.0.0.1", 0.0) for _ in range(4)] == [None, None, None, REFUSED_SOURCE]
    assert core.arrive("10.0.0.2", 0.0) is None
    assert core.arrive("10.0.0.3", 0.0) is None
    assert core.arrive("10.0.0.4", 0.0) == REFUSED_FULL
    core.leave("10.0.0.1")
    assert core.arrive("10.0.0.4", 0.0) is None
    assert core.arrive("10.0.0.1", 0.0) == REFUSED_FULL
    for source in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"):
        core.leave(source)
    assert core.total_pending == 0 and not core.pending
    assert core.refused == {REFUSED_SOURCE: 1, REFUSED_FULL: 2}


def test_a_connection_too_old_to_finish_in_time_is_refused_and_the_deadline_counts_its_queue() -> None:
    core = TLSAdmission(
        AdmissionLimits(deadline_s=3.0, agents_queue_s=30.0, others_queue_s=10.0, min_left_s=0.5)
    )
    # Too late for any lane (an agent's included): refused at accept.
    assert core.arrive("10.0.0.1", 29.6) == REFUSED_LATE
    # Anyone but an agent: 0.4 s left of its 10 s from its arrival, it would not finish;
    # refused once its hello says it is no agent.
    assert core.arrive("10.0.0.1", 9.6) is None
    core.sorted()
    assert core.hello(OTHERS, 100.0, arrived=100.0 - 9.6) == REFUSED_LATE
    core.leave("10.0.0.1", unsorted=False)
    # Its hello is due 3 s after its accept, whatever its wait in the kernel's queue
    # (an operator's connection waited there seconds behind a storm: finding 12); its
    # place, 10 s after its arrival.
    assert core.arrive("10.0.0.1", 9.4) is None
    assert core.deadline(accepted_at=100.0) == pytest.approx(103.0)
    deadline = core.queue_deadline(OTHERS, 100.0 - 9.4)
    assert deadline == pytest.approx(100.6)
    assert core.hello(OTHERS, 100.0, 90.6) is None and core.hello(OTHERS, 100.0, 90.6) is None
    assert begin(core, OTHERS, 100.05, deadline)
    assert not begin(core, OTHERS, 100.2, deadline)  # its place came too late: reset
    assert core.lanes[OTHERS].waiting == 0 and core.lanes[OTHERS].in_flight == 1
    # An agent waits its turn for up to agents_queue_s from its arrival (it waits that
    # long itself), and is refused only with less than min_left_s of that left.
    assert core.hello(AGENTS, 100.0, arrived=100.0 - 2.6) is None
    assert core.queue_deadline(AGENTS, 97.4) == pytest.approx(127.4)
    assert begin(core, AGENTS, 126.8, core.queue_deadline(AGENTS, 97.4))
    assert core.hello(AGENTS, 100.0, arrived=100.0 - 29.6) == REFUSED_LATE
    assert core.refused == {REFUSED_LATE: 3, SHED_LATE: 1}


def test_hellos_past_what_a_lane_serves_within_a_deadline_are_refused_at_once() -> None:
    """Finding 12: connections queued 2 s for a slot and then shed, or served after their
    clients gave up; 69% of the handshakes begun produced no registration."""
    limits = AdmissionLimits(
        agents_in_flight=(4, 100), others_in_flight=2, deadline_s=3.0, agents_queue_s=3.0,
        min_left_s=0.5, assumed_rate=100,
    )
    core = TLSAdmission(limits)
    # Before any measure: the assumed 100 a second, 2.5 s of them.
    assert [core.hello(AGENTS, 0.0) for _ in range(251)][-2:] == [None, REFUSED_BUSY]
    assert core.queue_bound(AGENTS) == 250
    # Operators have a lane of their own: the agents' queue does not hold them back.
    assert core.hello(OTHERS, 0.0) is None
    # A busy second in which 20 places were given back: 20 a second measured (the first
    # measure is taken as it is, later ones move the rate halfway); the queue is cut to
    # 2.5 s of it.
    for k in range(20):
        assert begin(core, AGENTS, 0.05 * k, 3.0)
        core.done(AGENTS, "?", 0.05 * k + 0.01)
    core.hello(AGENTS, 1.0)
    assert core.lanes[AGENTS].rate == pytest.approx(20 / 1.0)
    # The agents' lane counts itself no slower than assumed (a storm's first second
    # measures a starved rate): the queue stays 2.5 s of the assumed 100.
    assert core.queue_bound(AGENTS) == pytest.approx(250)
    # The places in flight follow the measure: 3 s of it (a registration takes about that).
    assert core.lanes[AGENTS].places(limits) == 60
    # 231 queued: 19 more fit in the 250, the next is refused.
    assert [core.hello(AGENTS, 1.1) for _ in range(20)][-2:] == [None, REFUSED_BUSY]
    assert core.lanes[AGENTS].waiting == 250
    # Where the assumed rate is lower, the measure raises the bound: 2.5 s of 20 a second.
    slow = TLSAdmission(attrs.evolve(limits, assumed_rate=10))
    assert slow.queue_bound(AGENTS) == pytest.approx(25)
    slow.lanes[AGENTS].rate = 20.0
    assert slow.queue_bound(AGENTS) == pytest.approx(50)
    # Never below the lane's places, however slow it was.
    assert TLSAdmission(attrs.evolve(limits, assumed_rate=0.1)).queue_bound(AGENTS) == 4


def test_a_quiet_second_says_nothing_of_capacity() -> None:
    core = TLSAdmission(AdmissionLimits(agents_in_flight=(4, 8)))
    for t in (0.0, 0.5, 1.2, 2.5, 3.9):  # one at a time: never a place short
        assert core.hello(AGENTS, t) is None
        assert begin(core, AGENTS, t, t + 3)
        core.done(AGENTS, "?", t + 0.01)
    assert core.lanes[AGENTS].rate is None


def test_agents_are_told_apart_by_the_alpn_name_their_hello_offers() -> None:
    assert offered_alpn(client_hello()) == []
    assert lane_of(client_hello()) == OTHERS
    assert offered_alpn(client_hello(["h2", "http/1.1"])) == [b"h2", b"http/1.1"]
    assert lane_of(client_hello(["h2", "http/1.1"])) == OTHERS
    assert lane_of(client_hello([AGENT_ALPN.decode()])) == AGENTS
    for broken in (b"", b"\x16\x03\x01\x00\x10" + bytes(16), client_hello(["x"])[:60]):
        assert offered_alpn(broken) == []


def test_routers_apart_have_a_lane_of_their_own_by_their_alpn_name() -> None:
    assert ROUTER_ALPN != AGENT_ALPN
    assert lane_of(client_hello([ROUTER_ALPN.decode()])) == ROUTERS
    assert lane_of(client_hello(["http/1.1", ROUTER_ALPN.decode()])) == ROUTERS
    core = TLSAdmission(AdmissionLimits(others_in_flight=1, routers_in_flight=1))
    assert core.hello(OTHERS, 0.0, source="a") is None and core.grant(OTHERS) == "a"
    # The operators' lane is full; a router still gets its place at once.
    assert core.hello(ROUTERS, 0.0, source="b") is None and core.grant(ROUTERS) == "b"
    assert core.hello(OTHERS, 0.0, source="c") is None and core.grant(OTHERS) is None


def test_one_source_holds_two_places_and_its_third_hello_waits_while_another_gets_in() -> None:
    core = TLSAdmission(AdmissionLimits(others_in_flight=16))
    assert (core.limits.per_source_in_flight, core.limits.per_source_queued) == (2, 6)
    for _ in range(3):
        assert core.hello(OTHERS, 0.0, source="10.0.0.1") is None
    assert core.grant(OTHERS) == "10.0.0.1"
    assert core.grant(OTHERS) == "10.0.0.1"
    assert core.grant(OTHERS) is None  # its third waits: 14 places free, none for it
    assert core.hello(OTHERS, 0.0, source="10.0.0.2") is None
    assert core.grant(OTHERS) == "10.0.0.2"  # another address gets in past it
    lane = core.lanes[OTHERS]
    assert lane.in_flight == 3 and lane.waiting == 1 and lane.held["10.0.0.1"] == 2
    core.done(OTHERS, "10.0.0.1", 1.0)
    assert core.grant(OTHERS) == "10.0.0.1"  # its own place back: now its third's turn
    # Six hellos may wait from one address; the seventh is refused before any SSL object.
    for _ in range(6):
        assert core.hello(OTHERS, 1.0, source="10.0.0.3") is None
    assert core.hello(OTHERS, 1.0, source="10.0.0.3") == REFUSED_SOURCE_QUEUED
    # Agents are not capped per source (a fleet behind one NAT registers in turn).
    for _ in range(5):
        assert core.hello(AGENTS, 1.0, source="10.0.0.1") is None
    assert [core.grant(AGENTS) for _ in range(5)] == ["10.0.0.1"] * 5


def test_a_place_given_back_goes_to_the_source_holding_the_fewest() -> None:
    """Issue 34, finding 2: 8 addresses at their cap hold all 16 places; first come,
    first served gave each place they gave back to their own hellos queued before the
    operator's, and the operator waited behind all of them."""
    core = TLSAdmission(AdmissionLimits(others_in_flight=16))
    attackers = [f"10.0.0.{k}" for k in range(1, 9)]
    for _ in range(6):
        for source in attackers:
            assert core.hello(OTHERS, 0.0, source=source) is None
    assert sorted(core.grant(OTHERS) or "" for _ in range(16)) == sorted(attackers * 2)
    assert core.grant(OTHERS) is None
    assert core.hello(OTHERS, 0.5, source="192.0.2.7") is None  # the operator, last
    core.done(OTHERS, "10.0.0.3", 1.0)
    assert core.grant(OTHERS) == "192.0.2.7"
    core.done(OTHERS, "10.0.0.5", 1.1)
    assert core.grant(OTHERS) == "10.0.0.3"  # holding 1: before 10.0.0.5, which joined later
    assert core.grant(OTHERS) is None


def test_a_full_queue_still_takes_the_first_hello_of_a_source_with_none_waiting() -> None:
    limits = AdmissionLimits(others_in_flight=2, assumed_rate=1.0, others_queue_s=4.5)
    core = TLSAdmission(limits)
    assert core.queue_bound(OTHERS) == 4  # 1 a second for 4 s
    for source in ("a", "a", "b", "b"):
        assert core.hello(OTHERS, 0.0, source=source) is None
    assert core.hello(OTHERS, 0.0, source="a") == REFUSED_BUSY
    assert core.hello(OTHERS, 0.0, source="c") is None  # its first: queued past the bound
    assert core.hello(OTHERS, 0.0, source="c") == REFUSED_BUSY
    assert core.hello(AGENTS, 0.0, source="z") is None  # the agents' lane is bounded alone
    # The lane's hard bound holds for everyone.
    full = TLSAdmission(attrs.evolve(limits, max_queued=4))
    for source in ("a", "b", "c", "d"):
        assert full.hello(OTHERS, 0.0, source=source) is None
    assert full.hello(OTHERS, 0.0, source="e") == REFUSED_BUSY


def test_a_granted_place_shed_or_given_back_is_the_sources_again_and_nothing_leaks() -> None:
    core = TLSAdmission(AdmissionLimits(others_in_flight=1, min_left_s=0.5))
    assert core.hello(OTHERS, 0.0, source="a") is None
    assert core.hello(OTHERS, 0.0, source="a") is None
    assert core.grant(OTHERS) == "a"
    assert not core.start(OTHERS, "a", 10.0, deadline=10.2)  # too late: shed, not served
    assert core.refused == {SHED_LATE: 1}
    assert core.grant(OTHERS) == "a" and core.start(OTHERS, "a", 10.0, deadline=11.0)
    core.done(OTHERS, "a", 10.5)
    lane = core.lanes[OTHERS]
    assert (lane.in_flight, lane.waiting, lane.begun, lane.bucket_done) == (0, 0, 2, 1)
    assert not lane.held and not lane.queued and not any(lane.ready)
    assert core.hello(OTHERS, 11.0, source="b") is None
    core.unqueue(OTHERS, "b")  # cut at its deadline while it waited
    assert not lane.queued and not any(lane.ready) and core.grant(OTHERS) is None


def test_the_clients_finished_is_due_1_s_after_the_servers_flight_but_an_agents() -> None:
    core = TLSAdmission()
    assert core.limits.flight_answer_s == 1.0
    assert core.answer_deadline(OTHERS, 100.0, handshake_by=103.0) == 101.0
    assert core.answer_deadline(ROUTERS, 100.0, handshake_by=103.0) == 101.0
    assert core.answer_deadline(OTHERS, 102.5, handshake_by=103.0) == 103.0
    assert core.answer_deadline(AGENTS, 100.0, handshake_by=103.0) == 103.0


def test_a_source_is_its_ipv4_address_or_its_ipv6_64() -> None:
    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert source_key("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:2:bbbb::9") == source_key("2001:db8:1:2::1")
    assert source_key("2001:db8:1:3::1") != source_key("2001:db8:1:2::1")
    assert source_key("fe80::1%eth0") == "fe80::/64"
    assert source_key("?") == "?"


# -- in process, over real sockets and real TLS -----------------------------------


async def test_a_client_that_closed_or_reset_is_seen_to_have_left() -> None:
    with trio.fail_after(10):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        staying = await trio.open_tcp_stream("127.0.0.1", port)
        leaving = await trio.open_tcp_stream("127.0.0.1", port)
        first = await listeners[0].accept()
        second = await listeners[0].accept()

        def left(stream: trio.SocketStream) -> bool:
            raw = sockio.raw_socket(stream)
            assert raw is not None
            return sockio.peer_left(raw)

        assert not left(first) and not left(second)
        await leaving.aclose()  # a FIN, as a client's connect timeout sends
        while not left(second):
            await trio.sleep(0.01)
        assert not left(first)
        for stream in (staying, first, second, *listeners):
            await stream.aclose()


def test_the_control_port_issues_no_session_tickets(tmp_path: Path) -> None:
    """Agents cannot resume a session (trio's SSLStream takes none), and two TLS 1.3
    tickets were a third of the server's CPU per handshake (1.56 ms, 1.06 ms without)."""
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_node(certs, "node-1")
    tls = AgentsTLS(ca=certs / "ca.crt", cert=certs / "server.crt", key=certs / "server.key")
    client_context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    client_context.load_cert_chain(certs / "nodes" / "node-1.crt", certs / "nodes" / "node-1.key")
    for version in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
        client_context.maximum_version = version
        to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
        from_server, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
        client = client_context.wrap_bio(to_client, from_client, server_hostname="localhost")
        server = server_context(tls).wrap_bio(to_server, from_server, server_side=True)
        done: set[str] = set()
        for _ in range(10):
            for name, end in (("client", client), ("server", server)):
                try:
                    end.do_handshake()
                    done.add(name)
                except ssl.SSLWantReadError:
                    pass
            to_server.write(from_client.read())
            to_client.write(from_server.read())
        assert done == {"client", "server"} and client.version() == version.name.replace("_", ".")
        server.write(b"x")  # after the handshake: TLS 1.3's tickets would come first
        to_client.write(from_server.read())
        assert client.read(1) == b"x"
        session = client.session
        assert session is None or not session.has_ticket, version


async def answer(request: Request, responder: Responder) -> None:
    await responder.whole(200, b'{"ok": true}', JSON)


async def serve_tls(
    nursery: trio.Nursery, certs: Path, limits: AdmissionLimits | None = None
) -> tuple[int, HTTPServer]:
    tls = AgentsTLS(ca=certs / "ca.crt", cert=certs / "server.crt", key=certs / "server.key")
    server = HTTPServer(answer, ServerLimits(), ssl_context=server_context(tls))
    server.tls_admission = Gate(limits)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return listeners[0].socket.getsockname()[1], server


async def silent(port: int, source: str = "127.0.0.1", first: bytes = b"") -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    if first:
        await stream.send_all(first)
    return stream


async def cut_after(stream: trio.SocketStream) -> None:
    """Return once the server closes or resets `stream`."""
    try:
        while await stream.receive_some():
            pass
    except trio.BrokenResourceError:
        pass


async def get(port: int, certs: Path, path: str = "/") -> int:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    async with httpx.AsyncClient(verify=context, timeout=10) as client:
        return (await client.get(f"https://127.0.0.1:{port}{path}")).status_code


async def test_silent_and_trickling_handshakes_are_cut_within_3_s(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    hello = client_hello()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs)
            # Timed from before the connects, so that their 3 s (from the accepts) are
            # all inside what is measured, however late this task runs after them.
            t0 = trio.current_time()
            quiet = await silent(port)
            trickle = await silent(port, first=hello[:7])  # a record header and a bit
            times: list[float] = []

            async def measure(stream: trio.SocketStream) -> None:
                await cut_after(stream)
                times.append(trio.current_time() - t0)

            async with trio.open_nursery() as waits:
                waits.start_soon(measure, quiet)
                waits.start_soon(measure, trickle)
            # 3 s from the accept; today's code waited the 10 s header timeout. Below
            # 8 s, not 5: a starved machine (CI's) delays a cut by seconds.
            assert all(2.99 < t < 8.0 for t in times), times
            assert server.tls_admission.core.total_pending == 0
            nursery.cancel_scope.cancel()


async def test_a_handshake_stalled_after_the_servers_flight_is_cut_1_s_after_it(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Issue 34, finding 2: a peer that sent its whole hello, read the server's flight
    and said nothing more held its place in the operators' lane for 3 s. Real sockets
    on trio's mock clock: it jumps once nothing has run for 50 ms (loopback's bytes
    arrive in microseconds), so the times read are the deadlines', exactly."""
    mock_clock.autojump_threshold = 0.05
    certs = tmp_path / "certs"
    init_ca(certs)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs)
            cuts = {}
            for alpn, lane in ((None, OTHERS), ([ROUTER_ALPN.decode()], ROUTERS),
                               ([AGENT_ALPN.decode()], AGENTS)):
                stream = await silent(port, first=client_hello(alpn))
                assert await stream.receive_some()  # the server's flight
                flight = trio.current_time()
                await cut_after(stream)
                cuts[lane] = trio.current_time() - flight
            # Agents keep their handshake deadline (3 s from their place).
            assert cuts[OTHERS] == pytest.approx(1.0, abs=0.06), cuts
            assert cuts[ROUTERS] == pytest.approx(1.0, abs=0.06), cuts
            assert cuts[AGENTS] == pytest.approx(3.0, abs=0.06), cuts
            lanes = server.tls_admission.core.lanes
            assert all(lanes[name].begun == 1 and not lanes[name].in_flight for name in cuts)
            nursery.cancel_scope.cancel()


async def test_a_peer_stalled_after_its_hello_holds_no_handshake_slot(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            # One slot: a stalled handshake that held it would shut everyone out until
            # cut, 10 s after its place here: served at once is told from served after
            # the stalled ones, with seconds to spare for a starved machine (CI's).
            limits = AdmissionLimits(handshakes_at_once=1, deadline_s=10.0)
            port, server = await serve_tls(nursery, certs, limits)
            stalled = [await silent(port, first=client_hello()) for _ in range(3)]
            await trio.sleep(0.2)  # their hellos are in; the server sent its first flights
            t0 = trio.current_time()
            assert await get(port, certs) == 200
            assert trio.current_time() - t0 < 6.0
            for stream in stalled:
                await stream.aclose()
            lanes = server.tls_admission.core.lanes.values()
            while any(lane.in_flight or lane.waiting for lane in lanes):
                await trio.sleep(0.05)  # every place given back: nothing leaks
            nursery.cancel_scope.cancel()


async def test_past_its_pending_bound_a_source_is_reset_at_once_and_others_served(
    tmp_path: Path,
) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            # A 10 s deadline: a connection left to it is told from one reset at once,
            # with seconds to spare for a starved machine (CI's).
            limits = AdmissionLimits(per_source_pending=4, deadline_s=10.0)
            port, server = await serve_tls(nursery, certs, limits)
            held = [await silent(port, "127.0.0.2") for _ in range(4)]
            await trio.sleep(0.2)  # accepted
            t0 = trio.current_time()
            try:  # reset at once, not left to its deadline: during connect, or after
                await cut_after(await silent(port, "127.0.0.2"))
            except ConnectionResetError:
                pass
            assert trio.current_time() - t0 < 5.0
            assert server.tls_admission.core.refused == {REFUSED_SOURCE: 1}
            assert await get(port, certs) == 200  # from 127.0.0.1
            for stream in held:
                await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_40_silent_connections_leave_the_admin_api_and_new_agents_served(
    tmp_path: Path,
) -> None:
    """Finding 3: 40 silent TCP connections, redialled when closed, took the port
    offline (32 handshake slots, each held 10 s; a queue shed after 2 s)."""
    certs = tmp_path / "certs"
    config, agent_tls = control_plane_with_a_node(certs)
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
            control = running.control_port
            assert control is not None

            async def hold_silent(k: int) -> None:
                while True:  # redialled when the server cuts it, as the attacker did
                    stream = await silent(control, f"127.0.0.{2 + k % 8}")
                    await cut_after(stream)

            for k in range(40):
                nursery.start_soon(hold_silent, k)
            await trio.sleep(0.5)  # every one accepted and silent
            for _ in range(3):  # across the silent ones' 3 s cuts and redials
                with trio.fail_after(5):  # today's code: reset after 2 s in the queue
                    assert await get(control, certs, "/v1/admin/status") == 200
                    assert await get(control, certs, "/metrics") == 200
                    assert await get(control, certs, "/ui") == 200
                with trio.fail_after(5):  # today's code: reset after 2 s in the queue
                    async with open_agent_stream(
                        f"wss://127.0.0.1:{control}/v1/agent",
                        agent_tls,
                        connect_timeout_s=3,
                        disconnect_timeout_s=1,
                        max_message_size=MAX_FRAME_BYTES,
                    ) as ws:
                        inventory = Inventory(
                            name="new-node", gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),)
                        )
                        await ws.send_message(encode(Register(PROTOCOL, "test", inventory)))
                        assert isinstance(decode_down(await ws.get_message()), Welcome)
                await trio.sleep(1.0)
            stop.set()
            nursery.cancel_scope.cancel()


def control_plane_with_a_node(certs: Path) -> tuple[Config, ssl.SSLContext]:
    """A fleet CA in `certs`, a control plane's config over mutual TLS (one placed model),
    and the TLS context of an agent with a certificate for the node `new-node`."""
    table, agent_tls = control_plane_table(certs)
    return parse_config(table, "<test>"), agent_tls


def control_plane_table(
    certs: Path, listen: str = "127.0.0.1:0", control_listen: str = "127.0.0.1:0"
) -> tuple[dict[str, object], ssl.SSLContext]:
    """`control_plane_with_a_node`'s config as its TOML table, on the addresses given."""
    init_ca(certs)
    crt, key, _ = issue_node(certs, "new-node")
    agent_tls = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    agent_tls.load_cert_chain(str(crt), str(key))
    return control_table(certs, listen, control_listen), agent_tls


def control_table(
    certs: Path, listen: str = "127.0.0.1:0", control_listen: str = "127.0.0.1:0"
) -> dict[str, object]:
    """A control plane's config table over mutual TLS with the fleet CA in `certs` (made
    already), placing one model."""
    return {
        "server": {"listen": listen, "control_listen": control_listen},
        "agents": {
            "ca": str(certs / "ca.crt"),
            "cert": str(certs / "server.crt"),
            "key": str(certs / "server.key"),
        },
        "models": [
            {"name": "m", "profile": {"engine": "vllm", "model": "org/m", "gpu_model": "B300"}},
        ],
    }


async def agent_handshake(port: int, certs: Path) -> trio.SSLStream[trio.SocketStream]:
    """A TLS handshake as an agent's dial makes it (its ALPN name), without a certificate."""
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.set_alpn_protocols([AGENT_ALPN.decode()])
    tls = trio.SSLStream(
        await trio.open_tcp_stream("127.0.0.1", port), context, server_hostname="localhost"
    )
    await tls.do_handshake()
    return tls


async def test_an_agent_waits_its_turn_past_3_s_and_is_served_when_a_place_frees(
    tmp_path: Path,
) -> None:
    """Finding 12: an agent's connection was cut 3 s after its arrival however patient
    the agent, so a storm the server could not serve within 3 s came back again and
    again (4 dials a node at 10,000 nodes). Now it waits in FIFO order for its place,
    up to agents_queue_s, holding no slot, and is served with one handshake."""
    certs = tmp_path / "certs"
    init_ca(certs)
    # One place for agents, held 4 s by an agent that says nothing after its handshake.
    limits = AdmissionLimits(agents_in_flight=(1, 1), in_flight_s=4.0, agents_queue_s=30.0)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs, limits)
            agents = server.tls_admission.core.lanes[AGENTS]
            # From before the first's handshake: its place's 4 s are all inside the wait.
            t0 = trio.current_time()
            first = await agent_handshake(port, certs)
            done: list[str] = []
            streams = [first]

            async def second_agent() -> None:
                streams.append(await agent_handshake(port, certs))  # today's: reset at 3 s
                done.append("agent")

            async def operator() -> None:
                while not agents.waiting:  # the agent queued first: a shared lane's FIFO
                    await trio.sleep(0.01)  # would serve the operator after it
                assert await get(port, certs) == 200
                done.append("operator")

            async with trio.open_nursery() as both:
                both.start_soon(second_agent)
                both.start_soon(operator)
            waited = trio.current_time() - t0
            # Served when the place frees, 4 s on; well before agents_queue_s (30 s).
            assert 3.5 < waited < 12.0, waited
            assert server.tls_admission.core.refused == {}
            # Meanwhile operators were not held back: their lane is their own. Told by
            # the order, not a time: a starved machine delays both, the agent 4 s more.
            assert done == ["operator", "agent"], done
            for stream in streams:
                await trio.aclose_forcefully(stream)
            nursery.cancel_scope.cancel()


async def test_a_queued_agent_is_still_cut_at_the_queue_deadline(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_ca(certs)
    # The place frees, and the handshake deadline passes, 10 s on: a cut at the 2 s
    # queue deadline is told from either, with seconds to spare for a starved machine.
    limits = AdmissionLimits(
        agents_in_flight=(1, 1), in_flight_s=10.0, agents_queue_s=2.0, deadline_s=10.0
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs, limits)
            first = await agent_handshake(port, certs)
            t0 = trio.current_time()
            with pytest.raises(trio.BrokenResourceError):
                await agent_handshake(port, certs)
            assert 1.0 < trio.current_time() - t0 < 6.0
            await trio.aclose_forcefully(first)
            lanes = server.tls_admission.core.lanes.values()
            while any(lane.in_flight or lane.waiting for lane in lanes):
                await trio.sleep(0.05)  # every place given back: nothing leaks
            assert server.tls_admission.core.total_pending == 0
            assert not server.tls_admission.core.pending
            nursery.cancel_scope.cancel()


# -- a refused agent is told when to come back ----------------------------------------


def test_refused_agents_are_given_turns_at_the_rate_the_lane_serves() -> None:
    """Finding 12: refused agents redialled at random into a full queue (4 dials a node at
    10,000 nodes). Each is told when to come back: once the lane has served half its
    queue, and after every agent refused before it, one turn per 1 / rate seconds."""
    limits = AdmissionLimits(
        agents_in_flight=(4, 100), agents_queue_s=6.0, min_left_s=0.5, assumed_rate=100,
        come_back_jitter_s=2.0, come_back_overbook=1.0,
    )
    core = TLSAdmission(limits)
    for _ in range(550):
        assert core.hello(AGENTS, 10.0) is None
    assert core.hello(AGENTS, 10.0) == REFUSED_BUSY
    # 550 queued at 100 a second, 5.5 s; half of it served, 2.75 s: the first refused
    # comes back then, the next ones 10 ms apart each; the jitter (in [0, 1) of 2 s)
    # spreads a turn over 2 s.
    waits = [core.come_back_s(10.0, REFUSED_BUSY, 0.0) for _ in range(250)]
    assert waits[0] == pytest.approx(2.75)
    assert waits[1:3] == [pytest.approx(2.76), pytest.approx(2.77)]
    assert waits[-1] == pytest.approx(2.75 + 249 / 100)
    assert core.come_back_s(10.0, REFUSED_BUSY, 0.5) == pytest.approx(2.75 + 2.5 + 1.0)
    # Later, the turns go on from the last one given, not from the queue alone.
    assert core.come_back_s(12.0, REFUSED_FULL, 0.0) == pytest.approx(5.26 - 2.0)
    # A rate measured below the assumed one (a storm's first seconds) gives turns no
    # later than the assumed rate would.
    core.lanes[AGENTS].rate = 10.0
    assert core.come_back_s(12.0, REFUSED_FULL, 0.0) == pytest.approx(5.27 - 2.0)


def test_no_turn_lies_past_the_queue_deadline() -> None:
    """A storm's first seconds measure the starved fleet's rate, not the server's: turns
    given in order at it had 10,000 agents of a failover come back over a minute while
    the server idled. Past the queue deadline (5.5 s here) a turn is drawn from its
    second half instead, and the turns in order go on from where they stood."""
    limits = AdmissionLimits(
        agents_in_flight=(4, 100), agents_queue_s=6.0, min_left_s=0.5, assumed_rate=100,
        come_back_jitter_s=2.0, come_back_overbook=1.0,
    )
    core = TLSAdmission(limits)
    for _ in range(551):
        core.hello(AGENTS, 10.0)
    in_order = [core.come_back_s(10.0, REFUSED_BUSY, 0.0) for _ in range(276)]
    assert in_order[-1] == pytest.approx(5.5)  # the queue deadline's last turn in order
    promised = core.lanes[AGENTS].promised_until
    assert core.come_back_s(10.0, REFUSED_BUSY, 0.0) == pytest.approx(2.75)
    assert core.come_back_s(10.0, REFUSED_BUSY, 0.999) == pytest.approx(2.75 * 1.999)
    assert core.lanes[AGENTS].promised_until == promised
    # Once time has passed, turns in order are given again from where they stood.
    assert core.come_back_s(11.0, REFUSED_BUSY, 0.0) == pytest.approx(promised - 11.0)


def test_turns_are_overbooked_since_a_storms_first_rate_is_a_starved_one() -> None:
    """Turns given at the rate measured in a storm's first seconds kept a 10,000-node
    fleet coming back at half what the server then served. With come_back_overbook 2
    (the default) the turns come as if the lane served twice its measured rate."""
    core = TLSAdmission(AdmissionLimits(agents_queue_s=6.0, min_left_s=0.5, assumed_rate=100))
    assert core.limits.come_back_overbook == 2.0
    for _ in range(550):
        core.hello(AGENTS, 10.0)
    # 550 queued, served at 200 a second in 2.75 s: half of the queue's 5.5 s deadline
    # less that is 0, so the first turn is now; then one each 5 ms.
    waits = [core.come_back_s(10.0, REFUSED_BUSY, 0.0) for _ in range(3)]
    assert waits == [pytest.approx(0.0), pytest.approx(0.005), pytest.approx(0.01)]


def test_one_address_flooding_holds_no_turn_and_no_wait_is_past_the_cap() -> None:
    core = TLSAdmission(
        AdmissionLimits(assumed_rate=10, agents_queue_s=10.5, min_left_s=0.5, come_back_overbook=1)
    )
    for _ in range(100):  # 10 s of queue at 10 a second: half of it served in 5 s
        core.hello(AGENTS, 0.0)
    for _ in range(1000):
        assert core.come_back_s(0.0, REFUSED_SOURCE, 0.0) == pytest.approx(5.0)
    assert core.lanes[AGENTS].promised_until == 0.0  # no turn taken
    # A storm far past what the lane serves: no turn past the queue deadline (10 s, and
    # the jitter of 2 s), where MAX_COME_BACK_S capped them before.
    waits = [core.come_back_s(0.0, REFUSED_BUSY, 0.99) for _ in range(10_000)]
    assert max(waits) <= 10.0 + 2.0 < MAX_COME_BACK_S
    assert core.lanes[AGENTS].promised_until <= 10.0 + 0.1


def test_a_come_back_line_reads_back_and_nonsense_is_no_wait() -> None:
    for seconds in (0.0, 2.5, 31.25, MAX_COME_BACK_S):
        assert come_back_s(come_back_line(seconds)) == pytest.approx(seconds, abs=0.006)
    assert come_back_s(come_back_line(1e9)) == MAX_COME_BACK_S
    assert come_back_s(come_back_line(-3)) == 0.0
    assert come_back_s(COME_BACK_PREFIX + b"inf\r\n") == MAX_COME_BACK_S
    for nonsense in (b"", b"\x16\x03\x03\x00\x02", COME_BACK_PREFIX + b"nan\r\n",
                     COME_BACK_PREFIX + b"-1\r\n", COME_BACK_PREFIX + b"\xff\r\n",
                     COME_BACK_PREFIX + b"soon\r\n", b"HTTP/1.1 503 busy\r\n"):
        assert come_back_s(nonsense) is None, nonsense


async def test_a_refused_agent_dial_says_when_the_control_plane_asks_it_back(
    tmp_path: Path,
) -> None:
    """Over real sockets: the port refuses before any SSL object (this address has no
    pending place left), writes the come-back line and resets; the agent's dial reads it."""
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_node(certs, "node-1")
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(certs / "nodes" / "node-1.crt", certs / "nodes" / "node-1.key")
    limits = AdmissionLimits(per_source_pending=0, assumed_rate=10, come_back_jitter_s=0.5)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs, limits)
            waits = []
            for _ in range(2):
                with pytest.raises(ConnectFailed) as failed:
                    await dial(Target("127.0.0.1", port, "/v1/agent", True), context)
                assert "busy" in str(failed.value)
                waits.append(failed.value.come_back_s)
            assert all(w is not None and 0.0 <= w <= 0.5 for w in waits)
            assert server.tls_admission.core.refused == {REFUSED_SOURCE: 2}
            assert server.tls_failures == 0  # no handshake begun
            nursery.cancel_scope.cancel()


async def test_past_max_pending_a_connection_waits_in_the_kernel_queue_not_refused(
    tmp_path: Path,
) -> None:
    """Finding 12: a starved fleet's late hellos held every pending place, and the
    connections after them (agents, and the bench's operator) were reset at accept.
    Now they wait in the kernel's accept queue, and are served once a place frees."""
    certs = tmp_path / "certs"
    init_ca(certs)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            # The held ones are cut 10 s after their accepts: served when one leaves (1 s)
            # is told from served when they are cut, with seconds to spare for a starved
            # machine (CI's).
            limits = AdmissionLimits(max_pending=2, deadline_s=10.0)
            port, server = await serve_tls(nursery, certs, limits)
            held = [await silent(port, "127.0.0.2"), await silent(port, "127.0.0.3")]
            await trio.sleep(0.2)  # accepted: every pending place taken
            assert server.tls_admission.core.total_pending == 2


            async def leave_after_1_s() -> None:
                await trio.sleep(1.0)
                await held[0].aclose()  # a pending place frees

            nursery.start_soon(leave_after_1_s)
            t0 = trio.current_time()
            assert await get(port, certs) == 200  # today's code: reset at accept
            assert 0.9 < trio.current_time() - t0 < 6.0
            assert server.tls_admission.core.refused == {}
            await held[1].aclose()
            nursery.cancel_scope.cancel()


async def test_an_operator_kept_in_the_kernel_queue_past_3_s_is_still_served(
    tmp_path: Path,
) -> None:
    """Finding 12: during the bench's storm its operator's connection waited in the
    kernel's accept queue behind agents' and was reset as too old at 3 s. Its hello is
    due 3 s after its accept; it may have waited up to others_queue_s since its arrival."""
    certs = tmp_path / "certs"
    init_ca(certs)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs, AdmissionLimits(max_pending=1))
            # From before the held one's connect: its 3 s (from its accept) are all inside
            # what is measured, however late this task runs after it.
            t0 = trio.current_time()
            held = await silent(port, "127.0.0.2")  # the one pending place, cut at 3 s
            await trio.sleep(0.2)
            assert await get(port, certs) == 200
            # Not before the held one's cut; the upper bound leaves a starved machine
            # seconds, below the operator's 10 s from its arrival (others_queue_s).
            assert 2.99 < trio.current_time() - t0 < 8.0
            assert server.tls_admission.core.refused == {}
            await held.aclose()
            nursery.cancel_scope.cancel()


def test_a_leaders_line_reads_back_and_nonsense_names_no_leader() -> None:
    url = "wss://cp-2.example:8081/v1/agent"
    line = not_leader_line(url)
    assert line is not None and not_leader_url(line) == url
    assert not_leader_url(line + b"\x16\x03") == url  # what follows is not read
    too_long = "wss://" + "a" * MAX_LEADER_URL_BYTES + "/v1/agent"
    assert not_leader_line(too_long) is None and not_leader_line("wss://a b/v1") is None
    assert not_leader_line("wss://caf\u00e9/v1/agent") is None
    for nonsense in (
        b"",
        NOT_LEADER_PREFIX,  # no end of line
        NOT_LEADER_PREFIX + b"\r\n",  # no URL
        NOT_LEADER_PREFIX + b"wss://a b\r\n",
        NOT_LEADER_PREFIX + b"wss://\xff\r\n",
        NOT_LEADER_PREFIX + b"x" * (MAX_LEADER_URL_BYTES + 1) + b"\r\n",
        come_back_line(1.0),
    ):
        assert not_leader_url(nonsense) is None, nonsense


async def test_a_standby_names_the_leader_to_an_agents_hello_before_any_tls(
    tmp_path: Path,
) -> None:
    """A port whose control plane answers agents' hellos (the seat's callback) writes the
    line it returns in place of its first TLS record: the leader's URL (the dial raises
    ConnectFailed naming it) or when to come back, no handshake begun. The callback is
    given the epoch an agent says it lost (None for an agent that lost none) and the
    address it came from; an agent of a version whose hello says it lost a leader but
    not the epoch gets its handshake (a standby may hold it for the election), and so
    do operators."""
    certs = tmp_path / "certs"
    init_ca(certs)
    issue_node(certs, "node-1")
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    context.load_cert_chain(certs / "nodes" / "node-1.crt", certs / "nodes" / "node-1.key")
    leader = "wss://127.0.0.1:1/v1/agent"
    asked: list[int | None] = []

    async def answer(lost: int | None, source: str) -> bytes | None:
        assert source == "127.0.0.1"
        asked.append(lost)
        await trio.sleep(0.05)  # it may take a while (an election)
        if lost is None:
            return not_leader_line(leader)
        return come_back_line(0.25) if lost < 7 else None

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port, server = await serve_tls(nursery, certs)
            server.tls_admission.redirect = answer
            agents = server.tls_admission.core.lanes[AGENTS]  # `begun`: places ever taken
            where = Target("127.0.0.1", port, "/v1/agent", True)
            with pytest.raises(ConnectFailed) as failed:
                await dial(where, context)
            assert failed.value.leader == leader and failed.value.come_back_s is None
            assert leader in str(failed.value)
            assert agents.begun == 0 and server.tls_failures == 0  # the line, no handshake
            with pytest.raises(ConnectFailed) as failed:
                await dial(where, context, alpn=(AGENT_ALPN, lost_leader_alpn(6)))
            assert failed.value.leader is None and failed.value.come_back_s == 0.25
            assert agents.begun == 0 and server.tls_failures == 0
            served = await dial(where, context, alpn=(AGENT_ALPN, lost_leader_alpn(7)))
            assert isinstance(served, trio.SSLStream)
            await trio.aclose_forcefully(served)
            older = await dial(where, context, alpn=(AGENT_ALPN, LOST_LEADER_ALPN))
            assert isinstance(older, trio.SSLStream)
            await trio.aclose_forcefully(older)
            assert asked == [None, 6, 7] and agents.begun == 2
            assert await get(port, certs) == 200
            # No leader named: agents are served here as before.
            async def serve_here(lost: int | None, source: str) -> bytes | None:
                return None

            server.tls_admission.redirect = serve_here
            plain = await dial(where, context)
            assert isinstance(plain, trio.SSLStream)
            await trio.aclose_forcefully(plain)
            assert agents.begun == 3  # served: its place and its handshake, no line
            nursery.cancel_scope.cancel()


def test_a_lost_leaders_epoch_is_read_from_the_offered_names_alone() -> None:
    """The epoch an agent says it lost: from its own ALPN name only, digits only."""
    assert lost_epoch([AGENT_ALPN, lost_leader_alpn(12)]) == 12
    assert lost_epoch([lost_leader_alpn(-3)]) == 0
    for names in (
        [AGENT_ALPN],
        [LOST_LEADER_ALPN],
        [LOST_LEADER_ALPN + b"/"],
        [LOST_LEADER_ALPN + b"/1e3"],
        [LOST_LEADER_ALPN + b"/-1"],
        [LOST_LEADER_ALPN + b"/" + b"9" * 20],
        [LOST_LEADER_ALPN + b"x/5"],
    ):
        assert lost_epoch(names) is None, names
