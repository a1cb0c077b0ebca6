"""The admin API's token: config rules, every route in process over real sockets, the CLI
as a real process, and one real fleet."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw_core.config import Config, parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_http.server import HTTPServer, ServerLimits
from llmgw_server.control.explanation import Explanation
from llmgw_server.control.reconciler import DrainRefused, Reconciler, Stuck
from llmgw_server.control_shell.admin import AdminAPI
from llmgw_server.route_feed.hub import RouteHub

TOKEN = "adm-secret-token"
DIGEST = "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest()


def config(admin: dict[str, Any] | None, control_listen: str = "127.0.0.1:0", **env: str) -> Config:
    data: dict[str, Any] = {
        "server": {"listen": "127.0.0.1:0", "control_listen": control_listen},
        "models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}],
    }
    if admin is not None:
        data["admin"] = admin
    return parse_config(data, "s.toml", environ=env)


def test_without_an_admin_section_only_a_loopback_control_port_is_open() -> None:
    for address in ("127.0.0.1:8081", "[::1]:8081", "localhost:8081", "127.0.0.2:1"):
        admin = config(None, address).admin
        assert (admin.declared, admin.open_status, admin.open_writes) == (False, True, True)
    for address in ("0.0.0.0:8081", "10.0.0.5:8081", "[::]:8081", "ctl.example:8081"):
        admin = config(None, address).admin
        assert (admin.declared, admin.open_status, admin.open_writes) == (False, False, False)
        assert admin.token_digest is None


def test_admin_section_token_from_a_digest_or_the_environment() -> None:
    admin = config({"token_digest": DIGEST}).admin
    assert admin.token_digest == DIGEST[7:] and not admin.open_status and not admin.open_writes
    admin = config({"token_env": "ADM", "open_status": True}, ADM=TOKEN + "\n").admin
    assert admin.token_digest == DIGEST[7:] and admin.open_status and not admin.open_writes
    assert TOKEN not in repr(admin)
    # An empty [admin] closes everything, even on loopback.
    admin = config({}).admin
    assert admin.declared and admin.token_digest is None
    assert not admin.open_status and not admin.open_writes


@pytest.mark.parametrize(
    ("admin", "env", "expected"),
    [
        ({"token_env": "NOPE"}, {}, "s.toml: admin.token_env: the environment variable NOPE is not set"),
        ({"token_env": "E"}, {"E": ""}, "s.toml: admin.token_env: the environment variable E is empty"),
        ({"token_digest": DIGEST, "token_env": "E"}, {"E": "x"}, "s.toml: admin.token_env: give token_digest or token_env, not both"),
        ({"token_digest": TOKEN}, {}, "s.toml: admin.token_digest: must be 'sha256:' and 64 lowercase hex digits"),
        ({"open_status": "yes"}, {}, "s.toml: admin.open_status: must be true or false, not a string"),
        ({"open_stauts": True}, {}, "s.toml: admin.open_stauts: is not a known key (did you mean 'open_status'?)"),
        ({"token": TOKEN}, {}, "s.toml: admin.token: is not a known key"),
    ],
)  # fmt: skip
def test_admin_config_errors_name_the_key_path(
    admin: dict[str, Any], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        config(admin, **env)
    assert expected in str(caught.value)


# --- the admin API in process, over real sockets ------------------------------------------


class Plane:
    """What AdminAPI reads of the control plane: a real reconciler, recorded actions."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reconciler = Reconciler(config.control, config.catalog, now=0.0, instance="t")
        self.output_tails: dict[tuple[str, str, int], tuple[str, ...]] = {}
        self.actions: list[tuple[str, str, bool]] = []
        self.routes = RouteHub()  # its route feed: the tenants' shared limits for status

    def now(self) -> float:
        return trio.current_time()

    def held(self) -> dict[str, int]:
        return {}

    def cordon(self, node: str, on: bool) -> None:
        self._act("cordon", node, on)

    def drain_node(self, node: str, on: bool, *, force: bool = False) -> None:
        if node == "full" and on and not force:
            why = Explanation("m", "0 of 1 nodes fit: 1 draining (full)", (), {})
            raise DrainRefused(node, [Stuck("m-t-1", "m", why)])
        self._act("force-drain" if force else "drain", node, on)

    def _act(self, what: str, node: str, on: bool) -> None:
        if node == "ghost":
            raise KeyError(node)
        self.actions.append((what, node, on))


