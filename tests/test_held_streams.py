"""A `stream: true` request for a model that no replica serves (scaled to zero, waking)
gets its answer's head and an SSE comment at once, then `: ping` while it is held; once a
replica serves, the engine's events follow that head; past `hold_timeout_s`, or on an
engine's refusal, the stream ends with an error event (OpenAI's shape, or Anthropic's on
/v1/messages), never a 503 after a 200. A request without `stream` keeps its 503."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio.testing

from llmgw_core.config import parse_config
from llmgw_http.h1 import JSON
from llmgw_http.limits import ServerLimits
from llmgw_http.request import Request
from llmgw_http.responder import Headers, Responder
from llmgw_http.server import HTTPServer
from llmgw_server.router.front import Router
from llmgw_server.router.holding import HELD_PING_S
from llmgw_server.wiring import Running, main

EVENTS = [b'data: {"choices": [{"delta": {"content": "hel"}}]}\n\n',
          b'data: {"choices": [{"delta": {"content": "lo"}}]}\n\n', b"data: [DONE]\n\n"]  # fmt: skip


async def streaming_engine(request: Request, responder: Responder) -> None:
    """Streams EVENTS for a chat; refuses one whose content is "refuse..." with a 400."""
    if request.path != b"/v1/chat/completions":
        await responder.whole(200 if request.path == b"/health" else 404, b"{}")
        return
    content = json.loads(request.body)["messages"][0]["content"]
    if content.startswith("refuse"):
        error = {"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}
        if content == "refuse chunked":  # no content-length: relayed as it comes, else
            await responder.start(400, JSON)
            await responder.send(json.dumps(error).encode())
            await responder.end()
        else:
            await responder.whole(400, json.dumps(error).encode())
        return
    await responder.start(200, [(b"content-type", b"text/event-stream")])
    for event in EVENTS:
        await responder.send(event)
    await responder.end()


@asynccontextmanager
async def router_at_zero() -> AsyncIterator[Running]:
    """A router whose model "chat" is autoscaled and at zero; "engine" is a static model
    on the streaming engine, whose endpoint the test gives "chat" when it wakes."""
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(HTTPServer(streaming_engine, ServerLimits()).serve, listeners)
        engine_url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        config = parse_config(
            {
                "server": {"listen": "127.0.0.1:0"},
                # Long: a starved machine must not time the hold out (tried apart below).
                "router": {"hold_timeout_s": 60.0},
                "models": [{"name": "engine", "endpoints": [engine_url]}],
            },
            "server.toml",
        )
        stop = trio.Event()
        running: Running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
        running.router.served.set_endpoints("chat", ())
        running.router.served.set_autoscaled(frozenset({"chat"}))
        yield running
        stop.set()
        nursery.cancel_scope.cancel()


def chat(content: str, stream: bool = True) -> dict[str, object]:
    return {"model": "chat", "stream": stream, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("content", ["hello", "refuse", "refuse chunked"])
async def test_a_held_stream_gets_its_head_and_a_comment_then_the_engines_events(
    content: str,
) -> None:
    with trio.fail_after(30):
        async with router_at_zero() as running:
            router = running.router
            url = f"http://127.0.0.1:{running.port}/v1/chat/completions"
            async with (
                httpx.AsyncClient(timeout=20) as client,
                client.stream("POST", url, json=chat(content)) as answer,
            ):
                # Head and comment while no replica exists.
                assert answer.status_code == 200
                assert answer.headers["content-type"] == "text/event-stream"
                chunks = answer.aiter_bytes()
                first = await chunks.__anext__()
                assert first == b": waiting for a replica of chat to start\n\n"
                assert router.served.meters["chat"].held == 1
                assert router.served.balancers["chat"].healthy_count == 0
                endpoint = router.served.balancers["engine"].replicas[0].endpoint
                router.served.set_endpoints("chat", [endpoint])  # a replica serves: released
                rest = b"".join([chunk async for chunk in chunks])
            if content == "hello":
                assert rest == b"".join(EVENTS)
            else:  # the engine's 400 cannot be a status now: an error event ends it
                event = json.loads(rest.removeprefix(b"data: "))
                assert event["error"]["message"] == "max_tokens is too large"
                assert rest.endswith(b"\n\n") and rest.count(b"data: ") == 1
            # Without `stream`, nothing is sent before the engine's answer.
            router.served.set_endpoints("chat", ())
            answers: list[httpx.Response] = []
            async with httpx.AsyncClient(timeout=20) as client, trio.open_nursery() as nursery:

                async def ask() -> None:
                    answers.append(await client.post(url, json=chat("plain", False)))

                nursery.start_soon(ask)
                while router.served.meters["chat"].held < 1:
                    await trio.sleep(0.01)
                router.served.set_endpoints("chat", [endpoint])
            assert answers[0].status_code == 200
            assert answers[0].headers["content-type"] == "text/event-stream"  # the engine's
            assert answers[0].content == b"".join(EVENTS)


class Recording(Responder):
    """Keeps what a handler writes, over no socket."""

    def __init__(self) -> None:
        self.chunked = True
        self.closing = self.head = self.started = False
        self.status: int | None = None
        self.headers: Headers = []
        self.body = b""
        self.ended = False
        self.writes: list[tuple[float, bytes]] = []  # (trio time, bytes)

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.status, self.headers = status, headers

    async def send(self, data: bytes) -> None:
        self.body += data
        self.writes.append((trio.current_time(), data))

    async def end(self) -> None:
        self.ended = True

    async def whole(self, status: int, body: bytes, headers: Headers = JSON) -> None:
        await self.start(status, headers)
        await self.send(body)
        await self.end()

    async def send_chunks(self, framed: bytes) -> None:
        raise AssertionError("no engine answers here")

    async def abort(self) -> None:
        raise AssertionError("not aborted")

    async def send_raw(self, data: bytes) -> None:
        raise AssertionError("no raw bytes")


HOLD_TIMEOUT_S = 35.0


async def held_until_timeout(path: bytes, body: dict[str, object]) -> Recording:
    config = parse_config(
        {
            "server": {"listen": "127.0.0.1:0"},
            "router": {"hold_timeout_s": HOLD_TIMEOUT_S},
            "models": [{"name": "static", "endpoints": ["http://127.0.0.1:9"]}],
        },
        "server.toml",
    )
    router = Router(config)
    router.served.set_endpoints("chat", ())
    router.served.set_autoscaled(frozenset({"chat"}))
    headers = [(b"content-type", b"application/json")]
    request = Request(b"POST", path, headers, json.dumps(body).encode())
    recording = Recording()
    with trio.fail_after(HOLD_TIMEOUT_S + 5):
        await router.handle(request, recording)
    assert router.served.meters["chat"].held == 0
    return recording


async def test_a_held_stream_that_times_out_ends_with_an_error_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recording = await held_until_timeout(b"/v1/chat/completions", chat("late"))
    assert recording.status == 200 and recording.ended
    assert (b"content-type", b"text/event-stream") in recording.headers
    comment, *pings, error = [data for _, data in recording.writes]
    assert comment == b": waiting for a replica of chat to start\n\n"
    # One ping each HELD_PING_S until the hold's end, then the error event.
    assert pings == [b": ping\n\n"] * int(HOLD_TIMEOUT_S // HELD_PING_S)
    times = [at for at, _ in recording.writes]
    assert times[1:-1] == pytest.approx([HELD_PING_S * (i + 1) for i in range(len(pings))])
    assert times[-1] == pytest.approx(HOLD_TIMEOUT_S)
    assert error.startswith(b"data: ") and error.endswith(b"\n\n")
    event = json.loads(error.removeprefix(b"data: "))
    assert "no replica of the model 'chat' served within 35 s" in event["error"]["message"]
    assert event["error"]["code"] == "no_healthy_replica"


async def test_a_held_messages_stream_that_times_out_ends_with_anthropics_error_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    body = {"model": "chat", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "late"}]}  # fmt: skip
    recording = await held_until_timeout(b"/v1/messages", body)
    assert recording.status == 200
    error = recording.writes[-1][1]
    assert error.startswith(b"event: error\ndata: ")
    event = json.loads(error.partition(b"data: ")[2])
    assert event["type"] == "error" and event["error"]["type"] == "overloaded_error"


async def test_a_held_request_without_stream_still_times_out_with_a_503(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recording = await held_until_timeout(b"/v1/chat/completions", chat("late", stream=False))
    assert recording.status == 503 and len(recording.writes) == 1
    assert (b"retry-after", b"5") in recording.headers
