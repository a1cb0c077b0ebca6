"""Every endpoint clients call (issue 21): the Responses API, Anthropic's Messages, audio
forms, tokenize and rerank, routed by the model they name, with the real `openai` and
`anthropic` clients; engines' management paths never relayed.

The engine here is in process and answers in each API's own shape (what vLLM and
llama-server send), recording what reached it, so that what crossed the router can be
checked byte for byte. The same paths against the real engines: test_real_engines.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx
import openai
import trio

from llmgw_core.config import parse_config
from llmgw_http.limits import ServerLimits
from llmgw_http.request import Request
from llmgw_http.responder import Responder
from llmgw_http.server import HTTPServer
from llmgw_server.wiring import Running, main

CLIENT_KEY = "sk-client-api-surface"
# The engines' management paths issue 21 names (vLLM's and llama-server's), never relayed.
MANAGEMENT = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/lora-adapters",
    "/slots",
    "/props",
    "/v1/chat/completions/control",
    "/reset_prefix_cache",
)
T = TypeVar("T")

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": "m",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "hello there", "annotations": []}],
        }
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    },
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "m",
    "content": [{"type": "text", "text": "hello there"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 7, "output_tokens": 2},
}


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def response_events() -> list[bytes]:
    started = {**RESPONSE, "status": "in_progress", "output": [], "usage": None}
    delta = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "logprobs": []}
    return [
        event("response.created", {"type": "response.created", "sequence_number": 0, "response": started}),
        event("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 1, **delta, "delta": "hello"}),
        event("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2, **delta, "delta": " there"}),
        event("response.completed", {"type": "response.completed", "sequence_number": 3, "response": {**RESPONSE, "usage": {**RESPONSE["usage"], "output_tokens": 5}}}),  # type: ignore[dict-item]
    ]  # fmt: skip


def message_events() -> list[bytes]:
    started = {**MESSAGE, "content": [], "stop_reason": None, "usage": {"input_tokens": 7, "output_tokens": 1}}
    text = {"type": "content_block_delta", "index": 0}
    return [
        event("message_start", {"type": "message_start", "message": started}),
        event("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {**text, "delta": {"type": "text_delta", "text": "hello"}}),
        event("content_block_delta", {**text, "delta": {"type": "text_delta", "text": " there"}}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 9}}),
        event("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip


@attrs.define
class ApiEngine:
    """Answers each API in its own shape and records every request that reached it."""

    seen: list[Request] = attrs.field(factory=list)
    healthy: bool = True
    listing: bytes = b'{"detail":"Not Found"}'  # its /v1/models (404 unless set)

    async def handle(self, request: Request, responder: Responder) -> None:
        self.seen.append(request)
        path = request.path
        if path == b"/health":
            await responder.whole(200 if self.healthy else 503, b"{}")
        elif path == b"/v1/models":
            await responder.whole(200 if self.listing.startswith(b'{"object"') else 404, self.listing)
        elif path == b"/metrics":
            await responder.whole(200, b"", [(b"content-type", b"text/plain")])
        elif path in (b"/v1/responses", b"/v1/messages"):
            body = json.loads(request.body)
            whole, events = (
                (RESPONSE, response_events) if path == b"/v1/responses" else (MESSAGE, message_events)
            )
            if body.get("stream"):
                await responder.start(200, [(b"content-type", b"text/event-stream")])
                for e in events():
                    await responder.send(e)
                await responder.end()
            else:
                await responder.whole(200, json.dumps(whole).encode())
        elif path == b"/v1/audio/transcriptions":
            digest = hashlib.sha256(request.body).hexdigest()
            await responder.whole(200, json.dumps({"text": digest}).encode())
        elif path in (b"/tokenize", b"/v1/rerank", b"/v1/custom"):
            answer = {"path": path.decode(), "model": json.loads(request.body)["model"]}
            await responder.whole(200, json.dumps(answer).encode())
        else:  # what an engine says of a path it does not serve
            await responder.whole(404, b'{"detail":"Not Found"}')

    def requests(self, path: bytes) -> list[Request]:
        return [r for r in self.seen if r.path == path]


@asynccontextmanager
async def router_before(
    engine: ApiEngine, *more: ApiEngine, access_log: Path | None = None
) -> AsyncIterator[Running]:
    """A router in front of the engines; `access_log`: a file for its access log (JSON
    lines), else its lines go to stderr as by default."""
    async with trio.open_nursery() as nursery:
        urls = []
        for each in (engine, *more):
            server = HTTPServer(each.handle, ServerLimits())
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(server.serve, listeners)
            urls.append(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
        settings: dict[str, object] = {"listen": "127.0.0.1:0"}
        if access_log is not None:
            settings |= {"access_log_file": str(access_log), "access_log_format": "json"}
        config = parse_config(
            {
                "server": settings,
                "router": {"health_interval_s": 0.2, "extra_paths": ["/v1/custom"]},
                "auth": {"keys": [{"env": "CLIENT_KEY"}]},
                "models": [{"name": "m", "endpoints": urls}],
            },
            "server.toml",
            environ={"CLIENT_KEY": CLIENT_KEY},
        )
        stop = trio.Event()
        running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
        while running.router.served.balancers["m"].healthy_count < len(urls):
            await trio.sleep(0.01)
        yield running
        stop.set()
        nursery.cancel_scope.cancel()


async def in_thread(call: Callable[[], T]) -> T:
    """A blocking client's call, off the loop that serves it."""
    return await trio.to_thread.run_sync(call)


