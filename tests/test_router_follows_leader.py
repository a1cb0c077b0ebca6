"""Routers apart follow the leader of control planes that share a store (issue 35).

A real router apart (`router_apart_main`, in process) with several `--control` URLs,
against small control ports on loopback: standbys that close the route feed with
NOT_LEADER_CLOSE (naming the leader, or none), and leaders (a real RouteHub behind
`serve_websocket`). What the router serves is read as its clients read it: a chat
answered by the mock engine whose port the answer's fingerprint names. Then the rules
alone (`Dialing`, `known_leader`, `feed_targets`), and the route feed's versions: a
router of protocol 1 follows a hub of this release, a router of this release follows
a hub of protocol 1.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import attrs
import httpx
import pytest
import trio
import trio_websocket

from llmgw_core.catalog import Endpoint
from llmgw_core.config import digest_of, parse_config
from llmgw_core.dial import Target
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits
from llmgw_mock_engine.engine import MockEngine, MockSettings
from llmgw_server import wiring
from llmgw_server.__main__ import run_cli
from llmgw_server.control_shell.standby import StandbyAnswers
from llmgw_server.route_feed import follower as follower_module
from llmgw_server.route_feed.hub import RouteHub, serve_websocket
from llmgw_server.route_feed.messages import (
    EPOCH_PROTOCOL,
    MAX_FRAME_BYTES,
    OLDEST_PROTOCOL,
    PROTOCOL,
    Hello,
    Routes,
    decode_table,
    decode_up,
    encode,
    spoken,
)
from llmgw_server.route_feed.remote import (
    BACKOFF_BASE_S,
    FAILOVER_WINDOW_S,
    SWITCH_JITTER_S,
    Dialing,
    FeedEnd,
    feed_target,
    feed_targets,
    known_leader,
)
from llmgw_server.wiring import router_apart_main
from test_held_requests import KEY, router_and_engine

TOKEN = "router-token-for-the-leader-only"
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


# -- control ports on loopback: a standby or a leader, switched at will ---------------------


@attrs.define
class Plane:
    """One control port. `hub` set: it leads (serves the route feed); None: a standby,
    which closes each feed with NOT_LEADER_CLOSE naming `leader` (None: no leader)."""

    hub: RouteHub | None = None
    leader: str | None = None
    port: int = 0
    dials: list[float] = attrs.field(factory=list)  # when each feed was opened
    tokens: list[bytes | None] = attrs.field(factory=list)  # the Authorization each gave
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def advertised(self) -> str:
        """How a standby names this control plane when it leads."""
        return f"ws://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Gone, with its port: nothing answers there any more."""
        self.scope.cancel()

    async def upgrade(self, request: Request, raw: trio.abc.Stream) -> None:
        self.dials.append(trio.current_time())
        self.tokens.append(request.header(b"authorization"))
        if self.hub is not None:
            digest = digest_of(TOKEN)
            await serve_websocket(
                self.hub, request, raw, router_digest=digest, admin_digest=None, peer="router"
            )
            return
        # The control port's own standby (control_shell.standby): NOT_LEADER_CLOSE, its
        # reason naming the leader's URL with the feed's path, or why none leads.
        standing = Standing(self.leader)
        await StandbyAnswers(lambda: standing, lambda: b"").upgrade(request, raw)


@attrs.frozen
class Standing:
    leader_url: str | None
    why: str = "no leader is elected now"
    leading: bool = False


async def _nothing(request: Request, responder: Responder) -> None:
    await responder.whole(404, b"{}")


async def serve_plane(plane: Plane, *, task_status: trio.TaskStatus[None]) -> None:
    with plane.scope:
        listeners = await trio.open_tcp_listeners(plane.port, host="127.0.0.1")
        plane.port = listeners[0].socket.getsockname()[1]
        try:
            async with trio.open_nursery() as nursery:
                server = HTTPServer(_nothing, ServerLimits(), upgrade=plane.upgrade)
                await nursery.start(server.serve, listeners)
                task_status.started()
        finally:
            for listener in listeners:  # stopped: connections are refused, not queued
                listener.socket.close()


