"""Engines' management paths, however spelt, never reach an engine (issue 34, finding 5).

`[router] extra_paths` refused only the exact spelling of a management path:
`/v1/load_lora_adapter/`, `//v1/…`, `/v1/%6Coad_…`, `/V1/…`, `/v1/./…` were accepted and
relayed verbatim (a uvicorn engine decodes `%6C` and runs its load-adapter route), and so
were SGLang's, vLLM's and llama.cpp's management paths missing from the list. A client's
path that is not plain is refused with 400, a management path (case-folded, or under one)
with 403, and the configuration refuses such an extra path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from llmgw_core.api_paths import MANAGEMENT_PATHS, path_problem, valid_extra_path
from llmgw_core.config import parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_http.limits import ServerLimits
from llmgw_http.server import HTTPServer
from llmgw_server.router.routes import Kind, Routes
from llmgw_server.wiring import Running, main
from test_api_surface import CLIENT_KEY, ApiEngine

# The spellings of vLLM's load-adapter route, and management paths of the three
# engines that the list lacked (read from their code: see api_paths.MANAGEMENT_PATHS).
SPELLINGS = [
    "/v1/load_lora_adapter/",
    "//v1/load_lora_adapter",
    "/v1/%6Coad_lora_adapter",
    "/V1/load_lora_adapter",
    "/v1/./load_lora_adapter",
    "/v1/x/../load_lora_adapter",
    "/v1\\load_lora_adapter",
    "/v1/load_lora_adapter/.",
]
OTHER_ENGINES = [
    "/load_lora_adapter",  # SGLang
    "/update_weights_from_disk",
    "/flush_cache",
    "/release_memory_occupation",
    "/init_weights_update_group",
    "/update_weights",  # vLLM
    "/init_weight_transfer_engine",
    "/slots/0",  # llama.cpp: POST /slots/0?action=save&filename= writes a file
    "/SLOTS/0",
    "/models/load",
]
# Paths clients use, relayed or answered here as before.
PLAIN = ["/v1/chat/completions", "/v1/models", "/healthz", "/v1/responses/resp_lg0a1b", "/"]


@pytest.mark.parametrize("path", SPELLINGS + OTHER_ENGINES)
def test_no_spelling_of_a_management_path_is_relayed_or_configurable(path: str) -> None:
    routes = Routes(["/v1/custom"])
    assert routes.kind(path.encode()) in (Kind.NOT_PLAIN, Kind.MANAGEMENT)
    with pytest.raises(ValueError):
        valid_extra_path(path)


def test_paths_clients_use_are_plain_and_kept() -> None:
    routes = Routes(["/v1/custom", "/v1/Custom_Case"])
    for path in PLAIN:
        assert path_problem(path.encode()) is None, path
        assert routes.kind(path.encode()) is not Kind.NOT_PLAIN
    assert routes.kind(b"/v1/custom") is Kind.JSON
    assert routes.kind(b"/v1/Custom_Case") is Kind.JSON
    assert routes.kind(b"/v1/custom/") is Kind.NOT_PLAIN
    assert routes.kind(b"/.well-known/x") is Kind.OTHER  # a dot file, not a dot segment
    assert valid_extra_path("/v1/Custom_Case") == "/v1/Custom_Case"
    assert valid_extra_path("/v2/x.y/z") == "/v2/x.y/z"
    for management in MANAGEMENT_PATHS:  # every one, and under it
        assert routes.kind(management) is Kind.MANAGEMENT
        assert routes.kind(management + b"/0") is Kind.MANAGEMENT
    assert routes.kind(b"/slotsx") is Kind.OTHER


def test_the_config_names_the_extra_path_it_refuses_and_why() -> None:
    models = [{"name": "m", "endpoints": ["http://127.0.0.1:9001"]}]
    for path, why in (
        ("/v1/%6Coad_lora_adapter", "percent-escape"),
        ("//v1/load_lora_adapter", "empty, '.' or '..' segment"),
        ("/v1/load_lora_adapter/", "ends with a slash"),
        ("/V1/load_lora_adapter", "management"),
        ("/slots/0", "management"),
        ("/", "root"),
    ):
        with pytest.raises(ConfigError) as failed:
            parse_config({"router": {"extra_paths": ["/ok", path]}, "models": models}, "x.toml")
        assert "router.extra_paths[1]" in str(failed.value) and why in str(failed.value), path


@asynccontextmanager
async def router_before(engine: ApiEngine) -> AsyncIterator[Running]:
    async with trio.open_nursery() as nursery:
        server = HTTPServer(engine.handle, ServerLimits())
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(server.serve, listeners)
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        config = parse_config(
            {
                "server": {"listen": "127.0.0.1:0"},
                "router": {"health_interval_s": 0.2, "extra_paths": ["/v1/custom"]},
                "auth": {"keys": [{"env": "CLIENT_KEY"}]},
                "models": [{"name": "m", "endpoints": [url]}],
            },
            "server.toml",
            environ={"CLIENT_KEY": CLIENT_KEY},
        )
        stop = trio.Event()
        running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
        while not running.router.served.balancers["m"].healthy_count:
            await trio.sleep(0.01)
        yield running
        stop.set()
        nursery.cancel_scope.cancel()


async def status_of(port: int, target: str) -> int:
    """The router's status for a POST of `target` sent as it is (an HTTP client library
    would tidy the path first)."""
    body = b'{"model": "m", "lora_name": "x", "lora_path": "/tmp/x", "prompt": "x"}'
    head = (
        f"POST {target} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {CLIENT_KEY}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head.encode() + body)
        answer = b""
        while data := await stream.receive_some(65536):
            answer += data
    return int(answer.split(b" ", 2)[1])


async def test_no_spelling_reaches_the_engine_and_plain_paths_still_do() -> None:
    engine = ApiEngine()
    with trio.fail_after(30):
        async with router_before(engine) as running:
            for path in SPELLINGS + OTHER_ENGINES:
                for target in (path, path + "?action=save&filename=x"):
                    assert await status_of(running.port, target) in (400, 403), target
            assert await status_of(running.port, "/tokenize?x=1") == 200  # query apart
            assert await status_of(running.port, "/v1/custom") == 200
            assert await status_of(running.port, "/v1/custom/") == 400
    probes = (b"/health", b"/metrics", b"/v1/models")  # the router's own, of its engine
    assert sorted(r.target for r in engine.seen if r.path not in probes) == [
        b"/tokenize?x=1",
        b"/v1/custom",
    ]


async def test_rewrite_headers_do_not_reach_the_engine() -> None:
    engine = ApiEngine()
    rewrites = {
        "x-original-url": "/v1/load_lora_adapter",
        "X-Rewrite-URL": "/sleep",
        "x-http-method-override": "DELETE",
        "X-Forwarded-Prefix": "/admin",
        "x_original_url": "/collective_rpc",
    }
    with trio.fail_after(30):
        async with router_before(engine) as running:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{running.port}") as client:
                answer = await client.post(
                    "/tokenize",
                    json={"model": "m", "prompt": "x"},
                    headers={"authorization": f"Bearer {CLIENT_KEY}", "x-kept": "1", **rewrites},
                )
            assert answer.status_code == 200
    (relayed,) = engine.requests(b"/tokenize")
    names = {name for name, _ in relayed.headers}
    assert b"x-kept" in names and not names & {n.lower().encode() for n in rewrites}
