"""The control port refuses what a web page could make a browser send it (issue 17,
finding 4): a Host not its own (DNS rebinding) with 421, a state-changing request from
another site with 403, one without a JSON content type with 415. The decision alone,
then the port in process over real sockets, plain HTTP and TLS."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from llmgw_core.certs import init_ca
from llmgw_core.config import ListenAddress, ServerSection, parse_config
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.tomlshape import ConfigError
from llmgw_core.wire import PROTOCOL, Register, Welcome, decode_down, encode
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits
from llmgw_server.control_shell.cross_site import (
    ControlNames,
    certificate_names,
    control_names,
    refusal,
)
from llmgw_server.wiring import Running, main

# --- the decision ---------------------------------------------------------------------------

JSON = (b"content-type", b"application/json")


def names(
    listen: str = "127.0.0.1",
    scheme: str = "https",
    cert: tuple[str, ...] = ("cp.example.net", "10.0.0.1"),
    hosts: tuple[str, ...] = (),
) -> ControlNames:
    server = ServerSection(control_listen=ListenAddress(listen, 8081), control_hosts=hosts)
    return control_names(server, scheme, cert)


def status(
    method: bytes,
    headers: list[tuple[bytes, bytes]],
    at: ControlNames | None = None,
    path: bytes = b"/v1/admin/nodes/n1/drain",
    *,
    websocket: bool = False,
) -> int | None:
    refused = refusal(method, path, headers, at or names(), websocket=websocket)
    return None if refused is None else refused.status


@pytest.mark.parametrize(
    "host",
    [
        b"127.0.0.1:8081", b"127.0.0.1", b"localhost:8081", b"LocalHost", b"[::1]:8081",
        b"[::1]", b"cp.example.net", b"CP.Example.NET.:8081", b"10.0.0.1:8081", b"127.0.0.1:1",
    ],
)  # fmt: skip
def test_the_port_answers_to_its_names(host: bytes) -> None:
    assert status(b"GET", [(b"host", host)]) is None
    assert status(b"POST", [(b"host", host), JSON]) is None


@pytest.mark.parametrize(
    "headers",
    [
        [(b"host", b"rebind.attacker.example")],
        [(b"host", b"rebind.attacker.example:8081")],
        [(b"host", b"127.0.0.1.attacker.example")],
        [(b"host", b"evil@127.0.0.1")],
        [(b"host", b"127.0.0.1:80x")],
        [(b"host", b"[::1")],
        [(b"host", b"::1")],
        [(b"host", b"")],
        [],
        [(b"host", b"127.0.0.1"), (b"host", b"rebind.attacker.example")],
    ],
)
def test_any_other_host_is_misdirected_whatever_the_method(
    headers: list[tuple[bytes, bytes]],
) -> None:
    for method in (b"GET", b"HEAD", b"POST"):
        for path in (b"/v1/admin/status", b"/v1/admin/reload", b"/ui", b"/metrics", b"/x"):
            assert status(method, [*headers, JSON], path=path) == 421


def test_which_names_a_port_has() -> None:
    # Loopback names only on a loopback listener, or one on every address.
    public = names("10.0.0.5", cert=())
    assert status(b"GET", [(b"host", b"10.0.0.5:8081")], public) is None
    assert status(b"GET", [(b"host", b"localhost:8081")], public) == 421
    assert status(b"GET", [(b"host", b"127.0.0.1")], public) == 421
    for wildcard in ("0.0.0.0", "::"):
        assert status(b"GET", [(b"host", b"127.0.0.1")], names(wildcard, cert=())) is None
        assert status(b"GET", [(b"host", b"0.0.0.0")], names(wildcard, cert=())) == 421
    assert status(b"GET", [(b"host", b"ctl.internal")], names("ctl.internal", cert=())) is None
    # control_hosts: a proxy's name, in Host and in Origin (under the proxy's scheme and port).
    proxied = names("10.0.0.5", hosts=("gw.example.com",))
    assert status(b"GET", [(b"host", b"gw.example.com")], proxied) is None
    origin = (b"origin", b"https://gw.example.com:8443")
    assert status(b"POST", [(b"host", b"10.0.0.5:8081"), origin, JSON], proxied) is None
    # A certificate's wildcard covers one label.
    wild = names(cert=("*.fleet.example",))
    assert status(b"GET", [(b"host", b"cp.fleet.example")], wild) is None
    assert status(b"GET", [(b"host", b"fleet.example")], wild) == 421
    assert status(b"GET", [(b"host", b"a.b.fleet.example")], wild) == 421


def test_certificate_names_are_its_dns_and_ip_names(tmp_path: Path) -> None:
    init_ca(tmp_path, ("cp.example.net", "10.0.0.1", "::1"))
    assert sorted(certificate_names((tmp_path / "server.crt").read_bytes())) == [
        "10.0.0.1", "::1", "cp.example.net",
    ]  # fmt: skip
    assert certificate_names((tmp_path / "ca.crt").read_bytes()) == []  # it has no SAN


HOST = (b"host", b"127.0.0.1:8081")


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        # A cross-site fetch(..., {mode: "no-cors", method: "POST", body: '{"force": true}'}).
        ([(b"origin", b"http://evil.example"), (b"content-type", b"text/plain;charset=UTF-8")], 403),
        ([(b"origin", b"http://evil.example"), JSON], 403),
        ([(b"origin", b"null"), JSON], 403),
        ([(b"origin", b"http://127.0.0.1:8081"), JSON], 403),  # another scheme
        ([(b"origin", b"https://127.0.0.1:3000"), JSON], 403),  # another port
        ([(b"origin", b"https://localhost:8081"), JSON], 403),  # another name
        ([(b"origin", b"https://127.0.0.1:8081"), (b"origin", b"http://evil.example"), JSON], 403),
        ([(b"sec-fetch-site", b"cross-site"), JSON], 403),
        ([(b"sec-fetch-site", b"same-site"), JSON], 403),
        ([(b"sec-fetch-site", b"Cross-Site"), JSON], 403),
        ([(b"content-type", b"text/plain")], 415),
        ([(b"content-type", b"application/x-www-form-urlencoded")], 415),
        ([(b"content-type", b"multipart/form-data; boundary=x")], 415),
        ([(b"content-type", b"application/jsonx")], 415),
        ([], 415),
        ([JSON, (b"content-type", b"text/plain")], 415),
        ([JSON], None),
        ([(b"content-type", b"Application/JSON; charset=utf-8")], None),
        ([(b"origin", b"https://127.0.0.1:8081"), (b"sec-fetch-site", b"same-origin"), JSON], None),
        ([(b"sec-fetch-site", b"none"), JSON], None),
    ],
)  # fmt: skip
def test_state_changing_requests_are_refused_from_another_site(
    headers: list[tuple[bytes, bytes]], expected: int | None
) -> None:
    for method in (b"POST", b"PUT", b"DELETE", b"PATCH"):
        assert status(method, [HOST, *headers]) == expected, method


def test_reads_are_not_refused_for_their_origin() -> None:
    # A page elsewhere cannot read the answer (no CORS); only the Host matters for reads.
    for headers in ([(b"origin", b"http://evil.example")], [(b"sec-fetch-site", b"cross-site")]):
        assert status(b"GET", [HOST, *headers], path=b"/v1/admin/status") is None


def test_the_agents_and_routers_websockets_take_any_host_but_no_page() -> None:
    evil = (b"host", b"rebind.attacker.example")
    for path in (b"/v1/agent", b"/v1/routes"):
        assert status(b"GET", [evil], path=path, websocket=True) is None
        assert status(b"GET", [HOST], path=path, websocket=True) is None
        page = (b"origin", b"http://evil.example")
        assert status(b"GET", [HOST, page], path=path, websocket=True) == 403
    assert status(b"GET", [evil], path=b"/elsewhere", websocket=True) == 421
    assert status(b"GET", [evil], path=b"/v1/agent") == 421  # not an upgrade


def test_the_refusals_say_why_in_json() -> None:
    refused = refusal(b"GET", b"/ui", [(b"host", b"rebind.attacker.example\x1b")], names())
    assert refused is not None
    error = json.loads(refused.body())["error"]
    assert error["code"] == "misdirected_request"
    assert "Host rebind.attacker.example\\x1b is not a name of this control plane" in (
        error["message"]
    )
    refused = refusal(b"POST", b"/v1/admin/reload", [HOST], names())
    assert refused is not None and refused.code == "json_required"
    assert "-H 'Content-Type: application/json'" in refused.message


# --- the port, in process over real sockets ---------------------------------------------------

TOKEN = "adm-secret-token"
DIGEST = "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest()


def server_config(**extra: Any) -> dict[str, Any]:
    return {
        "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
        "agents": {"insecure": True},
        "models": [{"name": "m", "profile": {"engine": "vllm", "model": "org/m"}}],
        **extra,
    }


async def raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """One request as a browser or an attacker writes it: every header as given."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        head = head.replace("\n", "\r\n") + f"Content-Length: {len(body)}\r\n"
        await stream.send_all(head.encode() + b"Connection: close\r\n\r\n" + body)
        answer = b""
        while chunk := await stream.receive_some():
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2] or b"{}")


