"""What both kinds of client connection share (llmgw_http.serving), tested directly:
the serve loop against a fake connection, the handler's error policy against a fake
responder, and how a refusal goes out."""

from __future__ import annotations

import logging

import pytest
import trio

from llmgw_http.h1 import JSON
from llmgw_http.request import Request
from llmgw_http.responder import Headers, Responder
from llmgw_http.serving import Drain, Handler, run_handler, send_refusal, serve_requests


class FakeResponder(Responder):
    __slots__ = ("answers",)

    def __init__(self) -> None:
        self.chunked = self.closing = self.head = self.started = False
        self.answers: list[tuple[int, bytes]] = []

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        self.answers.append((status, b""))

    async def send(self, data: bytes) -> None: ...

    async def end(self) -> None: ...

    async def whole(self, status: int, body: bytes, headers: Headers = JSON) -> None:
        self.started = True
        self.answers.append((status, body))

    async def send_chunks(self, framed: bytes) -> None: ...

    async def abort(self) -> None: ...

    async def send_raw(self, data: bytes) -> None: ...


def request(path: bytes = b"/") -> Request:
    return Request(method=b"GET", target=path, headers=[(b"host", b"x")])


async def ok(request: Request, responder: Responder) -> None:
    await responder.whole(200, b"ok")


class FakeConnection:
    """Gives `requests` one at a time; `go_on` says whether each answer keeps it open."""

    def __init__(self, drain: Drain, handler: Handler, requests: int, go_on: bool = True) -> None:
        self.drain = drain
        self.handler = handler
        self.left = requests
        self.go_on = go_on
        self.busy_seen: list[int] = []
        self.answered = 0

    async def next_request(self) -> tuple[Request, Responder] | None:
        await trio.lowlevel.checkpoint()
        if not self.left:
            return None
        self.left -= 1
        return request(), FakeResponder()

    async def respond(self, request: Request, responder: Responder) -> bool:
        self.busy_seen.append(self.drain.busy)
        await run_handler(self.handler, request, responder)
        self.answered += 1
        return self.go_on


async def test_the_serve_loop_answers_until_the_connection_is_done() -> None:
    drain = Drain()
    connection = FakeConnection(drain, ok, 3)
    await serve_requests(drain, connection)
    assert (connection.answered, connection.busy_seen, drain.busy) == (3, [1, 1, 1], 0)


async def test_the_serve_loop_stops_where_an_answer_closes_the_connection() -> None:
    drain = Drain()
    connection = FakeConnection(drain, ok, 3, go_on=False)
    await serve_requests(drain, connection)
    assert connection.answered == 1


async def test_a_drain_ends_the_loop_and_tells_when_the_last_request_is_done() -> None:
    async def drain_inside(request: Request, responder: Responder) -> None:
        drain.draining = True
        await responder.whole(200, b"ok")

    drain = Drain()
    connection = FakeConnection(drain, drain_inside, 3)
    await serve_requests(drain, connection)
    assert connection.answered == 1 and drain.done.is_set()


async def test_a_handler_that_sends_nothing_gets_its_client_a_500() -> None:
    async def silent(request: Request, responder: Responder) -> None:
        pass

    responder = FakeResponder()
    await run_handler(silent, request(), responder)
    assert [status for status, _ in responder.answers] == [500]


async def test_a_failing_handler_is_logged_and_answered_500_if_it_sent_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def failing(request: Request, responder: Responder) -> None:
        raise ValueError("boom")

    async def failing_late(request: Request, responder: Responder) -> None:
        await responder.start(200, [])
        raise ValueError("late boom")

    caplog.set_level(logging.ERROR, "llmgw_http.server")
    first, second = FakeResponder(), FakeResponder()
    await run_handler(failing, request(b"/a"), first)
    await run_handler(failing_late, request(b"/b"), second)
    assert [status for status, _ in first.answers] == [500]
    assert [status for status, _ in second.answers] == [200]  # begun: nothing more sent
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["handler failed on b'GET' b'/a'", "handler failed on b'GET' b'/b'"]


@pytest.mark.parametrize("gone", [trio.ClosedResourceError, ConnectionResetError])
async def test_a_client_gone_under_a_handler_ends_the_connection_quietly(
    gone: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    async def writing(request: Request, responder: Responder) -> None:
        raise gone()

    responder = FakeResponder()
    with pytest.raises(trio.BrokenResourceError):
        await run_handler(writing, request(), responder)
    assert not responder.answers and not caplog.records


async def test_a_refusal_is_told_framed_and_written() -> None:
    told: list[tuple[int, str]] = []
    written: list[bytes] = []

    def on_reject(status: int, message: str) -> None:
        told.append((status, message))

    async def write(data: bytes) -> None:
        written.append(data)

    await send_refusal(on_reject, 413, "too big", lambda s, m: b"%d %s" % (s, m.encode()), write)
    await send_refusal(on_reject, 408, "too slow", lambda s, m: None, write)

    async def broken(data: bytes) -> None:
        raise trio.BrokenResourceError

    await send_refusal(on_reject, 400, "bad", lambda s, m: b"x", broken)  # a gone client: quiet
    assert told == [(413, "too big"), (408, "too slow"), (400, "bad")]
    assert written == [b"413 too big"]
