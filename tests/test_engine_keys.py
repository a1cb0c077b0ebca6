"""Static endpoints that carry an engine key (`endpoints = [{url = ..., key_env = ...}]`
or `key_file`): how the file gives it, and what the router sends with it.

The key goes to that engine alone, as `Authorization: Bearer`, on requests, streams,
health probes and /metrics reads; a client's own key (`Authorization`, `x-api-key`) never
reaches an engine. The engine here is the mock, in process, behind a guard that refuses
every path without the key (401), as llama-server does for /metrics and a proxy in front
of vLLM may do for /health.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from llmgw_core.config import Config, load_config, parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_http.limits import ServerLimits
from llmgw_http.request import Request
from llmgw_http.responder import Responder
from llmgw_http.server import HTTPServer
from llmgw_mock_engine.engine import MockEngine, MockSettings
from llmgw_server.reload import Reloader, ReloadPlan
from llmgw_server.wiring import Running, main

ENGINE_KEY = "sk-engine-0123456789"
CLIENT_KEY = "sk-client-secret-9876"


def models(endpoints: list[object], name: str = "m") -> dict[str, object]:
    return {"models": [{"name": name, "endpoints": endpoints}]}


def config_error(data: dict[str, object], environ: Mapping[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "server.toml", environ={} if environ is None else environ)
    return str(caught.value)


# -- the file's shape -------------------------------------------------------------------------


def test_a_url_and_a_keyed_table_sit_side_by_side(tmp_path: Path) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text(ENGINE_KEY + "\n")  # as `echo KEY > file` writes it
    config = parse_config(
        models(
            [
                "http://10.0.0.1:8000",
                {"url": "http://10.0.0.2:8000", "key_env": "VLLM_KEY"},
                {"url": "http://10.0.0.3:8000", "key_file": str(key_file)},
            ]
        ),
        "server.toml",
        environ={"VLLM_KEY": " sk-from-env "},
    )
    keys = [(e.url, e.api_key) for e in config.catalog.models[0].endpoints]
    assert keys == [
        ("http://10.0.0.1:8000", ""),
        ("http://10.0.0.2:8000", "sk-from-env"),
        ("http://10.0.0.3:8000", ENGINE_KEY),
    ]
    assert ENGINE_KEY not in repr(config) and "sk-from-env" not in repr(config)


def test_a_relative_key_file_is_taken_from_the_config_files_directory(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "vllm.key").write_text(ENGINE_KEY)
    path = tmp_path / "server.toml"
    path.write_text(
        '[[models]]\nname = "m"\n'
        'endpoints = [{ url = "http://127.0.0.1:8000", key_file = "keys/vllm.key" }]\n'
    )
    (endpoint,) = load_config(path).catalog.models[0].endpoints
    assert endpoint.api_key == ENGINE_KEY


@pytest.mark.parametrize(
    ("item", "environ", "expected"),
    [
        (
            {"url": "http://h:1", "key_env": "VLLM_KEY"},
            {},
            "models[0].endpoints[1].key_env: the environment variable VLLM_KEY is not set",
        ),
        (
            {"url": "http://h:1", "key_env": "VLLM_KEY"},
            {"VLLM_KEY": "  \n"},
            "models[0].endpoints[1].key_env: the environment variable VLLM_KEY is empty",
        ),
        (
            {"url": "http://h:1", "key_env": "VLLM_KEY"},
            {"VLLM_KEY": "sk-a\r\nx-injected: 1"},
            "models[0].endpoints[1].key_env: the environment variable VLLM_KEY holds "
            "characters other than visible ASCII",
        ),
        (
            {"url": "http://h:1", "key_file": "/nonexistent/vllm.key"},
            {},
            "models[0].endpoints[1].key_file: '/nonexistent/vllm.key' cannot be read: "
            "No such file or directory",
        ),
        (
            {"url": "http://h:1", "key_env": "A", "key_file": "/k"},
            {"A": "sk"},
            "models[0].endpoints[1].key_file: give key_env or key_file, not both",
        ),
        (
            {"url": "http://h:1", "api_key": "sk-in-the-file"},
            {},
            "models[0].endpoints[1].api_key: is not a known key: an engine key is never "
            "written in the config",
        ),
        (
            {"url": "http://h:1", "key_evn": "VLLM_KEY"},
            {},
            "models[0].endpoints[1].key_evn: is not a known key (did you mean 'key_env'?)",
        ),
        ({"key_env": "A"}, {"A": "sk"}, "models[0].endpoints[1].url: is required"),
        (
            {"url": "https://h:1/v1", "key_env": "A"},
            {"A": "sk"},
            "models[0].endpoints[1].url: 'https://h:1/v1' must start with http://",
        ),
        (
            {"url": "http://h:9/", "key_env": "A"},
            {"A": "sk"},
            "models[0].endpoints[1]: 'http://h:9' is listed twice",
        ),
        (
            7,
            {},
            "models[0].endpoints[1]: must be an engine URL or a table "
            "{url = ..., key_env = ...}, not an integer",
        ),
    ],
)
def test_each_wrong_endpoint_is_named_by_its_key_path(
    item: object, environ: dict[str, str], expected: str
) -> None:
    message = config_error(models(["http://h:9", item]), environ)
    assert expected in message
    assert "sk-a" not in message and "sk-in-the-file" not in message  # no key is ever echoed


@pytest.mark.parametrize("name", ["binary.key", "a-directory", "nul\x00.key"])
def test_an_unreadable_key_file_is_a_config_error(tmp_path: Path, name: str) -> None:
    (tmp_path / "binary.key").write_bytes(b"\xff\xfe not text")
    (tmp_path / "a-directory").mkdir()
    message = config_error(models([{"url": "http://h:1", "key_file": str(tmp_path / name)}]))
    assert "models[0].endpoints[0].key_file:" in message and "cannot be read" in message


def test_the_server_refuses_to_start_without_its_engine_key(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(
        '[server]\nlisten = "127.0.0.1:0"\n[[models]]\nname = "m"\nendpoints = [\n'
        '  { url = "http://127.0.0.1:8000", key_env = "LLMGW_TEST_UNSET_VLLM_KEY" },\n]\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_TEST_UNSET_VLLM_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_server", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 2, done
    assert done.stderr.strip() == (
        f"llmgw-server: config error: {path}: models[0].endpoints[0].key_env: "
        "the environment variable LLMGW_TEST_UNSET_VLLM_KEY is not set"
    )


# -- a reload reads the key again ---------------------------------------------------------


async def test_a_reload_sends_a_rotated_key_and_refuses_a_missing_file(tmp_path: Path) -> None:
    key_file = tmp_path / "vllm.key"
    key_file.write_text("sk-old")
    path = tmp_path / "server.toml"
    path.write_text(
        '[[models]]\nname = "m"\n'
        'endpoints = [{ url = "http://127.0.0.1:8000", key_file = "vllm.key" }]\n'
    )
    applied: list[ReloadPlan] = []

    async def apply(config: Config, plan: ReloadPlan) -> None:
        applied.append(plan)

    reloader = Reloader(load_config(path), apply)
    key_file.write_text("sk-new\n")
    plan = await reloader.reload()
    # A new key is a new engine to the router: its pooled connections are not reused.
    assert [e.api_key for e in plan.models_changed["m"]] == ["sk-new"]
    key_file.unlink()
    with pytest.raises(ConfigError, match=r"models\[0\]\.endpoints\[0\]\.key_file: .*vllm\.key"):
        await reloader.reload()
    assert len(applied) == 1  # the refused file changed nothing
    assert reloader.config.catalog.models[0].endpoints[0].api_key == "sk-new"


# -- what the router sends ------------------------------------------------------------------


@attrs.define
class KeyedEngine:
    """The mock engine behind a guard that wants the engine key on every path; it records
    the headers of everything it was asked."""

    engine: MockEngine
    key: str
    seen: list[tuple[bytes, dict[bytes, bytes]]] = attrs.field(factory=list)
    refused: list[bytes] = attrs.field(factory=list)

    async def handle(self, request: Request, responder: Responder) -> None:
        headers = dict(request.headers)
        self.seen.append((request.path, headers))
        if headers.get(b"authorization") != f"Bearer {self.key}".encode():
            self.refused.append(request.path)
            await responder.whole(401, b'{"error":"Unauthorized"}')
            return
        await self.engine.handle(request, responder)

    def paths(self) -> set[bytes]:
        return {path for path, _ in self.seen}


async def serve_keyed(nursery: trio.Nursery, key: str) -> tuple[KeyedEngine, int]:
    settings = MockSettings(model="m", served_model_names=["m", "open"], api_key=key)
    keyed = KeyedEngine(MockEngine(settings), key)
    server = HTTPServer(keyed.handle, ServerLimits())
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return keyed, listeners[0].socket.getsockname()[1]


async def test_the_engine_key_goes_to_its_engine_and_the_clients_key_never_does() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            keyed, port = await serve_keyed(nursery, ENGINE_KEY)
            url = f"http://127.0.0.1:{port}"
            config = parse_config(
                {
                    "server": {"listen": "127.0.0.1:0", "access_log": False},
                    "router": {
                        "balancing": "cache_aware",
                        "health_interval_s": 0.05,
                        "cache_aware": {"metrics_interval_s": 0.05},
                    },
                    "auth": {"keys": [{"env": "CLIENT_KEY"}]},
                    "models": [
                        {"name": "m", "endpoints": [{"url": url, "key_env": "VLLM_KEY"}]},
                        # The same engine without its key: the guard refuses it (the
                        # guard is what the test above relies on).
                        {"name": "open", "endpoints": [url]},
                    ],
                },
                "server.toml",
                environ={"VLLM_KEY": ENGINE_KEY, "CLIENT_KEY": CLIENT_KEY},
            )
            stop = trio.Event()
            running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
            (replica,) = running.router.served.balancers["m"].replicas
            while replica.engine_load is None:  # a /metrics read came back with a load
                await trio.sleep(0.01)
            client_headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-api-key": CLIENT_KEY}
            chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
            base = f"http://127.0.0.1:{running.port}/v1"
            async with httpx.AsyncClient(headers=client_headers, timeout=10) as client:
                plain = await client.post(f"{base}/chat/completions", json=chat)
                assert plain.status_code == 200, plain.text
                assert plain.json()["choices"][0]["message"]["content"]
                async with client.stream(
                    "POST", f"{base}/chat/completions", json={**chat, "stream": True}
                ) as stream:
                    assert stream.status_code == 200
                    lines = [line async for line in stream.aiter_lines() if line]
                assert lines[-1] == "data: [DONE]" and len(lines) > 2
                assert json.loads(lines[0].removeprefix("data: "))["object"] == (
                    "chat.completion.chunk"
                )
                completion = await client.post(
                    f"{base}/completions", json={"model": "m", "prompt": "once"}
                )
                assert completion.status_code == 200, completion.text
                # The keyless endpoint is refused by the engine: nothing serves "open".
                refused = await client.post(
                    f"{base}/chat/completions", json={**chat, "model": "open"}
                )
                assert refused.status_code in (502, 503), refused.text
            stop.set()
            nursery.cancel_scope.cancel()  # the engine serves until cancelled
    asked = keyed.paths()
    assert {b"/health", b"/metrics", b"/v1/chat/completions", b"/v1/completions"} <= asked
    keyed_requests = [h for _, h in keyed.seen if h.get(b"authorization")]
    assert keyed_requests and all(
        h[b"authorization"] == f"Bearer {ENGINE_KEY}".encode() for h in keyed_requests
    )
    for _, headers in keyed.seen:
        assert b"x-api-key" not in headers and b"api-key" not in headers
        assert not any(CLIENT_KEY.encode() in value for value in headers.values())
    # Every refusal was the keyless endpoint's: its probes (health, load, its model's
    # card), and nothing of the keyed one's.
    assert set(keyed.refused) <= {b"/health", b"/metrics", b"/v1/models", b"/v1/chat/completions"}
    assert b"/health" in keyed.refused
    assert len(keyed.refused) == sum(1 for _, h in keyed.seen if b"authorization" not in h)