async def register(ws: trio_websocket.WebSocketConnection, node: str) -> None:
    """A node over the agents' websocket (it sends no Origin)."""
    gpus = (Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),)
    await ws.send_message(encode(Register(PROTOCOL, "t", Inventory(name=node, gpus=gpus))))
    assert isinstance(decode_down(await ws.get_message()), Welcome)


def node(port: int, name: str) -> dict[str, Any]:
    status = httpx.get(f"http://127.0.0.1:{port}/v1/admin/status", timeout=5).json()
    found: dict[str, Any] = next(n for n in status["nodes"] if n["name"] == name)
    return found


async def test_a_cross_site_page_cannot_drain_the_demos_open_admin_api() -> None:
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(server_config(), "<test>"), stop=stop, **kw)
            )
            port = running.control_port
            assert port is not None
            agent = f"ws://127.0.0.1:{port}/v1/agent"
            async with trio_websocket.open_websocket_url(agent) as ws:
                await register(ws, "sim-node-1")
                drain = "POST /v1/admin/nodes/sim-node-1/drain HTTP/1.1\n"
                cordon = "POST /v1/admin/nodes/sim-node-1/cordon HTTP/1.1\n"
                here = f"Host: 127.0.0.1:{port}\n"
                force = b'{"force": true}'
                # What Chromium sends for fetch(..., {mode: "no-cors", method: "POST", body}).
                page = (
                    "Origin: http://evil.example\nSec-Fetch-Site: cross-site\nSec-Fetch-Mode: no-cors\n"
                    "Content-Type: text/plain;charset=UTF-8\n"
                )
                code, body = await raw(port, drain + here + page, force)
                assert code == 403 and body["error"]["code"] == "cross_site", body
                # Each sign alone is enough.
                code, body = await raw(port, drain + here + "Origin: http://evil.example\n", force)
                assert code == 403, body
                json_type = "Content-Type: application/json\n"
                code, body = await raw(port, cordon + here + "Sec-Fetch-Site: cross-site\n" + json_type)
                assert code == 403, body
                code, body = await raw(port, drain + here + "Content-Type: text/plain\n", force)
                assert code == 415 and body["error"]["code"] == "json_required", body
                code, body = await raw(port, cordon + here)
                assert code == 415, body
                shown = await trio.to_thread.run_sync(node, port, "sim-node-1")
                assert not shown["draining"] and not shown["cordoned"]

                # DNS rebinding: a page on the attacker's name, now resolving to 127.0.0.1.
                rebound = "Host: rebind.attacker.example:" + str(port) + "\n"
                for head in ("GET /v1/admin/status HTTP/1.1\n", "GET /ui HTTP/1.1\n",
                             "GET /metrics HTTP/1.1\n"):  # fmt: skip
                    code, body = await raw(port, head + rebound)
                    assert code == 421 and body["error"]["code"] == "misdirected_request", body
                code, body = await raw(port, "POST /v1/admin/reload HTTP/1.1\n" + rebound + json_type)
                assert code == 421, body
                code, body = await raw(port, drain + rebound + json_type, force)
                assert code == 421, body

                # A page may not open the agents' websocket (nor any other, rebound).
                with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                    async with trio_websocket.open_websocket_url(
                        agent, extra_headers=[(b"origin", b"http://evil.example")]
                    ):
                        pass
                assert rejected.value.status_code == 403
                upgrade = (
                    "Upgrade: websocket\nConnection: Upgrade\nSec-WebSocket-Version: 13\n"
                    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\n"
                )
                code, _ = await raw(port, "GET /elsewhere HTTP/1.1\n" + rebound + upgrade)
                assert code == 421

                # The port's own page, and clients that are no browser, still act.
                own = f"Origin: http://127.0.0.1:{port}\nSec-Fetch-Site: same-origin\n"
                code, body = await raw(port, cordon + here + own + json_type)
                assert (code, body["node"]) == (200, "sim-node-1"), body
                cli = await trio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [sys.executable, "-m", "llmgw_server", "--control",
                         f"http://127.0.0.1:{port}", "uncordon", "sim-node-1"],
                        capture_output=True, text=True, timeout=20,
                        env={k: v for k, v in os.environ.items() if k != "LLMGW_ADMIN_TOKEN"},
                    )
                )  # fmt: skip
                assert cli.returncode == 0, cli.stderr
                async with httpx.AsyncClient() as client:
                    drained = await client.post(
                        f"http://localhost:{port}/v1/admin/nodes/sim-node-1/drain",
                        json={"force": True},
                    )
                assert drained.status_code == 200, drained.text
                shown = await trio.to_thread.run_sync(node, port, "sim-node-1")
                assert shown["draining"] and not shown["cordoned"]
            stop.set()


