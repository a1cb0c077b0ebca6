"""The router's own parser of an engine's answer reads what h11 reads, however it is cut.

Answers written by h11 (content-length, chunked, or delimited by the close; 1xx first;
folded and odd headers) are fed to an Exchange over memory streams (the pool's connect seam) in random pieces;
status, headers and body must be those an h11 client reads from the same bytes, and the
connection goes back to the pool exactly when h11 would keep it alive.
"""

from __future__ import annotations

import h11
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.catalog import Endpoint
from llmgw_http.h1 import BadHead, response_framing
from llmgw_http.transport import Transport, memory_pair
from llmgw_server.router.upstream import Pool, UpstreamError


def h11_answer(
    status: int, headers: list[tuple[bytes, bytes]], pieces: list[bytes], version: bytes
) -> bytes:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/" + version + b"\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    conn.next_event()
    conn.next_event()
    out = conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b""
    out += conn.send(h11.Response(status_code=status, headers=headers)) or b""
    for piece in pieces:
        out += conn.send(h11.Data(data=piece)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


def h11_read(wire: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(wire)
    conn.receive_data(b"")
    status, headers, body = 0, [], b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            status, headers = event.status_code, list(event.headers)
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, body, conn.their_state is h11.DONE


async def exchange_read(
    pieces: list[bytes], close: bool
) -> tuple[int, list[tuple[bytes, bytes]], bytes, bool]:
    ours, engine = memory_pair()

    async def connect(host: str, port: int) -> Transport:
        return ours

    pool = Pool(Endpoint("127.0.0.1", 1), 1.0, connect=connect)
    result: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = []

    async def read() -> None:
        exchange = await pool.open(b"POST", b"/", [], b"")
        try:
            body = await exchange.read_body(1 << 20)
            result.append((exchange.status, exchange.headers, body))
        finally:
            exchange.release()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            try:
                for piece in pieces:
                    await engine.send_all(piece)
                    await trio.testing.wait_all_tasks_blocked()
            except trio.BrokenResourceError:
                pass  # the router refused the answer and closed the connection
            if close:
                await engine.aclose()
    reused = pool.idle_connections == 1
    await engine.aclose()
    pool.close()
    return (*result[0], reused)


header_lines = st.lists(
    st.sampled_from(
        [
            (b"content-type", b"text/event-stream"),
            (b"X-Mixed-Case", b"v  with  spaces"),
            (b"keep-alive", b"timeout=5"),
            (b"connection", b"close"),
            (b"x-empty", b""),
        ]
    ),
    max_size=3,
)


@settings(max_examples=profile_times(1.5), deadline=None)
@given(
    st.sampled_from([200, 201, 404, 500]),
    header_lines,
    st.lists(st.binary(min_size=1, max_size=30), max_size=4),
    st.sampled_from(["length", "chunked", "close"]),
    st.data(),
)
def test_an_answer_reads_as_h11_reads_it(
    status: int,
    headers: list[tuple[bytes, bytes]],
    pieces: list[bytes],
    framing: str,
    data: st.DataObject,
) -> None:
    body = b"".join(pieces)
    if framing == "length":
        headers = [*headers, (b"content-length", str(len(body)).encode())]
    version = b"1.0" if framing == "close" else b"1.1"  # h11 frames by the close for 1.0
    wire = h11_answer(status, headers, pieces, version)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(wire) - 1), max_size=4))))
    sent = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    close = framing == "close" or any(k == b"connection" for k, _ in headers)
    got_status, got_headers, got_body, reused = trio.run(exchange_read, sent, close)
    want_status, want_headers, want_body, keep = h11_read(wire)
    assert (got_status, got_body) == (want_status, want_body)
    assert got_headers == [(k.lower(), v) for k, v in want_headers]
    assert reused == (keep and not close)


def test_garbage_is_an_upstream_error() -> None:
    for wire in (
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 200 \r\nbad line\r\n\r\n",
        b"HTTP/1.1 200 \r\ntransfer-encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 \r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
    ):
        messages: list[str] = []
        try:
            trio.run(exchange_read, [wire], True)
        except* UpstreamError as group:
            messages = [str(exc) for exc in group.exceptions]
        assert messages and all("garbage" in m for m in messages), wire


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"content-length", b"107")], ("length", 107, True)),
        ([(b"content-length", b"0" * 18)], ("length", 0, True)),
        ([(b"transfer-encoding", b"Chunked")], ("chunked", 0, True)),
        # With Transfer-Encoding the length is ignored, and the connection not reused.
        ([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")], ("chunked", 0, False)),
        ([], ("close", 0, True)),
        ([(b"content-length", b"107, 107")], None),
        ([(b"content-length", b"107"), (b"content-length", b"107")], None),
        ([(b"content-length", b"1" * 19)], None),
        ([(b"content-length", b"1" * 5000)], None),
        ([(b"content-length", b"+5")], None),
        ([(b"content-length", b"")], None),
        ([(b"transfer-encoding", b"gzip, chunked")], None),
    ],
)
def test_how_an_answer_is_framed(
    headers: list[tuple[bytes, bytes]], expected: tuple[str, int, bool] | None
) -> None:
    if expected is None:
        with pytest.raises(BadHead):
            response_framing(200, headers, head_only=False)
    else:
        assert response_framing(200, headers, head_only=False) == expected
    assert response_framing(204, headers, head_only=False) == ("length", 0, True)  # never a body
