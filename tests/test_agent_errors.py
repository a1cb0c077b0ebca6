"""Why an agent cannot connect, in words: each failure in process over real sockets, then
real agents against a real server (wrong CA, a certificate from another CA, a stopped
server), the server's rate-limited log of failed TLS handshakes, and the config error
for a plaintext URL with [tls] left in."""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio_websocket

from fleet import SIM, Fleet, wait_until
from llmgw_agent.config import parse_agent_config
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.dial import ConnectFailed, open_agent_stream
from llmgw_core.tls_config import AgentsTLS, AgentTLS, client_context, server_context
from llmgw_core.tomlshape import ConfigError
from llmgw_http.server import HTTPServer, ReplayStream, Request, Responder, ServerLimits
from procs import Proc, free_port

# --- in process -------------------------------------------------------------------------


# Session, not module: pytest-xdist (make test) may hand a worker another module's tests
# between two of these, and a module fixture would be made again each time.
@pytest.fixture(scope="session")
def cas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two fleets' CAs, each with the control plane's certificate and one node's."""
    found = {}
    for name in ("fleet", "other"):
        directory = tmp_path_factory.mktemp(name)
        init_ca(directory)
        issue_node(directory, "n1")
        found[name] = directory
    return found


def agent_context(ca: Path, node: Path | None) -> ssl.SSLContext:
    if node is None:  # trusts the CA, presents no certificate
        return ssl.create_default_context(cafile=str(ca / "ca.crt"))
    return client_context(
        AgentTLS(ca=ca / "ca.crt", cert=node / "nodes" / "n1.crt", key=node / "nodes" / "n1.key")
    )


async def _not_found(request: Request, responder: Responder) -> None:
    await responder.error(404, "not here")


async def _agent_stream(request: Request, raw: trio.abc.Stream) -> None:
    """Like the control plane: a stream without a client certificate is refused."""
    async with trio.open_nursery() as nursery:
        ws_request = await trio_websocket.wrap_server_stream(nursery, raw)
        assert isinstance(raw, ReplayStream)
        if not raw.peer_certificate():
            await ws_request.reject(
                403, body=b"a client certificate signed by the fleet CA is required"
            )
            return
        ws = await ws_request.accept()
        await ws.aclose()


@asynccontextmanager
async def servers(fleet_ca: Path) -> AsyncIterator[dict[str, int]]:
    """A TLS control port (on every loopback address) and a plaintext one."""
    ports = {}
    tls = server_context(
        AgentsTLS(ca=fleet_ca / "ca.crt", cert=fleet_ca / "server.crt", key=fleet_ca / "server.key")
    )
    async with trio.open_nursery() as nursery:
        for name, context, host in (("tls", tls, "0.0.0.0"), ("plain", None, "127.0.0.1")):
            server = HTTPServer(_not_found, ServerLimits(), upgrade=_agent_stream, ssl_context=context)
            listeners = await trio.open_tcp_listeners(0, host=host)
            ports[name] = listeners[0].socket.getsockname()[1]
            await nursery.start(server.serve, listeners)
        ports["dead"] = free_port()
        yield ports
        nursery.cancel_scope.cancel()


async def failure(url: str, context: ssl.SSLContext | None) -> str:
    said = "connected"
    try:
        async with open_agent_stream(
            url,
            context,
            connect_timeout_s=5,
            disconnect_timeout_s=1,
            max_message_size=1 << 16,
        ):
            pass
    except* ConnectFailed as group:
        said = str(group.exceptions[0])
    return said


CASES = [
    # name, URL (host, port, path), the agent's CA and certificate, what the log line says
    ("ok", "wss://127.0.0.1:{tls}/v1/agent", "fleet", "fleet", "connected"),
    ("wrong CA", "wss://127.0.0.1:{tls}/v1/agent", "other", "fleet",
     "the control plane's certificate at 127.0.0.1:{tls} is not trusted"),
    ("name mismatch", "wss://127.0.0.2:{tls}/v1/agent", "fleet", "fleet",
     "name mismatch: the control plane's certificate is not valid for the name dialed "
     "(IP address mismatch, certificate is not valid for '127.0.0.2'"),
    ("no certificate", "wss://127.0.0.1:{tls}/v1/agent", "fleet", None,
     "refused by the control plane: HTTP 403: a client certificate signed by the fleet CA "
     "is required"),
    ("stopped server", "wss://127.0.0.1:{dead}/v1/agent", "fleet", "fleet",
     "connection refused by 127.0.0.1:{dead}: nothing listens there"),
    ("plaintext server", "wss://127.0.0.1:{plain}/v1/agent", "fleet", "fleet",
     "127.0.0.1:{plain} does not speak TLS"),
    ("plaintext agent", "ws://127.0.0.1:{tls}/v1/agent", None, None,
     "127.0.0.1:{tls} closed the connection without answering the websocket handshake: if "
     "the server runs "
     "TLS ([agents] insecure = false), dial wss:// with [tls]"),
    ("wrong path", "wss://127.0.0.1:{tls}/nowhere", "fleet", None,
     "refused by the control plane: HTTP 403"),
    ("unknown host", "wss://no-such-host.invalid:{tls}/v1/agent", "fleet", "fleet",
     "cannot resolve the control plane's host name (no-such-host.invalid:{tls})"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "url", "ca", "cert", "expected"), CASES, ids=[c[0] for c in CASES])
async def test_each_failure_is_said_in_words(
    cas: dict[str, Path], name: str, url: str, ca: str | None, cert: str | None, expected: str
) -> None:
    with trio.fail_after(20):
        async with servers(cas["fleet"]) as ports:
            context = None if ca is None else agent_context(cas[ca], cas[cert] if cert else None)
            said = await failure(url.format(**ports), context)
    assert said.startswith(expected.format(**ports)), said


