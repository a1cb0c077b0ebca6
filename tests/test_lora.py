"""LoRA adapters as models (issue 21): a profile's `[[models.profile.lora]]` starts with its
engine, and each adapter is a model name of its own, served by its base model's replicas,
listed in /v1/models with its parent and held to per-key limits.

In one process: a router that follows a table with an adapter, in front of a mock engine
serving it (the router's behaviour). As processes: the control plane places a profile
with an adapter on an agent, which launches the mock engine through the vLLM adapter's
command line, and clients (the openai client, never retrying) call it through both of
the server's workers.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import httpx2
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam

from fleet import Fleet, wait_until
from llmgw_core.catalog import Endpoint
from llmgw_core.config import parse_config
from llmgw_http.server import HTTPServer, ServerLimits
from llmgw_mock_engine.engine import MockEngine, MockSettings
from llmgw_server.route_feed.follower import Follower
from llmgw_server.route_feed.messages import RouteTable
from llmgw_server.router.front import Router
from llmgw_server.router.health import probe_forever
from test_workers import only_worker_accepts, served_by

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello adapter"}]
KEYS = {"all": "k-all", "base": "k-base", "sql": "k-sql"}  # what each may use: all, m, m-sql


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def auth_keys() -> list[dict[str, Any]]:
    return [
        {"digest": sha(KEYS["all"])},
        {"digest": sha(KEYS["base"]), "models": ["m"]},
        {"digest": sha(KEYS["sql"]), "models": ["m-sql"]},
    ]


async def test_the_router_serves_an_adapter_from_its_models_replicas_within_key_limits() -> None:
    engine = MockEngine(
        MockSettings(model="org/m", served_model_names=["m"], tokens=5, lora_modules={"m-sql": "/l/sql"})
    )
    profile = {"engine": "vllm", "model": "org/m", "lora": [{"name": "m-sql", "path": "/l/sql"}]}
    config = parse_config(
        {
            "router": {"health_interval_s": 0.05, "balancing": "cache_aware"},
            "auth": {"keys": auth_keys()},
            "models": [{"name": "m", "profile": profile}, {"name": "other", "endpoints": ["http://127.0.0.1:9"]}],
            "agents": {"insecure": True},
        },
        "router.toml",
    )
    router = Router(config)
    with trio.fail_after(20):
        # The client outlives the nursery: its probe task ends before the client closes.
        async with httpx.AsyncClient() as probes, trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(HTTPServer(engine.handle, ServerLimits()).serve, listeners)
            replica = Endpoint("127.0.0.1", listeners[0].socket.getsockname()[1])
            # The route table as the control plane sends it: the adapter and its model.
            table = RouteTable(1, {"m": (replica,)}, frozenset(), True, {"m-sql": "m"})
            Follower(router.served, "test").apply(table)
            front = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(HTTPServer(router.handle, ServerLimits(), check_head=router.check_head).serve, front)
            await nursery.start(probe_forever, router, probes)
            while "m" not in router.served.cards:  # the engine's card, read once it is healthy
                await trio.sleep(0.01)
            url = f"http://127.0.0.1:{front[0].socket.getsockname()[1]}/v1"
            clients = {
                who: httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"})
                for who, key in KEYS.items()
            }
            try:
                await _check_router(clients)
                # Counted under the adapter's name, as its tokens are.
                assert router.metrics.requests[("m-sql", 200)] >= 1
            finally:
                for client in clients.values():
                    await client.aclose()
            nursery.cancel_scope.cancel()


async def _check_router(clients: dict[str, httpx.AsyncClient]) -> None:
    answers: dict[str, str] = {}
    for model in ("m", "m-sql"):
        got = await clients["all"].post("/chat/completions", json={"model": model, "messages": CHAT})
        assert got.status_code == 200, got.text
        assert got.json()["model"] == model  # the engine answers under the adapter's name
        answers[model] = got.json()["choices"][0]["message"]["content"]
    assert answers["m"] != answers["m-sql"]
    listing = (await clients["all"].get("/models")).json()["data"]
    by_id = {card["id"]: card for card in listing}
    assert set(by_id) == {"m", "m-sql"}  # `other` has no healthy replica
    assert by_id["m-sql"] == {
        "id": "m-sql", "object": "model", "created": 0, "owned_by": "llmgw-mock",
        "root": "m-sql", "parent": "m",
    }  # fmt: skip
    # A key limited to the base may not use its adapter, and the other way round.
    for who, allowed, refused in (("base", "m", "m-sql"), ("sql", "m-sql", "m")):
        client = clients[who]
        ok = await client.post("/chat/completions", json={"model": allowed, "messages": CHAT})
        assert ok.status_code == 200 and ok.json()["model"] == allowed
        no = await client.post("/chat/completions", json={"model": refused, "messages": CHAT})
        assert no.status_code == 403, no.text
        assert no.json()["error"]["code"] == "model_not_allowed"
        assert [c["id"] for c in (await client.get("/models")).json()["data"]] == [allowed]
    gone = await clients["all"].post("/chat/completions", json={"model": "m-chat", "messages": CHAT})
    assert gone.status_code == 404


# -- the fleet: placed, launched, routed -------------------------------------------------


def models(adapter_dir: str) -> str:
    auth = "".join(
        f'[[auth.keys]]\ndigest = "{k["digest"]}"\n' + (f"models = {k['models']}\n" if "models" in k else "")
        for k in auth_keys()
    ).replace("'", '"')
    return (
        '\n[[models]]\nname = "m"\n[models.profile]\nengine = "vllm"\nmodel = "org/m"\n'
        f'gpu_memory_gib = 20\nmax_lora_rank = 8\n[[models.profile.lora]]\nname = "m-sql"\npath = "{adapter_dir}"\n'
        f"\n[auth]\n{auth}"
    )


def client(fleet: Fleet, who: str) -> openai.OpenAI:
    # No keep-alive: each request is a new connection, which a worker not paused accepts.
    limits = httpx2.Limits(max_keepalive_connections=0)
    return openai.OpenAI(
        base_url=fleet.url + "/v1",
        api_key=KEYS[who],
        max_retries=0,
        timeout=20,
        http_client=httpx2.Client(limits=limits, timeout=20),  # openai is typed against its fork
    )


def test_a_placed_adapter_is_launched_routed_listed_and_limited_through_every_worker(fleet: Fleet) -> None:
    adapter_dir = fleet.procs.tmp / "adapters" / "sql"
    adapter_dir.mkdir(parents=True)  # the agent checks an adapter's path exists on its node
    fleet.server(models(str(adapter_dir)), workers=2)
    agent = fleet.agent("gpu-1", "node-2xl4.toml")
    wait_until(lambda: fleet.serving("m"), what="a ready replica")
    line = next(x for x in agent.output().splitlines() if "starting " in x and " serve org/m " in x)
    assert f"--enable-lora --lora-modules m-sql={adapter_dir} --max-lora-rank 8" in line
    everyone, base_only, sql_only = (client(fleet, who) for who in ("all", "base", "sql"))

    def listed() -> dict[str, object]:
        return {m.id: (m.model_extra or {}).get("parent") for m in everyone.models.list()}

    def answer(c: openai.OpenAI, model: str) -> tuple[int, str]:
        raw = c.chat.completions.with_raw_response.create(model=model, messages=CHAT)
        completion = raw.parse()
        assert completion.model == model
        return served_by(raw.headers)[0], completion.choices[0].message.content or ""

    # Each worker in turn (the other paused) answers the adapter under its name,
    # otherwise than the base, and holds each key to what it may use.
    texts: dict[str, set[str]] = {"m": set(), "m-sql": set()}
    assert fleet.server_proc is not None
    for index in (0, 1):
        with only_worker_accepts(fleet.server_proc, index):
            # Listed once this worker applied the table and probed the replica.
            wait_until(lambda: listed() == {"m": None, "m-sql": "m"}, what=f"worker {index}'s list")
            for who, c, model in (("all", everyone, "m"), ("all", everyone, "m-sql"),
                                  ("base", base_only, "m"), ("sql", sql_only, "m-sql")):  # fmt: skip
                worker, text = answer(c, model)
                assert worker == index, who
                texts[model].add(text)
            with pytest.raises(openai.PermissionDeniedError):
                base_only.chat.completions.create(model="m-sql", messages=CHAT)
            with pytest.raises(openai.PermissionDeniedError):
                sql_only.chat.completions.create(model="m", messages=CHAT)
            assert [m.id for m in sql_only.models.list()] == ["m-sql"]
            assert [m.id for m in base_only.models.list()] == ["m"]
    assert len(texts["m"]) == len(texts["m-sql"]) == 1 and texts["m"] != texts["m-sql"]
    streamed = everyone.chat.completions.create(model="m-sql", messages=CHAT, stream=True)
    chunks = [c for c in streamed if c.choices]
    assert {c.model for c in chunks} == {"m-sql"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == next(iter(texts["m-sql"]))
