"""A request's typos get a "did you mean", as a config's do (issue 36): a model name close
to one the key may use (never one it may not), and a path close to a served one (most
often a base URL without its /v1). The router's own 404s say that llmgw answered them.

In one process: a router in front of no engine (none of these requests reaches one).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio

from llmgw_core.catalog import Endpoint
from llmgw_core.config import parse_config
from llmgw_http.server import HTTPServer, ServerLimits
from llmgw_server.route_feed.follower import Follower
from llmgw_server.route_feed.messages import RouteTable
from llmgw_server.router.front import Router

KEYS = {"all": "k-all", "static": "k-static"}
NOWHERE = ["http://127.0.0.1:9"]


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@asynccontextmanager
async def front() -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    config = parse_config(
        {
            "router": {"extra_paths": ["/v1/rank"]},
            "auth": {
                "keys": [
                    {"digest": sha(KEYS["all"])},
                    # Not secret-llm, nor m's adapter m-sql.
                    {"digest": sha(KEYS["static"]), "models": ["static-llm", "m"]},
                ]
            },
            "models": [
                {"name": "static-llm", "endpoints": NOWHERE},
                {"name": "secret-llm", "endpoints": NOWHERE},
                {"name": "m", "profile": {"engine": "vllm", "model": "org/m"}},
            ],
            "agents": {"insecure": True},
        },
        "router.toml",
    )
    router = Router(config)
    replica = Endpoint("127.0.0.1", 9)
    Follower(router.served, "test").apply(
        RouteTable(1, {"m": (replica,)}, frozenset(), True, {"m-sql": "m"})
    )
    router.served.adapters["ghost-sql"] = "ghost"  # an adapter whose model is not routed: no name
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        server = HTTPServer(router.handle, ServerLimits(), check_head=router.check_head)
        await nursery.start(server.serve, listeners)
        url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        clients = {
            who: httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"})
            for who, key in KEYS.items()
        }
        try:
            yield clients
        finally:
            for client in clients.values():
                await client.aclose()
            nursery.cancel_scope.cancel()


async def refused(client: httpx.AsyncClient, model: str, status: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    got = await client.post("/v1/chat/completions", json=body)
    assert got.status_code == status, got.text
    message: str = got.json()["error"]["message"]
    return message


async def test_a_mistyped_model_is_told_the_name_it_likely_meant_among_its_keys_models() -> None:
    with trio.fail_after(20):
        async with front() as clients:
            every = clients["all"]
            assert await refused(every, "static-lm", 404) == (
                "the model 'static-lm' does not exist (did you mean 'static-llm'?)"
            )
            # An adapter is a name of its own while its model is routed.
            assert await refused(every, "m-sq", 404) == (
                "the model 'm-sq' does not exist (did you mean 'm-sql'?)"
            )
            assert await refused(every, "ghost-sq", 404) == "the model 'ghost-sq' does not exist"
            assert await refused(every, "zzz", 404) == "the model 'zzz' does not exist"

            # A limited key is refused a name it may not use whether it exists or not,
            # and told only of names it may use.
            static = clients["static"]
            assert await refused(static, "static-lm", 403) == (
                "this API key may not use the model 'static-lm' (did you mean 'static-llm'?)"
            )
            for model, never in (("secret-lm", "secret-llm"), ("m-sq", "m-sql")):
                assert f"{never}'?" not in await refused(static, model, 403)


async def test_a_path_not_served_says_llmgw_answered_and_names_the_path_likely_meant() -> None:
    with trio.fail_after(20):
        async with front() as clients:
            client = clients["all"]
            body = {"model": "static-llm", "messages": []}
            for method, path, meant in (
                ("POST", "/chat/completions", "/v1/chat/completions"),  # base URL without /v1
                # [router] extra_paths too; with /v1 rather than the closer /rerank
                ("POST", "/rank", "/v1/rank"),
                ("GET", "/v1/model", "/v1/models"),
                ("GET", "/models", "/v1/models"),  # llama.cpp's listing: no management path
                ("POST", "/v1/chat/completion", "/v1/chat/completions"),  # a close spelling
                ("POST", "/v1/v1/messages", "/v1/messages"),  # a base URL with /v1 twice
                ("GET", "/v1/admin/status", None),  # the control plane's: nothing like it here
                ("POST", "/nowhere", None),
                ("GET", "/v1/responses/nothing/x", None),  # a stored response's, malformed
            ):
                got = await client.request(method, path, json=body)
                assert got.status_code == 404, (path, got.text)
                said = f"llmgw: no such route {path}"
                if meant is not None:
                    said += f" (did you mean {meant}?)"
                assert got.json() == {
                    "error": {"message": said, "type": "not_found_error", "code": "not_found"}
                }, path
            got = await client.post("/v1/models", json=body)
            assert got.status_code == 405
            assert got.json()["error"]["message"] == "/v1/models takes GET"
