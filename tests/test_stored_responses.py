"""Stored responses reach the replica that stored them (issue 21): a `previous_response_id`
follow-up, `GET`/`DELETE /v1/responses/{id}` and `POST .../cancel`, through any router,
under round robin, with the real `openai` client; a response whose replica is gone gets a
clear 404, never another replica's confusion.

The engines are in process and keep responses in their own memory as vLLM does: by the
request's `request_id`, and a follow-up naming an id they do not hold is their 404.
The same chain on real vLLM: test_real_vllm.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio

from llmgw_core.config import parse_config
from llmgw_http.limits import ServerLimits
from llmgw_http.request import Request
from llmgw_http.responder import Responder
from llmgw_http.server import HTTPServer
from llmgw_server.router.stored import Holder, holder_of, mint, model_tag, stored_path_id
from llmgw_server.wiring import Running, main
from test_api_surface import CLIENT_KEY, RESPONSE, event, in_thread

OTHER_KEY = "sk-client-other-model"


def _not_found(response_id: str) -> bytes:  # vLLM's shape
    message = f"Response with id '{response_id}' not found."
    return json.dumps(
        {"error": {"message": message, "type": "NotFoundError", "code": 404}}
    ).encode()


@attrs.define
class StoringEngine:
    """Keeps each response under the id its request names, as vLLM does."""

    stored: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    seen: list[tuple[bytes, bytes]] = attrs.field(factory=list)  # (method, path)

    async def handle(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path == b"/health":
            await responder.whole(200, b"{}")
            return
        if path in (b"/v1/models", b"/metrics"):
            await responder.whole(404, b'{"detail":"Not Found"}')
            return
        self.seen.append((request.method, path))
        if path == b"/v1/responses":
            await self._create(json.loads(request.body), responder)
            return
        response_id, _, sub = path.removeprefix(b"/v1/responses/").decode().partition("/")
        response = self.stored.get(response_id)
        if response is None:
            await responder.whole(404, _not_found(response_id))
        elif request.method == b"DELETE":
            del self.stored[response_id]
            answer = {"id": response_id, "object": "response", "deleted": True}
            await responder.whole(200, json.dumps(answer).encode())
        elif sub == "cancel":
            await responder.whole(200, json.dumps({**response, "status": "cancelled"}).encode())
        else:
            await responder.whole(200, json.dumps(response).encode())

    async def _create(self, body: dict[str, Any], responder: Responder) -> None:
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            await responder.whole(404, _not_found(previous))
            return
        response = {**RESPONSE, "id": body["request_id"], "previous_response_id": previous}
        self.stored[response["id"]] = response
        if not body.get("stream"):
            await responder.whole(200, json.dumps(response).encode())
            return
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        for number, name in enumerate(("response.created", "response.completed")):
            await responder.send(
                event(name, {"type": name, "sequence_number": number, "response": response})
            )
        await responder.end()


@asynccontextmanager
async def routers_before(
    engines: list[StoringEngine], routers: int
) -> AsyncIterator[list[Running]]:
    """`routers` routers apart (each its own Router), round robin over the engines."""
    async with trio.open_nursery() as nursery:
        urls = []
        for engine in engines:
            server = HTTPServer(engine.handle, ServerLimits())
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(server.serve, listeners)
            urls.append(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
        config = parse_config(
            {
                "server": {"listen": "127.0.0.1:0"},
                "router": {"health_interval_s": 0.2, "balancing": "round_robin"},
                "auth": {
                    "keys": [{"env": "CLIENT_KEY"}, {"env": "OTHER_KEY", "models": ["other"]}]
                },
                "models": [
                    {"name": "m", "endpoints": urls},
                    {"name": "other", "endpoints": urls[:1]},
                ],
            },
            "server.toml",
            environ={"CLIENT_KEY": CLIENT_KEY, "OTHER_KEY": OTHER_KEY},
        )
        stop = trio.Event()
        running: list[Running] = []
        for _ in range(routers):
            running.append(await nursery.start(lambda **kw: main(config, stop=stop, **kw)))
        for each in running:
            while each.router.served.balancers["m"].healthy_count < len(urls):
                await trio.sleep(0.01)
        yield running
        stop.set()
        nursery.cancel_scope.cancel()


def client_of(running: Running, key: str = CLIENT_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key=key, max_retries=0)


def holding(engines: list[StoringEngine], response_id: str) -> list[int]:
    return [i for i, engine in enumerate(engines) if response_id in engine.stored]


async def test_a_chain_of_follow_ups_reaches_the_replica_that_stored_each_response() -> None:
    engines = [StoringEngine(), StoringEngine()]
    with trio.fail_after(30):
        async with routers_before(engines, routers=2) as routers:
            clients = [client_of(r) for r in routers]
            first = await in_thread(lambda: clients[0].responses.create(model="m", input="hi"))
            assert holder_of(first.id) is not None, first.id
            (home,) = holding(engines, first.id)
            previous = first.id
            for turn in range(1, 6):  # round robin would alternate: each turn stays home
                answer = await in_thread(
                    partial(
                        clients[turn % 2].responses.create,
                        model="m",
                        input=f"turn {turn}",
                        previous_response_id=previous,
                    )
                )
                assert holding(engines, answer.id) == [home], turn
                assert answer.previous_response_id == previous
                previous = answer.id
            # Stored objects: read, cancelled and deleted on their replica, by either router.
            fetched = await in_thread(lambda: clients[1].responses.retrieve(previous))
            assert fetched.id == previous
            cancelled = await in_thread(lambda: clients[0].responses.cancel(previous))
            assert cancelled.status == "cancelled"
            await in_thread(lambda: clients[1].responses.delete(previous))
            assert holding(engines, previous) == []
            away = engines[1 - home]
            assert all(path == b"/v1/responses" for _, path in away.seen)
            assert len(away.seen) == 0  # round robin sent nothing of the chain there

            # Streamed: the id in its first event names its replica too.
            def streamed() -> str:
                events = list(clients[1].responses.create(model="m", input="hi", stream=True))
                assert events[0].type == "response.created"
                return events[0].response.id

            streamed_id = await in_thread(streamed)
            assert holder_of(streamed_id) is not None and len(holding(engines, streamed_id)) == 1


async def test_a_response_whose_replica_is_gone_gets_a_clear_404_and_others_are_balanced() -> None:
    engines = [StoringEngine(), StoringEngine()]
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    with trio.fail_after(30):
        async with routers_before(engines, routers=1) as (running,):
            client = client_of(running)
            first = await in_thread(lambda: client.responses.create(model="m", input="hi"))
            (home,) = holding(engines, first.id)
            balancer = running.router.served.balancers["m"]
            holder = holder_of(first.id)
            assert holder is not None
            kept = [r.endpoint for r in balancer.replicas if r.rid != holder.rid]
            assert len(kept) == 1
            running.router.served.set_endpoints("m", kept)  # its replica goes (scaled away, drained)
            seen_before = [len(e.seen) for e in engines]
            for ask in (
                lambda: client.responses.create(
                    model="m", input="again", previous_response_id=first.id
                ),
                lambda: client.responses.retrieve(first.id),
            ):
                try:
                    await in_thread(ask)
                    raise AssertionError("a response whose replica is gone was found")
                except openai.NotFoundError as gone:
                    assert gone.code == "response_not_found"
                    assert "no replica serving now holds the response" in gone.message
            assert [len(e.seen) for e in engines] == seen_before  # no other replica was asked

            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{running.port}", headers=auth
            ) as raw:
                # An id llmgw did not give: it cannot know where it lives.
                unknown = await raw.get("/v1/responses/resp_0123abc")
                assert unknown.status_code == 404
                assert "not given by llmgw" in unknown.json()["error"]["message"]
                # A follow-up naming such an id is balanced; the engine says what it knows.
                foreign = await raw.post(
                    "/v1/responses",
                    json={"model": "m", "input": "x", "previous_response_id": "resp_0123abc"},
                )
                assert foreign.status_code == 404 and "not found" in foreign.text
                assert (await raw.get("/v1/responses/a/b")).status_code == 404
                for path in ("/v1/responses/", "/v1/responses/a%0d%0a"):  # not plain paths
                    assert (await raw.get(path)).status_code == 400, path
                assert (await raw.put(f"/v1/responses/{first.id}")).status_code == 405
                # Keyless: refused from the head, like every relayed path.
                keyless = await raw.get(f"/v1/responses/{first.id}", headers={"authorization": ""})
                assert keyless.status_code == 401
            assert engines[home].stored  # it still holds the response: nobody deleted it


async def test_a_key_reaches_only_the_stored_responses_of_models_it_may_use() -> None:
    engines = [StoringEngine(), StoringEngine()]
    with trio.fail_after(30):
        async with routers_before(engines, routers=1) as (running,):
            mine = await in_thread(
                lambda: client_of(running).responses.create(model="m", input="hi")
            )
            # The other key may use only "other", served by the first engine alone.
            other = client_of(running, OTHER_KEY)
            theirs = await in_thread(lambda: other.responses.create(model="other", input="hi"))
            assert holding(engines, theirs.id) == [0]
            assert (await in_thread(lambda: other.responses.retrieve(theirs.id))).id == theirs.id
            # Not what "m" stored, even where the same engine stored it.
            with pytest.raises(openai.NotFoundError):
                await in_thread(lambda: other.responses.retrieve(mine.id))
            assert holding(engines, mine.id)


def test_minted_ids_name_their_replica_and_nothing_else_passes_for_one() -> None:
    rid = 0xFEDCBA9876543210
    minted = mint("m", rid)
    assert holder_of(minted) == Holder(model_tag("m"), rid)
    assert minted.startswith("resp_lg") and len(minted) == 63
    assert mint("m", rid) != minted and model_tag("m") != model_tag("n")
    for other in (None, 7, "resp_1", minted + "0", minted.upper(), minted[:-1], "x" + minted):
        assert holder_of(other) is None, other
    assert stored_path_id(f"/v1/responses/{minted}".encode()) == minted
    assert stored_path_id(f"/v1/responses/{minted}/cancel".encode()) == minted
    assert stored_path_id(f"/v1/responses/{minted}/input_items".encode()) == minted
    for path in (
        b"/v1/responses/",
        b"/v1/responses/x/",
        b"/v1/responses/x/other",
        b"/v1/responses/a.b",
    ):
        assert stored_path_id(path) is None, path
    assert stored_path_id(b"/v1/responses/" + b"a" * 129) is None


async def test_an_adapters_stored_response_is_found_under_its_name() -> None:
    engines = [StoringEngine(), StoringEngine()]
    with trio.fail_after(30):
        async with routers_before(engines, routers=1) as (running,):
            running.router.served.set_adapters({"m-lora": "m"})  # as the route table says
            client = client_of(running)
            made = await in_thread(lambda: client.responses.create(model="m-lora", input="hi"))
            holder = holder_of(made.id)
            assert holder is not None and holder.model_tag == model_tag("m-lora")
            assert (await in_thread(lambda: client.responses.retrieve(made.id))).id == made.id