@asynccontextmanager
async def engines(count: int) -> AsyncIterator[list[Endpoint]]:
    """Mock engines serving "chat" on loopback; each answer's fingerprint is mock:PORT."""
    async with trio.open_nursery() as nursery:
        found = []
        for _ in range(count):
            engine = MockEngine(MockSettings(model="chat", served_model_names=["chat"]))
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            engine.fingerprint = f"mock:{port}"
            await nursery.start(HTTPServer(engine.handle, ServerLimits()).serve, listeners)
            found.append(Endpoint("127.0.0.1", port))
        yield found
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def router_apart(controls: list[str], **router: object) -> AsyncIterator[httpx.AsyncClient]:
    """A router apart following `controls`, and a client of its port."""
    config = parse_config(
        {
            "server": {"listen": "127.0.0.1:0"},
            "router": {"health_interval_s": 0.2, "hold_timeout_s": 60.0, **router},
        },
        "router.toml",
        models_required=False,
    )
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: router_apart_main(
                config, controls, TOKEN, None, stop=stop, task_status=task_status
            )
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client
        stop.set()
        nursery.cancel_scope.cancel()


async def served_by(client: httpx.AsyncClient) -> str | None:
    """The fingerprint of the engine that answers a chat now (None: not answered 200)."""
    answer = await client.post("/v1/chat/completions", json=CHAT)
    return answer.json().get("system_fingerprint") if answer.status_code == 200 else None


async def until_served_by(client: httpx.AsyncClient, engine: Endpoint) -> None:
    while await served_by(client) != f"mock:{engine.port}":
        await trio.sleep(0.05)


def feed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmgw.router"]


@pytest.fixture
def router_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="llmgw.router"):
        yield caplog


# -- a real router apart among standbys and leaders ---------------------------------------------


async def test_a_router_goes_from_a_standby_to_the_leader_it_names_at_once(
    router_log: pytest.LogCaptureFixture,
) -> None:
    leader = Plane(RouteHub(epoch=3))
    standby, other = Plane(), Plane()  # `other` leads nothing and names no leader
    with trio.fail_after(30):
        async with engines(1) as (engine,), trio.open_nursery() as nursery:
            for plane in (leader, standby, other):
                await nursery.start(serve_plane, plane)
            leader.hub.publish({"chat": (engine,)}, frozenset(), complete=True)  # type: ignore[union-attr]
            standby.leader = leader.advertised
            # The standby first, the leader last: the one between is never dialed.
            async with router_apart([standby.url, f"{other.url},{leader.url}"]) as client:
                await until_served_by(client, engine)
                assert len(standby.dials) == 1 and len(leader.dials) == 1 and other.dials == []
                assert leader.tokens == [f"Bearer {TOKEN}".encode()]
            nursery.cancel_scope.cancel()
    (line,) = [line for line in feed_lines(router_log) if "does not lead" in line]
    assert line == (
        f"route feed from 127.0.0.1:{standby.port}: it does not lead (leader at "
        f"{leader.advertised}/v1/routes); no route table yet; the leader is one of --control; "
        f"dialing 127.0.0.1:{leader.port} now"
    )


async def test_with_no_leader_now_a_router_tries_the_next_control_plane_after_a_jitter(
    router_log: pytest.LogCaptureFixture,
) -> None:
    leader = Plane(RouteHub(epoch=1))
    standby = Plane()  # no leader named
    with trio.fail_after(30):
        async with engines(1) as (engine,), trio.open_nursery() as nursery:
            for plane in (leader, standby):
                await nursery.start(serve_plane, plane)
            leader.hub.publish({"chat": (engine,)}, frozenset(), complete=True)  # type: ignore[union-attr]
            async with router_apart([standby.url, leader.url]) as client:
                await until_served_by(client, engine)
                assert len(standby.dials) == 1 and len(leader.dials) == 1
                assert leader.dials[0] - standby.dials[0] >= min(SWITCH_JITTER_S)
            nursery.cancel_scope.cancel()
    (line,) = [line for line in feed_lines(router_log) if "does not lead" in line]
    prefix = (
        f"route feed from 127.0.0.1:{standby.port}: it does not lead (no leader is elected "
        f"now); no route table yet; looking for the leader; dialing 127.0.0.1:{leader.port} in "
    )
    assert line.startswith(prefix)
    delay = float(line.removeprefix(prefix).removesuffix(" s"))
    assert SWITCH_JITTER_S[0] <= delay <= SWITCH_JITTER_S[1]


