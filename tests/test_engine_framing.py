"""A hostile engine's answers, through the router in-process (issue 17, the engine side).

A raw engine writes exactly the bytes each test gives it; a raw client reads the
router's answer with h11. Whatever the engine sends, the client gets one well-framed
answer or a closed connection, never bytes the engine smuggled past the framing; a
broken answer is a 502 (before the first byte) or an aborted stream (after it), counted
against the replica and logged once, without a traceback.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import h11
import pytest
import trio

from llmgw_core.config import parse_config
from llmgw_http.server import HTTPServer
from llmgw_server.router.front import Router, server_limits

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
FORGED = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged"


@attrs.define
class RawEngine:
    """Answers each request with the next of `answers` (the last one again after that).

    An answer is bytes, or a function given the connection's stream (for answers that go
    on for ever). With `read_body` False the request's body is left unread.
    """

    answers: list[bytes | Callable[[trio.SocketStream], Awaitable[object]]]
    read_body: bool = True
    receive_buffer: int = 0  # SO_RCVBUF of accepted connections (0: the kernel's)
    port: int = 0
    requests: int = 0

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        if self.receive_buffer:
            listeners[0].socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            await self._answer(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the router closed, or an answer ended with the connection

    async def _answer(self, stream: trio.SocketStream) -> None:
        buf = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if self.read_body:
                    while len(buf) < length:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        buf += data
                    buf = buf[length:]
                answer = self.answers[min(self.requests, len(self.answers) - 1)]
                self.requests += 1
                if isinstance(answer, bytes):
                    await stream.send_all(answer)
                else:
                    await answer(stream)
                if not self.read_body:
                    await trio.sleep_forever()  # neither reads nor closes


@attrs.define
class Answer:
    status: int = 0
    headers: dict[bytes, bytes] = attrs.Factory(dict)
    body: bytes = b""
    complete: bool = False  # h11 read the whole answer
    error: str = ""  # why not: the connection closed, or h11 refused the bytes
    raw: bytes = b""  # every byte the client received


class Client:
    """One keep-alive connection to the router, read with h11."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def ask(self, body: bytes = CHAT, *, sender: bool = False) -> Answer:
        if self.conn.our_state is h11.DONE:
            self.conn.start_next_cycle()
        wire = self.conn.send(
            h11.Request(
                method="POST",
                target="/v1/chat/completions",
                headers=[("host", "x"), ("content-length", str(len(body)))],
            )
        )
        wire += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        answer = Answer()
        async with trio.open_nursery() as nursery:
            if sender:  # a big body: sent while the answer is read
                nursery.start_soon(self._send, wire)
            else:
                await self.stream.send_all(wire)
            await self._read(answer)
            nursery.cancel_scope.cancel()
        return answer

    async def _send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except trio.BrokenResourceError:
            pass

    async def _read(self, answer: Answer) -> None:
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                answer.error = f"h11: {exc}"
                return
            if event is h11.NEED_DATA:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                answer.raw += data
                self.conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                answer.status = event.status_code
                answer.headers = {k: v for k, v in event.headers}
            elif isinstance(event, h11.Data):
                answer.body += event.data
            elif isinstance(event, h11.EndOfMessage):
                answer.complete = True
                return
            elif isinstance(event, h11.ConnectionClosed):
                answer.error = "closed"
                return

    async def rest(self) -> bytes:
        """What else the router sends on this connection until it closes it (1 s at most)."""
        out = b""
        with trio.move_on_after(1):
            while data := await self.stream.receive_some(65536):
                out += data
            return out
        return out + b"<still open>"


@asynccontextmanager
async def gateway(engine: RawEngine, **router: object) -> AsyncIterator[tuple[Router, Client]]:
    """The engine and a router in front of it, and a client connected to the router."""
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve)
        config = parse_config(
            {
                "router": {"retries": 0, "eject_after_failures": 100, **router},
                "models": [{"name": "m", "endpoints": [f"http://127.0.0.1:{engine.port}"]}],
            },
            "test.toml",
        )
        app = Router(config)
        server = HTTPServer(app.handle, server_limits(config.server), on_reject=app.rejected)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        await nursery.start(server.serve, listeners)
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            yield app, Client(stream)
        nursery.cancel_scope.cancel()


def failures(app: Router) -> int:
    (replica,) = app.served.balancers["m"].replicas
    return replica.failures


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert "sent no response" not in caplog.text