async def test_a_rebound_host_is_refused_with_the_token_too_over_tls(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    init_ca(certs, ("cp.example.net", "127.0.0.1"))
    config = server_config(
        agents={k: str(certs / f) for k, f in
                (("ca", "ca.crt"), ("cert", "server.crt"), ("key", "server.key"))},
        admin={"token_digest": DIGEST},
        server={"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0",
                "control_hosts": ["gw.example.com"]},
    )  # fmt: skip
    trust = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(config, "<test>"), stop=stop, **kw)
            )
            url = f"https://127.0.0.1:{running.control_port}"
            async with httpx.AsyncClient(base_url=url, verify=trust, timeout=10) as client:

                async def call(method: str, path: str, host: str, token: str | None) -> int:
                    headers = {"host": host, "content-type": "application/json"}
                    if token:
                        headers["authorization"] = f"Bearer {token}"
                    return (await client.request(method, path, headers=headers)).status_code

                for token in (None, TOKEN):
                    for method, path in (("GET", "/v1/admin/status"), ("POST", "/v1/admin/reload"),
                                         ("GET", "/ui"), ("GET", "/metrics")):  # fmt: skip
                        assert await call(method, path, "rebind.attacker.example", token) == 421
                # The certificate's names, control_listen's and control_hosts' are its own.
                for host in ("cp.example.net", "127.0.0.1", "localhost", "gw.example.com"):
                    assert await call("GET", "/v1/admin/status", host, TOKEN) == 200, host
                    assert await call("GET", "/v1/admin/status", host, None) == 401, host
                cordon = await client.post(
                    "/v1/admin/nodes/ghost/cordon",
                    headers={"authorization": f"Bearer {TOKEN}",
                             "origin": "https://evil.example"},
                    json={},
                )  # fmt: skip
                assert cordon.status_code == 403, cordon.text
                cordon = await client.post(
                    "/v1/admin/nodes/ghost/cordon",
                    headers={"authorization": f"Bearer {TOKEN}", "origin": url},
                    json={},
                )
                assert cordon.status_code == 404, cordon.text  # let through: no such node
            stop.set()


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["https://gw.example.com"], "server.control_hosts[0]: 'https://gw.example.com' must be a host name or an IP address, without a scheme or a port"),
        (["ok.example", "gw.example.com:443"], "server.control_hosts[1]: 'gw.example.com:443' must be"),
        ([""], "server.control_hosts[0]: '' must be"),
        ("gw.example.com", "server.control_hosts: must be an array of strings"),
    ],
)  # fmt: skip
def test_control_hosts_are_names_or_addresses(hosts: object, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(server_config(server={"control_hosts": hosts}), "s.toml")
    assert expected in str(caught.value)
    parsed = parse_config(
        server_config(server={"control_hosts": ["GW.Example.com.", "[::1]", "10.0.0.1"]}), "s"
    )
    assert parsed.server.control_hosts == ("gw.example.com", "::1", "10.0.0.1")
    assert parse_config(server_config(), "s").server.control_hosts == ()


# --- a real browser: headless Chromium -----------------------------------------------------

# What a page elsewhere runs: it cannot read the answer, but a POST sent is a POST served.
ATTACK = """<!doctype html><title>waiting</title><script>
fetch("http://127.0.0.1:%d/v1/admin/nodes/sim-node-1/drain",
      {method: "POST", mode: "no-cors", body: '{"force": true}'})
  .then(() => { document.title = "sent"; }, (e) => { document.title = "failed: " + e; });
</script>"""
FETCH = """const done = arguments[arguments.length - 1];
fetch(arguments[0], {method: "POST", headers: {"content-type": "application/json"}, body: "{}"})
  .then((r) => done(r.status), (e) => done("failed: " + e));"""


def _chromium() -> webdriver.Chrome:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver: `make browser`"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                # DNS rebinding, without DNS: the attacker's name now leads to this machine.
                "--host-resolver-rules=MAP rebind.attacker.example 127.0.0.1"):  # fmt: skip
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def _until(condition: Callable[[], bool], what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def test_in_chromium_a_page_elsewhere_cannot_drain_and_a_rebound_name_is_refused() -> None:
    stop = trio.Event()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                lambda **kw: main(parse_config(server_config(), "<test>"), stop=stop, **kw)
            )
            port = running.control_port
            assert port is not None

            async def attacker(request: Request, responder: Responder) -> None:
                page = (ATTACK % port).encode()
                await responder.whole(200, page, [(b"content-type", b"text/html")])

            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            evil = listeners[0].socket.getsockname()[1]
            await nursery.start(HTTPServer(attacker, ServerLimits()).serve, listeners)

            def browse() -> None:
                browser = _chromium()
                try:
                    # A page on another site (localhost is another site than 127.0.0.1).
                    browser.get(f"http://localhost:{evil}/")
                    _until(lambda: browser.title != "waiting", "the page's fetch")
                    assert browser.title == "sent", browser.title
                    shown = node(port, "sim-node-1")
                    assert not shown["draining"] and not shown["cordoned"], shown
                    # A page on the attacker's name, now resolving here: its own origin,
                    # so it could read the answers; it gets none.
                    browser.get(f"http://rebind.attacker.example:{port}/v1/admin/status")
                    assert "misdirected_request" in browser.page_source
                    assert "sim-node-1" not in browser.page_source
                    reload = browser.execute_async_script(FETCH, "/v1/admin/reload")
                    assert reload == 421, reload
                    # The port's own page may act (the page itself only reads).
                    browser.get(f"http://127.0.0.1:{port}/ui")
                    cordon = browser.execute_async_script(
                        FETCH, "/v1/admin/nodes/sim-node-1/cordon"
                    )
                    assert cordon == 200, cordon
                finally:
                    browser.quit()

            agent = f"ws://127.0.0.1:{port}/v1/agent"
            async with trio_websocket.open_websocket_url(agent) as ws:
                await register(ws, "sim-node-1")
                await trio.to_thread.run_sync(browse)
                shown = await trio.to_thread.run_sync(node, port, "sim-node-1")
                assert not shown["draining"] and shown["cordoned"], shown
            stop.set()
            nursery.cancel_scope.cancel()