async def test_a_leader_named_outside_the_routers_list_is_never_dialed(
    router_log: pytest.LogCaptureFixture,
) -> None:
    """A hostile standby names a "leader" of its own: the router's token never goes there."""
    leader, elsewhere = Plane(RouteHub(epoch=2)), Plane(RouteHub(epoch=9))
    standby = Plane()
    with trio.fail_after(30):
        async with engines(2) as (engine, lure), trio.open_nursery() as nursery:
            for plane in (leader, elsewhere, standby):
                await nursery.start(serve_plane, plane)
            leader.hub.publish({"chat": (engine,)}, frozenset(), complete=True)  # type: ignore[union-attr]
            elsewhere.hub.publish({"chat": (lure,)}, frozenset(), complete=True)  # type: ignore[union-attr]
            standby.leader = elsewhere.advertised
            async with router_apart([standby.url, leader.url]) as client:
                await until_served_by(client, engine)
            nursery.cancel_scope.cancel()
    assert elsewhere.dials == [] and elsewhere.tokens == []
    (line,) = [line for line in feed_lines(router_log) if "does not lead" in line]
    assert f"(leader at {elsewhere.advertised}/v1/routes)" in line
    assert "that leader is none of --control: not followed" in line


async def test_a_stale_leaders_table_is_refused_and_the_router_keeps_serving_its_own(
    router_log: pytest.LogCaptureFixture,
) -> None:
    """The leader of epoch 5 goes; the only control plane left still thinks it leads at
    epoch 4 (paused past its lease, woken): its table is refused, each time it is dialed,
    and the router serves epoch 5's table throughout."""
    leader, woken = Plane(RouteHub(epoch=5)), Plane(RouteHub(epoch=4))
    with trio.fail_after(40):
        async with engines(2) as (engine, other), trio.open_nursery() as nursery:
            for plane in (leader, woken):
                await nursery.start(serve_plane, plane)
            leader.hub.publish({"chat": (engine,)}, frozenset(), complete=True)  # type: ignore[union-attr]
            woken.hub.publish({"chat": (other,)}, frozenset(), complete=True)  # type: ignore[union-attr]
            async with router_apart([leader.url, woken.url]) as client:
                await until_served_by(client, engine)
                leader.stop()
                while len(woken.dials) < 2:  # refused, closed, and dialed again later
                    await trio.sleep(0.05)
                assert await served_by(client) == f"mock:{engine.port}"
                assert (await client.get("/readyz")).status_code == 200
                metrics = (await client.get("/metrics")).text
                refused = next(
                    line.split()[-1]
                    for line in metrics.splitlines()
                    if line.startswith('llmgw_route_tables_refused_total{reason="stale_epoch"}')
                )
                assert int(refused) >= 2
            nursery.cancel_scope.cancel()
    stale = [line for line in feed_lines(router_log) if "stale epoch" in line]
    assert (
        stale[0]
        == (
            f"route feed from 127.0.0.1:{woken.port}: a frame from the control plane cannot be "
            "used: a route table of stale epoch 4 was refused (this router follows epoch 5): "
            "that control plane no longer leads; serving the last route table (1 models); "
            f"looking for the leader; dialing 127.0.0.1:{leader.port} in "
        )
        + stale[0].rsplit(" in ", 1)[1]
    )


def held(hub: RouteHub) -> int:
    """The requests for "chat" that the hub's followers last said they hold."""
    return sum(load.held for load in hub.loads().get("chat", ()))