@asynccontextmanager
async def admin_server(config: Config) -> AsyncIterator[tuple[str, Plane]]:
    plane = Plane(config)
    server = HTTPServer(AdminAPI(plane).handle, ServerLimits())  # type: ignore[arg-type]  # a fake ControlPlane
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, listeners)
        yield f"http://127.0.0.1:{port}", plane
        nursery.cancel_scope.cancel()


async def call(url: str, method: str, path: str, token: str | None = None) -> tuple[int, Any]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient() as client:
        response = await client.request(method, url + path, headers=headers)
    return response.status_code, response.json()


READS = [("GET", "/v1/admin/status"), ("GET", "/v1/admin/explain/m")]
WRITES = [
    ("POST", f"/v1/admin/nodes/n1/{action}")
    for action in ("cordon", "uncordon", "drain", "undrain")
]
# What each route answers once it is let through: explain has no managed model here.
PASSED = {"/v1/admin/status": 200, "/v1/admin/explain/m": 404}


def passed(path: str) -> int:
    return PASSED.get(path, 200)


async def test_a_token_is_required_for_status_and_actions() -> None:
    with trio.fail_after(20):
        async with admin_server(config({"token_digest": DIGEST})) as (url, plane):
            for method, path in READS + WRITES:
                before = list(plane.actions)
                for token in (None, "wrong", DIGEST, DIGEST[7:], TOKEN + "x"):
                    status, body = await call(url, method, path, token)
                    assert status == 401, (method, path, token)
                    assert body["error"]["code"] == "invalid_admin_token"
                    assert body["error"]["type"] == "authentication_error"
                    assert body["error"]["message"]
                assert plane.actions == before
                status, _ = await call(url, method, path, TOKEN)
                assert status == passed(path), (method, path)
            assert plane.actions == [
                ("cordon", "n1", True),
                ("cordon", "n1", False),
                ("drain", "n1", True),
                ("drain", "n1", False),
            ]
            assert await call(url, "POST", "/v1/admin/nodes/ghost/drain", TOKEN) == (
                404,
                {
                    "error": {
                        "message": "no node 'ghost'",
                        "type": "not_found_error",
                        "code": "not_found",
                    }
                },
            )
            # Unknown routes are behind the token too: nothing is learnt without it.
            assert (await call(url, "GET", "/v1/admin/nowhere"))[0] == 401
            assert (await call(url, "GET", "/v1/admin/nowhere", TOKEN))[0] == 404


async def test_open_status_lets_reads_through_but_not_actions() -> None:
    with trio.fail_after(20):
        async with admin_server(config({"token_env": "ADM", "open_status": True}, ADM=TOKEN)) as (
            url,
            plane,
        ):
            for method, path in READS:
                assert (await call(url, method, path))[0] == passed(path)
            for method, path in WRITES:
                status, body = await call(url, method, path)
                assert status == 401 and body["error"]["code"] == "invalid_admin_token"
                assert (await call(url, method, path, TOKEN))[0] == 200
            assert len(plane.actions) == 4


async def test_no_token_configured_refuses_with_403(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "llmgw.admin")
    with trio.fail_after(20):
        async with admin_server(config({"open_status": True})) as (url, plane):
            assert (await call(url, "GET", "/v1/admin/status"))[0] == 200
            for method, path in WRITES:
                status, body = await call(url, method, path, TOKEN)
                assert status == 403, (method, path)
                assert body["error"]["code"] == "admin_closed"
                assert "token_digest or token_env" in body["error"]["message"]
            assert plane.actions == []
    assert "[admin] has no token: admin actions are refused;" in caplog.text