async def test_a_certificate_from_another_ca_is_named_on_both_ends(
    cas: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "llmgw_http.server")
    with trio.fail_after(20):
        async with servers(cas["fleet"]) as ports:
            url = f"wss://127.0.0.1:{ports['tls']}/v1/agent"
            context = agent_context(cas["fleet"], cas["other"])
            said = [await failure(url, context) for _ in range(3)]
    # TLS 1.3: the server checks the client's certificate after the client is done, so the
    # agent sees the refusal as an alert or a reset right after its handshake.
    for line in said:
        assert "refused this agent's certificate" in line or (
            "closed the connection right after the TLS handshake: the control plane most "
            "likely refused this agent's certificate" in line
        ), line
    logged = [r.getMessage() for r in caplog.records if "TLS handshake" in r.getMessage()]
    # Three failures from one host for one reason: said once (the rest held back).
    assert len(logged) == 1, logged
    assert logged[0].startswith("TLS handshake with 127.0.0.1:")
    assert logged[0].endswith(
        "failed: the client's certificate is not trusted (certificate signature failure)"
    )
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_plaintext_url_with_tls_left_in_is_one_config_error(tmp_path: Path) -> None:
    base = "name = 'n1'\nserver = 'ws://127.0.0.1:8081/v1/agent'\ninsecure = true\n"
    data = {
        "name": "n1",
        "server": "ws://127.0.0.1:8081/v1/agent",
        "insecure": True,
        "tls": {"ca": "certs/ca.crt", "cert": "n1.crt", "key": "n1.key"},
    }
    with pytest.raises(ConfigError) as caught:
        parse_agent_config(data, str(tmp_path / "agent.toml"))
    assert str(caught.value) == (
        f"{tmp_path / 'agent.toml'}: tls: is for a wss:// server, but "
        "'ws://127.0.0.1:8081/v1/agent' is plaintext (insecure = true): remove [tls], or use "
        "wss:// and drop insecure"
    )
    # The daemon says it in one line and exits 2, before any dial.
    path = tmp_path / "agent.toml"
    path.write_text(base + "[tls]\nca = 'ca.crt'\n")
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"llmgw-agent: config error: {path}: tls: is for a wss:// server, but "
        "'ws://127.0.0.1:8081/v1/agent' is plaintext (insecure = true): remove [tls], or use "
        "wss:// and drop insecure"
    ]
    # Without [tls] the same file is fine.
    parse_agent_config({k: v for k, v in data.items() if k != "tls"}, str(path))


# --- real processes ----------------------------------------------------------------------


def agent(fleet: Fleet, name: str, port: int, ca: Path, cert_dir: Path) -> Proc:
    """An agent whose [tls] trusts `ca` and presents a certificate from `cert_dir`'s CA."""
    crt, key, _ = issue_node(cert_dir, name)
    path = fleet.procs.tmp / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\nserver = "wss://127.0.0.1:{port}/v1/agent"\n'
        f'state_dir = "{fleet.procs.tmp / name}"\ninventory_file = "{SIM / "node-2xl4.toml"}"\n'
        f'bind_host = "127.0.0.1"\n[tls]\nca = "{ca}"\ncert = "{crt}"\nkey = "{key}"\n'
        "[reconnect]\nbase_s = 0.1\ncap_s = 0.5\n"
    )
    proc = Proc([sys.executable, "-m", "llmgw_agent", "--config", str(path)], 0)
    fleet.procs.all.append(proc)
    return proc


MODEL = (
    '\n[[models]]\nname = "chat"\nreplicas = 1\n[models.profile]\nengine = "vllm"\n'
    'model = "org/chat"\ngpu_memory_gib = 20\n'
)


def test_real_agents_say_why_they_cannot_connect(fleet: Fleet, tmp_path: Path) -> None:
    other = tmp_path / "other-ca"
    init_ca(other)
    server = fleet.server(MODEL)
    wrong_ca = agent(fleet, "gpu-1", fleet.control_port, other / "ca.crt", fleet.certs)
    foreign = agent(fleet, "gpu-2", fleet.control_port, fleet.certs / "ca.crt", other)
    stopped = agent(fleet, "gpu-3", free_port(), fleet.certs / "ca.crt", fleet.certs)
    wait_until(
        lambda: "is not trusted (certificate signature failure): [tls] ca "
        f"({other / 'ca.crt'}) must be the fleet CA that signed the server's certificate"
        in wrong_ca.output(),
        what="the wrong CA in the agent's log",
    )
    wait_until(
        lambda: "most likely refused this agent's certificate" in foreign.output()
        or "refused this agent's certificate during the TLS handshake" in foreign.output(),
        what="the foreign certificate in the agent's log",
    )
    wait_until(
        lambda: "connection refused by 127.0.0.1:" in stopped.output(),
        what="connection refused in the agent's log",
    )
    for proc in (wrong_ca, foreign, stopped):
        assert "HandshakeError" not in proc.output() and "ConnectionTimeout" not in proc.output()
        assert "Traceback" not in proc.output()
    # The server names the peer and what failed, once per host and reason a minute,
    # though the agents dial again every half second.
    wait_until(
        lambda: "failed: the client's certificate is not trusted" in server.output(),
        what="the server's log line",
    )
    wait_until(
        lambda: foreign.output().count("cannot connect to the control plane") >= 3,
        what="the agent to dial three times",
    )
    lines = [line for line in server.output().splitlines() if "TLS handshake with" in line]
    assert any("TLS handshake with 127.0.0.1:" in line for line in lines)
    assert len([line for line in lines if "not trusted" in line]) == 1, lines
    assert fleet.status()["nodes"] == []