async def test_a_request_held_through_a_switch_wakes_the_new_leader_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A router holds a request for a model at zero when its leader goes: on connecting to
    the next leader it reports the held request at once (not a load interval later), and
    the request is answered once that leader publishes a replica."""
    monkeypatch.setattr(follower_module, "LOAD_INTERVAL_S", 60.0)  # only "at once" is seen
    first, second = Plane(RouteHub(epoch=1)), Plane(RouteHub(epoch=2))
    zero = frozenset({"chat"})
    with trio.fail_after(40):
        async with engines(1) as (engine,), trio.open_nursery() as nursery:
            for plane in (first, second):
                await nursery.start(serve_plane, plane)
                plane.hub.publish({"chat": ()}, frozenset(), complete=True, autoscaled=zero)  # type: ignore[union-attr]
            second.stop()  # not there yet: the router follows the first
            async with router_apart([first.url, second.url]) as client:
                assert first.hub is not None and second.hub is not None
                while not first.hub.followers:
                    await trio.sleep(0.05)
                answers: list[httpx.Response] = []

                async def ask() -> None:
                    answers.append(await client.post("/v1/chat/completions", json=CHAT))

                nursery.start_soon(ask)
                while held(first.hub) == 0:
                    await trio.sleep(0.01)
                first.stop()
                second.scope = trio.CancelScope()
                await nursery.start(serve_plane, second)  # the new leader, on its port
                while not second.hub.followers:
                    await trio.sleep(0.01)
                with trio.fail_after(10):  # not the load interval's 60 s
                    while held(second.hub) == 0:
                        await trio.sleep(0.01)
                assert held(second.hub) == 1 and answers == []
                second.hub.publish({"chat": (engine,)}, frozenset(), complete=True, autoscaled=zero)
                while not answers:
                    await trio.sleep(0.05)
                assert answers[0].status_code == 200
                assert answers[0].json()["system_fingerprint"] == f"mock:{engine.port}"
            nursery.cancel_scope.cancel()


# -- route feed versions across releases -----------------------------------------------------


async def test_a_router_of_protocol_1_follows_a_hub_of_this_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A router apart of the previous release says hello in protocol 1 alone, and reads
    tables with no epoch: it follows an epoch-stamped table and reports on it."""
    caplog.set_level(logging.INFO, logger="llmgw.routes")
    leader = Plane(RouteHub(epoch=7))
    endpoint = Endpoint("127.0.0.1", 9001)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_plane, leader)
            assert leader.hub is not None
            leader.hub.publish({"chat": (endpoint,)}, frozenset(), complete=True)
            headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
            async with trio_websocket.open_websocket_url(
                f"ws://127.0.0.1:{leader.port}/v1/routes",
                extra_headers=headers,
                max_message_size=MAX_FRAME_BYTES,
            ) as ws:
                await ws.send_message('{"type":"hello","protocol":1,"router":"old"}')
                frame = await ws.get_message()
                assert isinstance(frame, str)
                sent = json.loads(frame)
                # What the old router reads: the same table, and a key it does not know.
                assert sent["type"] == "routes" and sent["table"]["epoch"] == 7
                (placed,) = sent["table"]["models"]["chat"]
                assert (placed["host"], placed["port"]) == ("127.0.0.1", 9001)
                version = sent["table"]["version"]
                await ws.send_message(json.dumps({"type": "in_flight", "version": version}))
                while not (leader.hub.followers and leader.hub.caught_up(version)):
                    await leader.hub.wait_reported()
            nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.routes"]
    assert "router old (router) follows the route table (route feed protocol 1)" in lines
    assert (
        "router old (router) speaks route feed protocol 1: it does not refuse the tables of a "
        "control plane that no longer leads; upgrade it"
    ) in lines


async def old_control_port(
    tables: list[dict[str, object]], hellos: list[object], *, task_status: trio.TaskStatus[int]
) -> None:
    """A control port of route feed protocol 1: a hello of any other protocol is refused
    (its words), its tables carry no epoch; `hellos` gets each hello it read."""

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        hello = json.loads(await ws.get_message())
        hellos.append(hello)
        if hello.get("protocol") != 1:
            reason = f"route feed protocol {hello.get('protocol')} is not supported"
            await ws.aclose(code=1008, reason=reason)
            return
        for table in tables:
            await ws.send_message(json.dumps({"type": "routes", "table": table}))
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
        task_status.started(server.port)