async def test_without_admin_section_loopback_is_open_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "llmgw.admin")
    with trio.fail_after(20):
        async with admin_server(config(None, "127.0.0.1:0")) as (url, plane):
            for method, path in READS + WRITES:
                assert (await call(url, method, path))[0] == passed(path)
            assert len(plane.actions) == 4
    assert "no [admin] section: the admin API on 127.0.0.1:0 (loopback) is open" in caplog.text


async def test_without_admin_section_a_public_control_port_refuses_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "llmgw.admin")
    with trio.fail_after(20):
        # Served on loopback for the test; the config says the port is public.
        async with admin_server(config(None, "0.0.0.0:8081")) as (url, plane):
            for method, path in READS + WRITES:
                status, body = await call(url, method, path, TOKEN)
                assert status == 403 and body["error"]["code"] == "admin_closed"
            assert plane.actions == []
    assert "control_listen 0.0.0.0:8081 is not a loopback address" in caplog.text


# --- the CLI as a real process --------------------------------------------------------------


def cli(
    url: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "LLMGW_ADMIN_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "llmgw_server", "--control", url, *args],
        capture_output=True,
        text=True,
        timeout=20,
        env={**environ, **(env or {})},
    )


async def test_cli_takes_the_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("nope\n")
    empty_file = tmp_path / "empty"
    empty_file.write_text("\n")

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return cli(url, *args, env=env)

    with trio.fail_after(60):
        async with admin_server(config({"token_digest": DIGEST})) as (url, plane):
            unauthorized = await trio.to_thread.run_sync(run, "status")
            assert unauthorized.returncode == 1
            assert "a valid admin token is required" in unauthorized.stderr
            assert "LLMGW_ADMIN_TOKEN or --token-file" in unauthorized.stderr

            status = await trio.to_thread.run_sync(
                lambda: run("status", env={"LLMGW_ADMIN_TOKEN": TOKEN})
            )
            assert status.returncode == 0, status.stderr
            assert "NODE" in status.stdout and "MODEL" in status.stdout

            drain = await trio.to_thread.run_sync(
                run, "--token-file", str(token_file), "drain", "n1"
            )
            assert drain.returncode == 0, drain.stderr
            # Nothing runs on n1 here: the drain is over as soon as it began.
            assert drain.stdout.strip() == "n1: drained, no replica left on it"
            # The file wins over the environment when both are given.
            cordon = await trio.to_thread.run_sync(
                lambda: run(
                    "--token-file", str(token_file), "cordon", "n1",
                    env={"LLMGW_ADMIN_TOKEN": "nope"},
                )
            )  # fmt: skip
            assert cordon.returncode == 0, cordon.stderr
            assert plane.actions == [("drain", "n1", True), ("cordon", "n1", True)]

            refused = await trio.to_thread.run_sync(
                run, "--token-file", str(wrong_file), "uncordon", "n1"
            )
            assert refused.returncode == 1 and "the token given was refused" in refused.stderr
            no_token = await trio.to_thread.run_sync(run, "undrain", "n1")
            assert no_token.returncode == 1 and "admin token" in no_token.stderr
            assert len(plane.actions) == 2

            missing = await trio.to_thread.run_sync(
                run, "--token-file", str(tmp_path / "absent"), "status"
            )
            assert missing.returncode == 2 and "cannot read the token file" in missing.stderr
            empty = await trio.to_thread.run_sync(run, "--token-file", str(empty_file), "status")
            assert empty.returncode == 2 and "is empty" in empty.stderr


# --- a real fleet: the server process reads [admin] ------------------------------------------