def tokens(running: Running, kind: str) -> float:
    return sum(v for (model, _, k), v in running.router.metrics.tokens.items() if k == kind)


async def logged(path: Path, count: int) -> list[tuple[str, int, int | None, int | None]]:
    """The access log's lines (path, status, prompt and completion tokens), once it holds
    `count` (the writer puts them out every half second)."""
    with trio.fail_after(10):
        while True:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line]
            if len(lines) >= count:
                break
            await trio.sleep(0.05)
    assert len(lines) == count, lines
    return [(r["path"], r["status"], r["prompt_tokens"], r["completion_tokens"]) for r in lines]


async def counted(running: Running) -> tuple[float, float]:
    """The prompt and completion tokens counted so far, once no request is in flight (a
    client has its answer's last byte a moment before the router ends the request)."""
    while any(running.router.metrics.in_flight.values()):
        await trio.sleep(0.01)
    return tokens(running, "prompt"), tokens(running, "completion")


async def test_the_responses_api_plain_and_streamed_with_its_tokens_counted(
    tmp_path: Path,
) -> None:
    engine = ApiEngine()
    access_log = tmp_path / "access.log"
    access_log.touch()
    with trio.fail_after(30):
        async with router_before(engine, access_log=access_log) as running:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{running.port}/v1", api_key=CLIENT_KEY, max_retries=0
            )
            answer = await in_thread(lambda: client.responses.create(model="m", input="Say hi"))
            assert answer.output_text == "hello there"
            assert await counted(running) == (11, 2)

            def streamed() -> list[str]:
                stream = client.responses.create(model="m", input="Say hi", stream=True)
                return [e.type for e in stream]

            kinds = await in_thread(streamed)
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert await counted(running) == (22, 7)
            # One access-log line each, with the tokens of its own usage: the answer's, and
            # the stream's response.completed (output 5, not the plain answer's 2).
            assert await logged(access_log, 2) == [
                ("/v1/responses", 200, 11, 2),
                ("/v1/responses", 200, 11, 5),
            ]
    (plain, stream) = engine.requests(b"/v1/responses")
    assert json.loads(plain.body)["model"] == "m" and json.loads(stream.body)["stream"] is True


