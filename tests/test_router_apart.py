"""A router apart (`llmgw-server router`): a config with no models, readiness that waits
for the control plane's first complete table, and the shipped systemd unit.

The end-to-end test runs the router with the command line of
conf/systemd/llmgw-router.service (paths and the control plane's URL swapped for the
test's), started before its control plane exists.
"""

from __future__ import annotations

import secrets
import shlex
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio

from fleet import Fleet, wait_until
from llmgw_core.autoscaling import RouterLoad
from llmgw_core.catalog import Endpoint
from llmgw_core.certs import init_ca
from llmgw_core.config import digest_of, parse_config
from llmgw_core.dial import Target
from llmgw_core.tomlshape import ConfigError
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits
from llmgw_http.tls_admission import OTHERS, ROUTERS
from llmgw_server.__main__ import run_cli
from llmgw_server.route_feed.follower import Follower
from llmgw_server.route_feed.hub import RouteHub, serve_websocket
from llmgw_server.route_feed.messages import RouteTable
from llmgw_server.route_feed.remote import client_context, feed_target, follow_forever, follow_once
from llmgw_server.router.front import Router
from procs import Proc, free_port
from test_fleet_e2e import CHAT, model

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "conf" / "systemd" / "llmgw-router.service"
SERVER_UNIT = REPO / "conf" / "systemd" / "llmgw-server.service"
NO_MODEL = "no model is declared: add at least one [[models]] table"


# -- a router's config may declare no model -------------------------------------------


def test_a_router_config_needs_only_a_server_table() -> None:
    data: dict[str, object] = {"server": {"listen": "0.0.0.0:8080"}}
    config = parse_config(data, "router.toml", models_required=False)
    assert config.catalog.models == () and not config.runs_control_plane
    assert config.models_required is False
    # The daemon itself still wants a model, with the same words as before.
    with pytest.raises(ConfigError, match=r"no model is declared: add at least one \[\[models\]\]"):
        parse_config(data, "server.toml")
    # Profiles (a copy of the control plane's file) need no [agents]: a router apart runs
    # no control plane.
    data["models"] = [{"name": "chat", "profile": {"engine": "vllm", "model": "org/chat"}}]
    assert parse_config(data, "router.toml", models_required=False).agents.ca is None
    with pytest.raises(ConfigError, match=r"agents\.ca: is required"):
        parse_config(data, "server.toml")


def test_a_router_key_may_name_models_its_control_plane_places() -> None:
    data: dict[str, object] = {
        "auth": {"keys": [{"digest": "sha256:" + digest_of("k"), "models": ["chat"]}]},
    }
    config = parse_config(data, "router.toml", models_required=False)
    assert config.auth.keys == {digest_of("k"): frozenset({"chat"})}
    data["models"] = [{"name": "static", "endpoints": ["http://127.0.0.1:9"]}]
    with pytest.raises(ConfigError, match="'chat' is not a model of this config"):
        parse_config(data, "server.toml")


def test_only_the_router_command_takes_a_config_without_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "router.toml"
    path.write_text('[server]\nlisten = "127.0.0.1:1"\n')
    assert run_cli(["check-config", str(path)]) == 2
    assert NO_MODEL in capsys.readouterr().err
    assert run_cli(["--config", str(path)]) == 2
    assert NO_MODEL in capsys.readouterr().err
    # The router reads the file, then stops at what it lacks next: the token.
    monkeypatch.delenv("LLMGW_ROUTER_TOKEN", raising=False)
    argv = ["router", "--config", str(path), "--control", "https://cp:8081"]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert "config error" not in err and "a router token is required" in err


# -- readiness waits for a complete table ----------------------------------------------


async def test_the_follower_says_when_a_complete_table_is_applied() -> None:
    router = Router(parse_config({}, "router.toml", models_required=False))
    follower = Follower(router.served, "test")
    a = Endpoint("127.0.0.1", 9001)
    follower.apply(RouteTable(1, {"chat": (a,)}, frozenset(), complete=False))
    assert not follower.complete.is_set()  # a control plane that just started
    assert [r.endpoint for r in router.served.balancers["chat"].replicas] == [a]
    follower.apply(RouteTable(2, {"chat": (a,)}, frozenset(), complete=True))
    assert follower.complete.is_set()
    with trio.fail_after(1):
        await follower.complete.wait()