async def test_a_router_of_this_release_follows_a_control_plane_of_protocol_1() -> None:
    hellos: list[object] = []
    with trio.fail_after(30):
        async with engines(1) as (engine,), trio.open_nursery() as nursery:
            table = {
                "version": 1,
                "models": {"chat": [{"host": engine.host, "port": engine.port}]},
                "complete": True,
            }
            port = await nursery.start(old_control_port, [table], hellos)
            async with router_apart([f"http://127.0.0.1:{port}"]) as client:
                await until_served_by(client, engine)
            nursery.cancel_scope.cancel()
    assert hellos[0] == {
        "type": "hello",
        "protocol": OLDEST_PROTOCOL,
        "router": hellos[0]["router"],  # type: ignore[index]
        "newest": PROTOCOL,
    }


def test_a_hello_names_the_protocols_and_the_hub_follows_in_the_newest_both_speak() -> None:
    assert decode_up('{"type":"hello","protocol":1,"router":"old"}') == Hello(1, "old")
    assert spoken(Hello(1, "old")) == 1
    assert spoken(Hello(OLDEST_PROTOCOL, "new", PROTOCOL)) == PROTOCOL == EPOCH_PROTOCOL
    assert spoken(Hello(1, "newer", PROTOCOL + 3)) == PROTOCOL
    frame = encode(Hello(OLDEST_PROTOCOL, "new", PROTOCOL))
    assert json.loads(frame) == {"type": "hello", "protocol": 1, "router": "new", "newest": 2}


async def test_a_hub_stamps_every_table_with_its_epoch() -> None:
    hub = RouteHub(epoch=4)
    assert hub.table.epoch == 4
    endpoint = Endpoint("127.0.0.1", 9001)
    version = hub.publish({"chat": (endpoint,)}, frozenset(), complete=True)
    assert hub.table.epoch == 4 and hub.table.version == version
    assert decode_table(encode(Routes(hub.table))).epoch == 4
    # A new leadership on the same hub: the same table goes out again, stamped anew.
    hub.epoch = 6
    assert hub.publish({"chat": (endpoint,)}, frozenset(), complete=True) == version + 1
    assert hub.table.epoch == 6
    assert RouteHub().table.epoch == 0  # a single control plane: never fenced


# -- the rules alone --------------------------------------------------------------------------


def _targets(*ports: int) -> list[Target]:
    return [feed_target(f"https://cp{i}.example:{port}") for i, port in enumerate(ports)]


def marked(low: float, high: float) -> float:
    """A jitter that says which range it was asked for."""
    return {SWITCH_JITTER_S: 0.3, (0.5, 1.0): 1.0}[(low, high)]


def test_a_standby_naming_a_known_leader_sends_the_router_there_at_once_and_once() -> None:
    dialing = Dialing(_targets(8081, 8082, 8083), marked)
    named = FeedEnd(False, "it does not lead", standby=True, leader="wss://CP2.example:8083")
    assert dialing.after(named, 0.0) == (0.0, "the leader is one of --control")
    assert dialing.at == 2
    # The one named also stands by, naming another: a jitter first (no loop of dials).
    named = FeedEnd(False, "it does not lead", standby=True, leader="wss://cp0.example:8081")
    assert dialing.after(named, 0.0) == (0.3, "the leader is one of --control")
    assert dialing.at == 0


def test_a_standby_naming_no_leader_or_a_stranger_and_a_stale_epoch_move_to_the_next() -> None:
    dialing = Dialing(_targets(8081, 8082), marked)
    none = FeedEnd(False, "it does not lead", standby=True)
    assert dialing.after(none, 0.0) == (0.3, "looking for the leader") and dialing.at == 1
    stranger = FeedEnd(False, "x", standby=True, leader="wss://evil.example:8081")
    assert dialing.after(stranger, 0.0) == (
        0.3, "that leader is none of --control: not followed"
    )  # fmt: skip
    assert dialing.at == 0
    stale = FeedEnd(True, "stale epoch", stale=True)
    assert dialing.after(stale, 0.0) == (0.3, "looking for the leader") and dialing.at == 1


def test_a_leaders_feed_that_ends_starts_a_failover_window_then_the_backoff() -> None:
    dialing = Dialing(_targets(8081, 8082), marked)
    assert dialing.after(FeedEnd(True, "nothing heard"), 100.0) == (0.3, "looking for the leader")
    refused = FeedEnd(False, "connection refused")
    for i in range(6):  # within the window: the next one after the jitter, round the list
        assert dialing.after(refused, 100.0 + i) == (0.3, "looking for the leader")
        assert dialing.at == i % 2
    after = 100.0 + FAILOVER_WINDOW_S
    assert dialing.after(refused, after) == (BACKOFF_BASE_S * 2, "backing off")
    assert dialing.after(refused, after) == (BACKOFF_BASE_S * 4, "backing off")