def test_a_real_server_requires_the_token_for_cordon(fleet: Any) -> None:
    from fleet import wait_until

    fleet.server(
        '\n[[models]]\nname = "m"\n[models.profile]\nengine = "vllm"\nmodel = "org/m"\n'
        'gpu_model = "B300"\n',  # placeable nowhere: no engine starts
        control=f'[admin]\ntoken_digest = "{DIGEST}"\nopen_status = true\n',
    )
    fleet.agent("gpu-1", "node-2xl4.toml")
    wait_until(  # status is open: no token needed to watch
        lambda: any(n["name"] == "gpu-1" for n in fleet.status()["nodes"]),
        what="the agent to register",
    )
    # Trust the fleet's CA where its control port speaks TLS.
    certs = getattr(fleet, "certs", None)
    tls = {"SSL_CERT_FILE": str(certs / "ca.crt")} if certs else {}
    refused = cli(fleet.control, "cordon", "gpu-1", env=tls)
    assert refused.returncode == 1 and "admin token" in refused.stderr
    assert not fleet.node("gpu-1")["cordoned"]
    done = cli(fleet.control, "cordon", "gpu-1", env={**tls, "LLMGW_ADMIN_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    assert fleet.node("gpu-1")["cordoned"]


# --- drain: force, refusal, bad bodies -----------------------------------------------------


async def post(url: str, path: str, body: bytes) -> tuple[int, Any]:
    async with httpx.AsyncClient() as client:
        response = await client.post(url + path, content=body)
    return response.status_code, response.json()


async def test_drain_takes_force_in_its_body_and_explains_a_refusal() -> None:
    with trio.fail_after(20):
        async with admin_server(config(None, "127.0.0.1:0")) as (url, plane):
            status, body = await post(url, "/v1/admin/nodes/full/drain", b"")
            assert status == 409 and body["error"]["code"] == "drain_refused"
            assert body["error"]["message"] == (
                "draining full would take replicas offline: replica m-t-1 of m fits nowhere "
                "else: 0 of 1 nodes fit: 1 draining (full)"
            )
            assert body["error"]["stuck"] == [
                {
                    "replica_id": "m-t-1",
                    "model": "m",
                    "explanation": "0 of 1 nodes fit: 1 draining (full)",
                }
            ]
            assert plane.actions == []
            status, body = await post(url, "/v1/admin/nodes/full/drain", b'{"force": true}')
            assert (status, body) == (200, {"node": "full", "action": "drain", "force": True})
            assert plane.actions == [("force-drain", "full", True)]
            for bad, message in [
                (b"{", "the request body is not valid JSON"),
                (b"[1]", "the request body must be a JSON object"),
                (b'{"force": "yes"}', "'force' must be true or false"),
                (b'{"forse": true}', "drain takes no field 'forse'"),
            ]:
                status, body = await post(url, "/v1/admin/nodes/n1/drain", bad)
                assert status == 400 and body["error"]["message"].startswith(message), bad
            status, body = await post(url, "/v1/admin/nodes/n1/cordon", b'{"force": true}')
            assert status == 400 and body["error"]["message"] == "cordon takes no field 'force'"
            assert plane.actions == [("force-drain", "full", True)]


async def test_cli_drain_refused_then_forced_and_no_wait() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return cli(url, *args)

    with trio.fail_after(60):
        async with admin_server(config(None, "127.0.0.1:0")) as (url, plane):
            refused = await trio.to_thread.run_sync(run, "drain", "full")
            assert refused.returncode == 1 and refused.stdout == ""
            assert "replica m-t-1 of m fits nowhere else: 0 of 1 nodes fit" in refused.stderr
            assert "--force drains anyway" in refused.stderr
            forced = await trio.to_thread.run_sync(run, "drain", "full", "--force", "--no-wait")
            assert forced.returncode == 0, forced.stderr
            assert forced.stdout.startswith("full: draining (")
            assert plane.actions == [("force-drain", "full", True)]