# -- following a control port, in one process (route_feed.remote) -------------------------

ROUTER_TOKEN, ADMIN_TOKEN = "router-" + secrets.token_hex(8), "admin-" + secrets.token_hex(8)
PLACED = Endpoint("127.0.0.1", 9001)


@attrs.define
class Routed:
    """A router's side as the follower sees it: the endpoints it was given."""

    endpoints: dict[str, tuple[Endpoint, ...]] = attrs.field(factory=dict)

    def static_models(self) -> frozenset[str]:
        return frozenset()

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints[model] = tuple(endpoints)

    def forget_model(self, model: str) -> None:
        self.endpoints.pop(model, None)

    def set_draining(self, draining: frozenset[Endpoint], *, skip: frozenset[str]) -> None:
        pass

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        pass

    def in_flight(self, endpoints: frozenset[Endpoint]) -> dict[str, int]:
        return {}

    def set_autoscaled(self, models: frozenset[str]) -> None:
        pass

    def load_report(self) -> Mapping[str, RouterLoad]:
        return {}

    async def wait_load_wanted(self) -> None:
        await trio.sleep_forever()


@asynccontextmanager
async def control_port(
    certs: Path, hub: RouteHub, servers: list[HTTPServer] | None = None
) -> AsyncIterator[Target]:
    """The route feed of a control port (TLS, the certificate of `certs`, the router and
    admin tokens above), on a free loopback port; its server appended to `servers`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs / "server.crt", certs / "server.key")

    async def upgrade(request: Request, raw: trio.abc.Stream) -> None:
        router, admin = digest_of(ROUTER_TOKEN), digest_of(ADMIN_TOKEN)
        await serve_websocket(hub, request, raw, router_digest=router, admin_digest=admin, peer="t")

    async def nothing(request: Request, responder: Responder) -> None:
        raise AssertionError("only websockets here")

    http = HTTPServer(nothing, ServerLimits(), upgrade=upgrade, ssl_context=context)
    if servers is not None:
        servers.append(http)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(http.serve, listeners)
        yield feed_target(f"https://127.0.0.1:{port}")
        nursery.cancel_scope.cancel()


async def test_a_router_apart_follows_a_control_port_over_tls_with_the_router_token(
    tmp_path: Path,
) -> None:
    init_ca(tmp_path / "ca")
    ca = tmp_path / "ca" / "ca.crt"
    hub, routed = RouteHub(), Routed()
    hub.publish({"chat": (PLACED,)}, frozenset(), complete=True)
    follower = Follower(routed, "apart")
    with trio.fail_after(20):
        async with control_port(tmp_path / "ca", hub) as where, trio.open_nursery() as nursery:
            nursery.start_soon(follow_once, follower, where, ROUTER_TOKEN, client_context(ca), ca)
            while not (hub.followers and hub.caught_up(1)):
                await hub.wait_reported()
            assert routed.endpoints == {"chat": (PLACED,)}
            nursery.cancel_scope.cancel()


async def test_a_router_apart_says_why_it_cannot_follow(tmp_path: Path) -> None:
    init_ca(tmp_path / "ca")
    init_ca(tmp_path / "other")
    ca, other = tmp_path / "ca" / "ca.crt", tmp_path / "other" / "ca.crt"
    follower = Follower(Routed(), "apart")
    with trio.fail_after(30):
        async with control_port(tmp_path / "ca", RouteHub()) as where:
            # The admin token may not follow: the control plane's reason, word for word.
            outcome = await follow_once(follower, where, ADMIN_TOKEN, client_context(ca), ca)
            assert outcome == (
                False,
                "refused by the control plane: HTTP 403: the admin token may not follow "
                "routes: give the router token",
            )
            # Another fleet's CA: which certificate, and which setting to fix.
            followed, why = await follow_once(
                follower, where, ROUTER_TOKEN, client_context(other), other
            )
            assert not followed
            assert f"the control plane's certificate at {where.where} is not trusted" in why
            assert f"--ca ({other}) must be the fleet CA" in why
        # Nobody listens there any more.
        followed, why = await follow_once(follower, where, ROUTER_TOKEN, client_context(ca), ca)
        assert not followed and why.startswith(f"connection refused by {where.where}")


async def test_a_router_apart_dials_in_the_routers_lane_and_still_needs_its_token(
    tmp_path: Path,
) -> None:
    """Issue 34, finding 2: routers apart offered no ALPN and queued with anonymous peers
    in the operators' lane. Their lane of their own orders their admission only: a
    router that offers its ALPN name with a wrong token is refused as before."""
    init_ca(tmp_path / "ca")
    ca = tmp_path / "ca" / "ca.crt"
    hub, routed = RouteHub(), Routed()
    hub.publish({"chat": (PLACED,)}, frozenset(), complete=True)
    servers: list[HTTPServer] = []
    with trio.fail_after(20):
        async with control_port(tmp_path / "ca", hub, servers) as where:
            lanes = servers[0].tls_admission.core.lanes
            outcome = await follow_once(
                Follower(Routed(), "apart"), where, "router-not-it", client_context(ca), ca
            )
            assert outcome == (
                False, "refused by the control plane: HTTP 401: the router token is not valid"
            )
            assert (lanes[ROUTERS].begun, lanes[OTHERS].begun) == (1, 0)
            async with trio.open_nursery() as nursery:
                follower = Follower(routed, "apart")
                nursery.start_soon(
                    follow_once, follower, where, ROUTER_TOKEN, client_context(ca), ca
                )
                while not (hub.followers and hub.caught_up(1)):
                    await hub.wait_reported()
                nursery.cancel_scope.cancel()
            assert routed.endpoints == {"chat": (PLACED,)}
            assert (lanes[ROUTERS].begun, lanes[OTHERS].begun) == (2, 0)


async def test_a_router_apart_with_no_control_plane_serves_its_last_table_and_dials_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    init_ca(tmp_path / "ca")
    ca = tmp_path / "ca" / "ca.crt"
    follower = Follower(Routed(), "apart")
    follower.apply(RouteTable(3, {"chat": (PLACED,)}, frozenset(), complete=True))
    async with control_port(tmp_path / "ca", RouteHub()) as where:
        pass  # a port nobody listens on any more
    with trio.move_on_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_forever, follower, where, ROUTER_TOKEN, None, ca)
            while "dialing again in" not in caplog.text:
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    line = next(r.getMessage() for r in caplog.records if "dialing again in" in r.getMessage())
    assert line.startswith(f"route feed from {where.where}: connection refused by {where.where}")
    assert "; serving the last route table (1 models); dialing again in " in line


# -- a router apart loads no control plane ----------------------------------------------

# What the `router` command, a worker (`python -m llmgw_server.wiring`) and a server with
# static models alone import before serving; then the control plane's port, which pulls
# in the control plane (the check below sees it: it can fail).
IMPORTS = """
import sys
import llmgw_server.__main__, llmgw_server.route_feed.remote, llmgw_server.wiring
def control():
    return sorted(n for n in sys.modules if n.split(".")[:2] in (
        ["llmgw_server", "control"], ["llmgw_server", "control_shell"]))
