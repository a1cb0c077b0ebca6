"""The HTTP/1.1 grammar of both sides (llmgw_http.h1), fed bytes: each function against
what h11 reads or writes from the same bytes. (The fast path's full differential proofs
are in test_plain_http.py, test_fuzz_http.py and test_fuzz_engine_framing.py.)"""

from __future__ import annotations

import h11
import pytest

from llmgw_http import h1


def _h11_request(wire: bytes) -> h11.Request:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(wire)
    event = conn.next_event()
    assert isinstance(event, h11.Request)
    return event


def test_a_request_head_as_clients_send_it_reads_as_h11_reads_it() -> None:
    head = b"POST /v1/x?q=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nX-A:  v w \r\n"
    head += b"Connection: close"
    parsed = h1.plain_request(head)
    assert parsed is not None
    request, length, close = parsed
    event = _h11_request(head + b"\r\n\r\n")
    assert (request.method, request.target, request.headers) == (
        event.method,
        event.target,
        list(event.headers),
    )
    assert (length, close) == (2, True)


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b",
        b"GET / HTTP/1.0\r\nHost: a",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +1",
        b"GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue",
        b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n folded",
        b"GET / HTTP/1.1\r\nHost: a\r\nX : a",
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00",
    ],
)
def test_a_request_head_the_fast_path_does_not_read_goes_to_h11(head: bytes) -> None:
    assert h1.plain_request(head) is None


def test_the_server_s_heads_are_written_as_h11_writes_them() -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"2")]
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
    conn.next_event()
    assert h1.response_head(200, headers) == conn.send(
        h11.Response(status_code=200, headers=headers)
    )
    assert h1.has_body_length(200, headers)
    assert not h1.has_body_length(200, headers[:1])
    assert h1.has_body_length(204, []) and h1.has_body_length(101, [])


def test_a_refusal_is_a_whole_answer_that_closes() -> None:
    wire = h1.refusal(413, "too big")
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
    client.send(h11.EndOfMessage())
    client.receive_data(wire)
    response = client.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 413
    body = client.next_event()
    assert isinstance(body, h11.Data) and b"too big" in body.data
    assert isinstance(client.next_event(), h11.EndOfMessage)
    assert client.their_state is h11.MUST_CLOSE


def test_the_router_s_request_to_an_engine_reads_as_written() -> None:
    headers = [(b"host", b"e:1"), (b"content-length", b"2")]
    wire = h1.request_bytes(b"POST", b"/v1/c", headers, b"{}")
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(wire)
    event = conn.next_event()
    assert isinstance(event, h11.Request)
    assert (event.method, event.target, list(event.headers)) == (
        b"POST",
        b"/v1/c",
        [(b"host", b"e:1"), (b"content-length", b"2")],
    )
    data = conn.next_event()
    assert isinstance(data, h11.Data) and data.data == b"{}"


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2", (200, True, [(b"content-length", b"2")])),
        (b"HTTP/1.0 404 Not Found\nX-A: v ", (404, False, [(b"x-a", b"v")])),
        (b"HTTP/1.1 200 OK\r\nX-A: a\r\n  b", (200, True, [(b"x-a", b"a b")])),
    ],
)
def test_a_response_head_is_read(
    head: bytes, expected: tuple[int, bool, list[tuple[bytes, bytes]]]
) -> None:
    assert h1.parse_response_head(head) == expected


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 099 x",
        b"HTTP/1.1 600 x",
        b"HTTP/2 200 OK",
        b"HTTP/1.1 200 OK\r\n continued",
        b"HTTP/1.1 200 OK\r\nbad name: v",
        b"HTTP/1.1 200 OK\r\nx: a\x0bb",
    ],
)
def test_a_broken_response_head_is_refused(head: bytes) -> None:
    with pytest.raises(h1.BadHead):
        h1.parse_response_head(head)


def test_chunk_lines_are_one_grammar() -> None:
    assert h1.CHUNK_SIZE_LINE.fullmatch(b'1a;x=y;q="a b"\r\n')
    for line in (b"1a \r\n", b"1a\n", b"0x1a\r\n", b"1a;x\nAAAA\r\n", b"1" * 17 + b"\r\n"):
        assert not h1.CHUNK_SIZE_LINE.fullmatch(line), line
    assert h1.TRAILER_LINE.fullmatch(b"x-t:\tv\r\n")
    assert not h1.TRAILER_LINE.fullmatch(b"x-t: v\n")