def chunked_head(*extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n" + b"".join(extra) + b"\r\n"


# -- 1: Transfer-Encoding with a Content-Length -------------------------------------------


@pytest.mark.parametrize("declared", [5, 2_000_000])
async def test_an_engine_content_length_beside_chunked_is_never_relayed(
    declared: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine declares a length beside chunked framing; its chunked body holds a
    forged answer past that length. The client gets the whole body in the router's own
    framing, then the engine's real second answer on the same connection."""
    body = b"a" * declared + FORGED
    first = (
        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ntransfer-encoding: chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\n\r\n" % (declared, len(body), body)
    )
    second = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond"
    engine = RawEngine([first, second])
    with trio.fail_after(20):
        async with gateway(engine) as (app, client):
            answer = await client.ask()
            assert answer.complete and answer.status == 200, answer.error
            assert b"content-length" not in answer.headers
            assert answer.headers[b"transfer-encoding"] == b"chunked"
            assert answer.body == body
            again = await client.ask()
            assert (again.status, again.body) == (200, b"second")
            assert engine.requests == 2
            assert failures(app) == 0
    no_traceback(caplog)


# -- 2: chunk-size lines ---------------------------------------------------------------------


def smuggling_chunks(line_end: bytes) -> bytes:
    """A chunk whose size line a loose reader ends at `line_end`, with a forged answer
    in what a strict reader takes for its data (finding 2's bytes)."""
    data = b"0\r\n\r\n" + FORGED
    return b"%x;x%b" % (len(data), line_end) + b"A" * 74 + b"\r\n" + data + b"\r\n0\r\n\r\n"


@pytest.mark.parametrize("line_end", [b"\n", b"\x0b", b"\x0c", b" "])
async def test_a_loose_chunk_size_line_aborts_the_stream(
    line_end: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    head = chunked_head(b"content-type: text/event-stream\r\n")
    good = b"c\r\ndata: hi\r\n\r\n\r\n"
    engine = RawEngine([head + good + smuggling_chunks(line_end)])
    with trio.fail_after(20):
        async with gateway(engine) as (app, client):
            answer = await client.ask()
            assert answer.status == 200 and not answer.complete
            # The good chunk at most (not when it came in the same read as the bad one).
            assert answer.body in (b"", b"data: hi\r\n\r\n")
            assert await client.rest() == b""  # closed, never continued
            assert b"forged" not in answer.raw
            assert failures(app) == 1
    no_traceback(caplog)
    assert "broke the chunked framing" in caplog.text


# -- 8: a big chunk streams through -----------------------------------------------------------


async def test_a_big_chunk_reaches_the_client_before_it_is_complete() -> None:
    """The engine declares a 300 MiB chunk and sends 1 MiB of it: the client gets that
    MiB at once (the old scanner held the chunk until it was whole)."""
    sent = b"z" * (1 << 20)

    async def big_chunk(stream: trio.SocketStream) -> None:
        await stream.send_all(chunked_head() + b"%x\r\n" % (300 << 20) + sent)
        await trio.sleep_forever()

    engine = RawEngine([big_chunk])
    with trio.fail_after(20):
        async with gateway(engine) as (_app, client):
            await client.stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b"
                % (len(CHAT), CHAT)
            )
            got = b""
            while sent not in got:
                got += await client.stream.receive_some(1 << 20)
            assert got.startswith(b"HTTP/1.1 200 ")


# -- 10: odd lengths -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length",
    [b"107, 107", b"1" * 5000, b"+5", b"-1", b"5 5", b"0x5", b"1" * 19],
)
async def test_an_odd_content_length_is_a_502_counted_and_logged_once(
    length: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %b\r\n\r\n" % length + b"x" * 107
    engine = RawEngine([answer])
    caplog.set_level(logging.WARNING)
    with trio.fail_after(20):
        async with gateway(engine) as (app, client):
            for n in range(3):
                got = await client.ask()
                assert got.status == 502, (got.status, got.body[:200])
                assert b"content-length" in got.body
                assert failures(app) == n + 1
    no_traceback(caplog)
    assert len([r for r in caplog.records if "502 for m from replica" in r.getMessage()]) == 1


# -- 11: interim answers, early answers, odd statuses ----------------------------------------


async def test_endless_interim_answers_are_a_502_at_once(caplog: pytest.LogCaptureFixture) -> None:
    async def endless(stream: trio.SocketStream) -> None:
        while True:
            await stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n" * 10)
            await trio.sleep(0.01)

    engine = RawEngine([endless])
    with trio.fail_after(20):
        async with gateway(engine, first_byte_timeout_s=30) as (app, client):
            started = trio.current_time()
            answer = await client.ask()
            assert answer.status == 502
            assert b"more than 5 interim answers" in answer.body
            assert trio.current_time() - started < 10  # not the 30 s first-byte limit
            assert failures(app) == 1
    no_traceback(caplog)


async def test_five_interim_answers_are_fine() -> None:
    engine = RawEngine(
        [b"HTTP/1.1 100 Continue\r\n\r\n" * 4 + b"HTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n"
         b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    )  # fmt: skip
    with trio.fail_after(20):
        async with gateway(engine) as (_app, client):
            answer = await client.ask()
            assert (answer.status, answer.body) == (200, b"ok")


@pytest.mark.parametrize("closes", [False, True])
async def test_an_early_413_is_relayed_and_not_charged(
    closes: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine answers 413 from the head, and reads none of the 12 MiB body (then
    closes, or keeps the connection): the router relays the 413 instead of waiting in
    its send until the first-byte limit (504), or failing in it (502)."""
    refusal = b'{"error": {"message": "too big"}}'
    head = b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
    answer = head + b"content-length: %d\r\n\r\n%b" % (len(refusal), refusal)

    async def answer_and_close(stream: trio.SocketStream) -> None:
        await stream.send_all(answer)
        await stream.aclose()

    engine = RawEngine(
        [answer_and_close if closes else answer], read_body=False, receive_buffer=64 * 1024
    )
    big = json.dumps({"model": "m", "prompt": "x" * (12 << 20)}).encode()
    with trio.fail_after(30):
        async with gateway(engine, first_byte_timeout_s=8) as (app, client):
            started = trio.current_time()
            got = await client.ask(big, sender=True)
            assert (got.status, got.body) == (413, refusal)
            assert trio.current_time() - started < 6  # not the first-byte limit's 504
            assert failures(app) == 0
            assert not app.served.pools[app.served.balancers["m"].replicas[0].endpoint]._idle  # not reused
    no_traceback(caplog)


@pytest.mark.parametrize("status", [b"099", b"000", b"600", b"999"])
async def test_a_status_outside_100_to_599_is_a_502(
    status: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    engine = RawEngine([b"HTTP/1.1 %b Odd\r\ncontent-length: 2\r\n\r\nok" % status])
    with trio.fail_after(20):
        async with gateway(engine) as (app, client):
            answer = await client.ask()
            assert answer.status == 502
            assert b"bad status line" in answer.body
            assert failures(app) == 1
    no_traceback(caplog)


async def test_an_engine_gone_mid_chunk_aborts_the_stream(caplog: pytest.LogCaptureFixture) -> None:
    """Part of a chunk has reached the client (a chunk's data goes out as it comes): an
    SSE error event there would land inside the chunk, so the connection is closed."""

    async def half_a_chunk(stream: trio.SocketStream) -> None:
        head = chunked_head(b"content-type: text/event-stream\r\n")
        await stream.send_all(head + b"c\r\ndata: hi\r\n\r\n\r\n" + b"100\r\ndata: half")
        await stream.aclose()

    engine = RawEngine([half_a_chunk])
    with trio.fail_after(20):
        async with gateway(engine) as (app, client):
            answer = await client.ask()
            assert answer.status == 200 and not answer.complete
            assert b"upstream_error" not in answer.raw
            assert await client.rest() == b""
            assert failures(app) == 1
    no_traceback(caplog)


async def test_an_engine_gone_between_chunks_ends_the_stream_with_an_error_event() -> None:
    async def whole_chunks(stream: trio.SocketStream) -> None:
        head = chunked_head(b"content-type: text/event-stream\r\n")
        await stream.send_all(head + b"c\r\ndata: hi\r\n\r\n\r\n")
        await stream.aclose()

    engine = RawEngine([whole_chunks])
    with trio.fail_after(20):
        async with gateway(engine) as (app, client):
            answer = await client.ask()
            assert answer.complete and answer.body.startswith(b"data: hi\r\n\r\n")
            assert b"upstream_error" in answer.body
            assert failures(app) == 1


async def test_framing_lookalikes_and_connection_named_headers_are_not_relayed() -> None:
    engine = RawEngine(
        [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nTransfer_Encoding: chunked\r\n"
         b"content_length: 9\r\nconnection: keep-alive, x-hop\r\nx-hop: 1\r\nx-kept: 2\r\n"
         b"\r\nok"]
    )  # fmt: skip
    with trio.fail_after(20):
        async with gateway(engine) as (_app, client):
            answer = await client.ask()
            assert (answer.status, answer.body) == (200, b"ok")
            head = answer.raw.split(b"\r\n\r\n")[0].lower()
            assert b"transfer_encoding" not in head and b"content_length" not in head
            assert b"x-hop" not in head and b"x-kept: 2" in head