print(",".join(control()))
import llmgw_server.control_shell.port
print(",".join(control()))
"""


def test_a_router_apart_a_worker_and_a_static_server_import_no_control_plane_module() -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0] == ""
    assert "llmgw_server.control_shell.controlplane" in out[1].split(",")
    assert "llmgw_server.control.reconciler" in out[1].split(",")


# -- the shipped unit, and a router started by its command line ------------------------


def read_service(path: Path) -> dict[str, list[str]]:
    """The [Service] settings of a unit file; a key given twice keeps both values."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service":
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def exec_start() -> list[str]:
    (line,) = read_service(UNIT)["ExecStart"]
    return shlex.split(line)


def test_the_router_unit_runs_the_router_command_with_flags_it_takes() -> None:
    argv = exec_start()
    assert argv[:2] == ["/opt/llmgw/bin/llmgw-server", "router"]
    given = {arg.split("=", 1)[0] for arg in argv[2:] if arg.startswith("-")}
    assert given == {"--control", "--config", "--ca", "--token-file"}
    helped = subprocess.run(
        [sys.executable, "-m", "llmgw_server", "router", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    offered = {word.strip("[],") for word in helped.split() if word.startswith("-")}
    assert given <= offered, given - offered
    options = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert options["--config"] == "/etc/llmgw/router.toml"
    assert options["--control"].startswith("https://")
    # The token comes from a systemd credential: a root-only file, copied for the service.
    credential, _, source = read_service(UNIT)["LoadCredential"][0].partition(":")
    assert options["--token-file"] == f"%d/{credential}" and source.startswith("/etc/llmgw/")


def test_the_router_unit_is_hardened_as_the_server_unit() -> None:
    router, server = read_service(UNIT), read_service(SERVER_UNIT)
    for key, value in server.items():
        if key not in ("ExecStart", "LimitNOFILE"):
            assert router.get(key) == value, key


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_apart_is_ready_only_once_its_control_plane_sent_a_table(
    fleet: Fleet, workers: int
) -> None:
    token = "router-" + secrets.token_hex(8)
    etc = fleet.procs.tmp / "etc"
    credentials = fleet.procs.tmp / "credentials"
    (etc / "certs").mkdir(parents=True)
    credentials.mkdir()
    (etc / "certs" / "ca.crt").write_bytes((fleet.certs / "ca.crt").read_bytes())
    (credentials / "router-token").write_text(token + "\n")
    port = free_port()
    # Nothing but [server]: every model comes from the control plane.
    (etc / "router.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = {workers}\n'
        "[router]\nhealth_interval_s = 0.5\n"
    )
    argv = [
        arg.replace("/etc/llmgw/", f"{etc}/").replace("%d", str(credentials))
        for arg in exec_start()
    ]
    argv[argv.index("--control") + 1] = fleet.control
    router = Proc([sys.executable, "-m", "llmgw_server", *argv[1:]], port)
    fleet.procs.all.append(router)
    router.wait_http("/healthz")
    wait_until(
        lambda: "connection refused by 127.0.0.1:" in router.output(),
        what="the router to find no control plane",
    )
    # Alive, but it knows no model yet: a load balancer must send it nothing.
    readiness = httpx.get(router.url + "/readyz", timeout=5)
    assert readiness.status_code == 503
    assert readiness.json()["ready"] is False and readiness.json()["models"] == {}

    admin = f'\n[admin]\nrouter_token_digest = "sha256:{digest_of(token)}"\nopen_status = true\n'
    fleet.server(model("chat", replicas=1), control=admin)
    fleet.agent("gpu-1", "node-2xl4.toml")
    router.wait_http("/readyz", timeout=60)
    assert "ready: route table" in router.output()
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    wait_until(
        lambda: [m.id for m in client.models.list()] == ["chat"],
        timeout=60,
        what="the router to serve the placed model",
    )
    answer = client.chat.completions.create(model="chat", messages=CHAT)
    assert answer.choices[0].message.content
    (replica,) = fleet.serving("chat")
    assert answer.system_fingerprint == "mock:" + replica["url"].rsplit(":", 1)[1]

    # SIGHUP reads the file by the router's rule: a static model added, then the file
    # back to no model at all (which the daemon's rule would refuse, keeping "added").
    path = etc / "router.toml"
    bare = path.read_text()
    path.write_text(bare + f'[[models]]\nname = "added"\nendpoints = ["{replica["url"]}"]\n')
    router.signal(signal.SIGHUP)
    wait_until(
        lambda: {m.id for m in client.models.list()} == {"chat", "added"},
        what="the router to serve the added static model",
    )
    path.write_text(bare)
    router.signal(signal.SIGHUP)
    wait_until(
        lambda: [m.id for m in client.models.list()] == ["chat"],
        what="the router to drop the static model",
    )
    assert "reload refused" not in router.output()
    assert router.popen.poll() is None and token not in router.output()