def test_one_control_plane_is_dialed_again_as_before() -> None:
    dialing = Dialing(_targets(8081), marked)
    assert dialing.after(FeedEnd(False, "refused"), 0.0) == (BACKOFF_BASE_S * 2, "backing off")
    assert dialing.at == 0
    assert dialing.after(FeedEnd(True, "closed"), 1.0) == (0.3, "looking for the leader")
    assert dialing.at == 0


def test_a_leader_is_known_by_its_host_and_port_alone() -> None:
    targets = [feed_target("https://cp1.example:8081"), feed_target("http://[::1]:8082")]
    assert known_leader("wss://cp1.example:8081", targets) == 0
    assert known_leader("ws://CP1.Example:8081/anything", targets) == 0  # dialed as ours
    assert known_leader("ws://[::1]:8082", targets) == 1
    assert known_leader("wss://cp1.example:8082", targets) is None
    assert known_leader("wss://cp1.example", targets) is None  # 443
    assert known_leader("wss://cp1.example:99999", targets) is None
    assert known_leader("wss://:8081", targets) is None


def test_control_urls_are_given_apart_or_comma_separated() -> None:
    one = feed_targets("https://cp1:8081")
    assert one == [Target("cp1", 8081, "/v1/routes", True)]
    many = feed_targets(["https://cp1:8081, https://cp2:8081", "https://cp3:8081,"])
    assert [t.host for t in many] == ["cp1", "cp2", "cp3"]
    with pytest.raises(ValueError, match="names cp1:8081 twice"):
        feed_targets(["https://cp1:8081", "wss://CP1:8081/v1/routes"])
    with pytest.raises(ValueError, match="--control URL is required"):
        feed_targets(" , ")
    with pytest.raises(ValueError, match="must be the control plane's https:// URL"):
        feed_targets("https://cp1:8081,ftp://cp2")


def test_the_router_command_takes_several_control_urls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[server]\nlisten = "127.0.0.1:1"\n')
    monkeypatch.setenv("LLMGW_ROUTER_TOKEN", TOKEN)
    given: list[object] = []

    def run_router_apart(*args: object) -> int:
        given.append(args[1])
        return 0

    monkeypatch.setattr(wiring, "run_router_apart", run_router_apart)
    argv = ["router", "--config", str(path), "--control", "https://cp1:8081,https://cp2:8081"]
    assert run_cli([*argv, "--control", "https://cp3:8081"]) == 0
    both = "https://cp1:8081,https://cp2:8081,https://cp3:8081"
    assert feed_targets(given[0]) == feed_targets(both)  # type: ignore[arg-type]
    assert run_cli([*argv, "--control", "https://cp1:8081"]) == 2
    assert "--control names cp1:8081 twice" in capsys.readouterr().err


async def test_a_request_held_while_no_report_waits_is_reported_at_the_next_wait(
    tmp_path: Path,
) -> None:
    """Held between two load reports (the feed sending one, or between control planes):
    the next wait for a held request returns at once, not a load interval later."""
    with trio.fail_after(20):
        async with router_and_engine(tmp_path) as (running, _, _):
            router = running.router
            router.served.load_report()
            base = f"http://127.0.0.1:{running.port}"
            auth = {"authorization": f"Bearer {KEY}"}
            async with (
                httpx.AsyncClient(base_url=base, headers=auth, timeout=20) as client,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(partial(client.post, "/v1/chat/completions", json=CHAT))
                while router.served.meters["chat"].held == 0:
                    await trio.sleep(0.01)
                with trio.fail_after(1):
                    await router.served.wait_load_wanted()
                assert router.served.load_report()["chat"].held == 1
                with trio.move_on_after(0.3) as waited:  # reported: nothing new to say
                    await router.served.wait_load_wanted()
                assert waited.cancelled_caught
                nursery.cancel_scope.cancel()