async def test_anthropics_messages_with_x_api_key_plain_and_streamed(tmp_path: Path) -> None:
    import anthropic  # here: its import costs every test worker 1.5 s of CPU to collect

    engine = ApiEngine()
    access_log = tmp_path / "access.log"
    access_log.touch()
    with trio.fail_after(30):
        async with router_before(engine, access_log=access_log) as running:
            base = f"http://127.0.0.1:{running.port}"
            client = anthropic.Anthropic(base_url=base, api_key=CLIENT_KEY, max_retries=0)
            ask: dict[str, Any] = {
                "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]
            }  # fmt: skip
            message = await in_thread(lambda: client.messages.create(**ask))
            assert message.content[0].text == "hello there"

            def streamed() -> str:
                with client.messages.stream(**ask) as stream:
                    return "".join(stream.text_stream)

            assert await in_thread(streamed) == "hello there"
            # Input from the stream's first event, output from its last.
            assert await counted(running) == (14, 11)

            # Without a key, or with a wrong one: refused here, in Anthropic's shape,
            # which its client reads.
            keyless = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0)
            try:
                await in_thread(lambda: keyless.messages.create(**ask))
                raise AssertionError("a wrong key was let through")
            except anthropic.AuthenticationError as refused:
                assert refused.status_code == 401
                assert refused.body == {
                    "type": "error",
                    "error": {"type": "authentication_error", "message": refused.body["error"]["message"]},  # type: ignore[index]
                }  # fmt: skip
            unknown = await in_thread(
                lambda: httpx.post(
                    f"{base}/v1/messages", json={**ask, "model": "nope"},
                    headers={"x-api-key": CLIENT_KEY},
                )
            )  # fmt: skip
            assert unknown.status_code == 404
            assert unknown.json()["error"]["type"] == "not_found_error"
            # The access log: the plain answer's usage; the stream's input from its
            # message_start (7), its output from its message_delta (9, not message_start's
            # 1); the refused requests reached no engine and count nothing.
            assert await logged(access_log, 4) == [
                ("/v1/messages", 200, 7, 2),
                ("/v1/messages", 200, 7, 9),
                ("/v1/messages", 401, None, None),
                ("/v1/messages", 404, None, None),
            ]
    for request in engine.seen:  # the client's key never reaches the engine
        assert CLIENT_KEY.encode() not in b"".join(v for _, v in request.headers)


async def test_an_audio_form_is_relayed_intact_with_its_model_before_or_after_the_file() -> None:
    engine = ApiEngine()
    audio = bytes(range(256)) * 64 + b"\r\n--not-the-boundary\r\n"
    with trio.fail_after(30):
        async with router_before(engine) as running:
            base = f"http://127.0.0.1:{running.port}/v1"
            client = openai.OpenAI(base_url=base, api_key=CLIENT_KEY, max_retries=0)
            text = await in_thread(
                lambda: client.audio.transcriptions.create(model="m", file=("a.wav", audio))
            )
            assert len(text.text) == 64  # the engine's digest of what it got
            headers = {
                "authorization": f"Bearer {CLIENT_KEY}",
                "content-type": "multipart/form-data; boundary=XyZ",
            }
            for first, second in (("model", "file"), ("file", "model")):
                parts = {
                    "model": b'Content-Disposition: form-data; name="model"\r\n\r\nm',
                    "file": b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                    b"Content-Type: audio/wav\r\n\r\n" + audio,
                }
                body = b"".join(b"--XyZ\r\n" + parts[n] + b"\r\n" for n in (first, second))
                body += b"--XyZ--\r\n"
                sent = await in_thread(
                    lambda body=body: httpx.post(  # type: ignore[misc]
                        f"{base}/audio/transcriptions", content=body, headers=headers
                    )
                )
                assert sent.json() == {"text": hashlib.sha256(body).hexdigest()}
            # A form without a model names none, and a body that is no form is refused.
            no_model = await in_thread(
                lambda: httpx.post(
                    f"{base}/audio/transcriptions",
                    content=b'--XyZ\r\nContent-Disposition: form-data; name="file"\r\n\r\nx\r\n--XyZ--\r\n',
                    headers=headers,
                )
            )
            assert no_model.status_code == 404 and "model" in no_model.json()["error"]["message"]
            not_form = await in_thread(
                lambda: httpx.post(
                    f"{base}/audio/transcriptions", json={"model": "m"},
                    headers={"authorization": f"Bearer {CLIENT_KEY}"},
                )
            )  # fmt: skip
            assert not_form.status_code == 400
    assert len(engine.requests(b"/v1/audio/transcriptions")) == 3


