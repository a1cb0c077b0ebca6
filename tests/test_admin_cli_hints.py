"""The admin CLI's advice when it is pointed at the wrong thing, in process."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import httpx
import pytest

import status_docs
from llmgw_core.certs import init_ca
from llmgw_server import admin_cli


def test_a_certificate_without_the_name_dialed_gets_the_agents_advice_not_the_cas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init_ca(tmp_path, ["other.example"])  # the right CA; a server certificate without 127.0.0.1
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve_one() -> None:
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass  # the client gives up on the certificate

        thread = threading.Thread(target=serve_one, daemon=True)
        thread.start()
        code = admin_cli.run("status", None, f"https://127.0.0.1:{port}", ca=str(tmp_path / "ca.crt"))
        thread.join(10)
    assert code == 1
    err = capsys.readouterr().err
    assert "name mismatch: the control plane's certificate is not valid for the name dialed" in err, err
    assert "(certs init --host)" in err and "is it the fleet's CA?" not in err


@pytest.mark.parametrize(
    "said",
    [
        "llmgw: no such route /v1/admin/status",  # test_request_hints reads the router's
        "no route /v1/admin/status",  # an older router's
    ],
)
def test_the_router_port_answering_no_route_is_named(
    capsys: pytest.CaptureFixture[str], said: str
) -> None:
    request = httpx.Request("GET", "http://127.0.0.1:8080/v1/admin/status")
    routers = httpx.Response(404, json={"error": {"message": said}}, request=request)
    assert admin_cli._failed(routers, None) == 1
    assert capsys.readouterr().err.strip() == (
        f"llmgw-server: {said} (this looks like the router's port: "
        "--control takes the control plane's, [server] control_listen, 8081 by default)"
    )
    # The control port's own 404s are left as they are.
    unknown = httpx.Response(404, json={"error": {"message": "no node 'gpu-9'"}}, request=request)
    assert admin_cli._failed(unknown, None) == 1
    assert capsys.readouterr().err.strip() == "llmgw-server: no node 'gpu-9'"


def _node(name: str) -> dict[str, object]:
    return {
        "name": name, "status": "reachable", "cordoned": False, "draining": False,
        "gpus": [], "fabric": {}, "last_seen_s_ago": 0.5,
    }  # fmt: skip


def test_status_lists_nodes_by_name_not_by_registration() -> None:
    data = status_docs.status([status_docs.node(n) for n in ("sim-node-2", "gpu-10", "sim-node-1", "gpu-9")])
    rows = admin_cli.render_status(data).split("\n\n")[0].splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["gpu-9", "gpu-10", "sim-node-1", "sim-node-2"]


def test_status_json_into_a_pipe_closed_early_ends_quietly(tmp_path: Path) -> None:
    """`status --json | head`: no BrokenPipeError traceback."""
    import json
    import subprocess
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    big = json.dumps({"nodes": [_node(f"n{i}") for i in range(5000)], "replicas": [], "models": []}).encode()

    class Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(big)))
            self.end_headers()
            self.wfile.write(big)

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Status) as http:
        threading.Thread(target=http.serve_forever, daemon=True).start()
        control = f"http://127.0.0.1:{http.server_address[1]}"
        cli = subprocess.Popen(
            [sys.executable, "-m", "llmgw_server", "--control", control, "status", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert cli.stdout is not None and cli.stderr is not None
        assert cli.stdout.read(10) == b'{\n  "nodes'  # what `head` reads, then it goes
        cli.stdout.close()
        err = cli.stderr.read().decode()
        code = cli.wait(20)
        http.shutdown()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 1 and err == ""