async def test_management_paths_never_reach_an_engine_and_other_paths_route_by_model() -> None:
    engine = ApiEngine()
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    with trio.fail_after(30):
        async with router_before(engine) as running:
            base = f"http://127.0.0.1:{running.port}"
            async with httpx.AsyncClient(base_url=base, headers=auth) as client:
                for path in MANAGEMENT:
                    refused = await client.post(path, json={"model": "m", "lora_name": "x"})
                    assert refused.status_code == 403, path
                    assert "never relays" in refused.json()["error"]["message"]
                # llama-server's read-only ones are GETs: refused all the same.
                for path in ("/props", "/slots", "/lora-adapters"):
                    refused = await client.get(path, params={"model": "m"})
                    assert refused.status_code == 403, path
                for path in ("/tokenize", "/v1/rerank", "/v1/custom"):
                    routed = await client.post(path, json={"model": "m", "prompt": "x"})
                    assert routed.json() == {"path": path, "model": "m"}
                # A path the engine does not serve: its own 404, relayed, nothing ejected.
                for _ in range(5):
                    missing = await client.post("/v1/score", json={"model": "m", "text_1": "a"})
                    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
                (replica,) = running.router.served.balancers["m"].replicas
                assert replica.failures == 0 and running.router.served.balancers["m"].healthy_count == 1
                assert (await client.get("/v1/responses")).status_code == 405
                # Keyless: 401 from the head, for every relayed path.
                keyless = await client.post("/v1/rerank", json={"model": "m"}, headers={"authorization": ""})
                assert keyless.status_code == 401
    paths = {r.path for r in engine.seen}
    assert not paths & {p.encode() for p in MANAGEMENT}


VLLM_LISTING = json.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "m", "object": "model", "created": 1764800000, "owned_by": "vllm",
                "root": "/models/m", "parent": None, "max_model_len": 2048,
                "permission": [{"id": "modelperm-1", "allow_sampling": True}],
            },
            {"id": "m-lora", "object": "model", "root": "/lora", "parent": "m"},
        ],
    }
).encode()  # fmt: skip


async def test_models_are_listed_as_their_engines_describe_them_and_outlive_a_replica() -> None:
    """/v1/models carries the engine's max_model_len, root and owner (clients size prompts
    from it), cached: the replica that described it may go down, the entry stays."""
    describing, silent = ApiEngine(listing=VLLM_LISTING), ApiEngine()
    with trio.fail_after(30):
        async with router_before(describing, silent) as running:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{running.port}/v1", api_key=CLIENT_KEY, max_retries=0
            )
            while "m" not in running.router.served.cards:
                await trio.sleep(0.02)
            (model,) = (await in_thread(client.models.list)).data
            assert model.id == "m" and (model.model_extra or {})["max_model_len"] == 2048
            base = f"http://127.0.0.1:{running.port}/v1/models"
            auth = {"authorization": f"Bearer {CLIENT_KEY}"}
            async with httpx.AsyncClient(headers=auth) as raw:
                (card,) = (await raw.get(base)).json()["data"]
                # The engine's own fields too (vLLM's permission), as it sent them.
                assert card == {
                    "id": "m", "object": "model", "created": 1764800000, "owned_by": "vllm",
                    "root": "/models/m", "parent": None, "max_model_len": 2048,
                    "permission": [{"id": "modelperm-1", "allow_sampling": True}],
                }  # fmt: skip
                describing.healthy = False  # down: the other replica serves, the card stays
                while running.router.served.balancers["m"].healthy_count != 1:
                    await trio.sleep(0.02)
                assert (await raw.get(base)).json()["data"] == [card]
            described = len(describing.requests(b"/v1/models"))
            assert described == 1 and len(silent.requests(b"/v1/models")) == 1
