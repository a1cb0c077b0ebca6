"""The server's plain parser answers byte for byte what h11 answers, and hands over to h11
whatever it does not read itself.

Each example serves one connection twice, over a socket pair: once as `serve_connection`
serves a plain socket (the plain parser first) and once with h11 alone, the client's
bytes cut into the same pieces (each piece read and handled before the next is sent).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_http.h11_connection import H11Connection
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits


async def handler(request: Request, responder: Responder) -> None:
    path = request.path
    if path == b"/whole":
        await responder.whole(200, b"body:" + request.body, [(b"content-type", b"text/plain")])
    elif path == b"/stream":
        await responder.start(200, [(b"content-type", b"text/event-stream")])
        for piece in (b"data: a\n\n", b"", b"data: " + request.body + b"\n\n"):
            await responder.send(piece)
        await responder.end()
    elif path == b"/length":
        await responder.start(201, [(b"content-length", b"6")])
        await responder.send(b"abc")
        await responder.send(b"def")
        await responder.end()
    elif path == b"/chunks" and responder.chunked:
        await responder.start(200, [(b"x-kind", b"raw")])
        await responder.send_chunks(b"3\r\nabc\r\n")
        await responder.end()
    elif path == b"/nothing":
        return  # the server answers 500
    else:
        await responder.error(404, "no such path")


def _server() -> HTTPServer:
    return HTTPServer(handler, ServerLimits(max_body_bytes=1000, max_header_bytes=4096))


async def _exchange(pieces: list[bytes], h11_only: bool) -> bytes:
    client, server_sock = trio.socket.socketpair()
    stream = trio.SocketStream(server_sock)
    server = _server()
    out = b""
    # A hang's guard: 6 s, not 2, leaves a starved machine (CI's) seconds, and stays below
    # the 10 s header timeout a server left waiting for more would close after.
    with trio.fail_after(6):
        async with trio.open_nursery() as nursery:
            if h11_only:

                async def serve_with_h11() -> None:
                    try:
                        await H11Connection(server.terms, server.drain, stream).run()
                    finally:
                        await stream.aclose()

                nursery.start_soon(serve_with_h11)
            else:
                nursery.start_soon(server.serve_connection, stream)
            for piece in pieces:
                try:
                    await client.send(piece)
                except (BrokenPipeError, ConnectionResetError):
                    break  # the server closed: what it answered is still to be read
                await trio.testing.wait_all_tasks_blocked()
            try:
                while data := await client.recv(65536):
                    out += data
            except ConnectionResetError:
                out += b"<reset>"
            client.close()
    return out


def _request(method: bytes, path: bytes, body: bytes, headers: list[bytes], last: bool) -> bytes:
    head = [method + b" " + path + b" HTTP/1.1", b"Host: x", *headers]
    if b"Transfer-Encoding: chunked" in headers:
        body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif method == b"POST" or body:
        head.append(b"Content-Length: %d" % len(body))
    if last:
        head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


requests = st.lists(
    st.tuples(
        st.sampled_from([b"GET", b"POST", b"HEAD"]),
        st.sampled_from([b"/whole", b"/stream", b"/length", b"/chunks", b"/nothing", b"/x?q=1"]),
        st.binary(max_size=40),
        st.lists(
            st.sampled_from(
                [
                    b"connection: keep-alive",
                    b"X-A:  spaced value ",
                    b"Transfer-Encoding: chunked",
                    b"Expect: 100-continue",
                    b"x-bad : v",
                    b"Upgrade: h2c",
                ]
            ),
            max_size=2,
        ),
    ),
    min_size=1,
    max_size=3,
)


@settings(deadline=None)
@given(requests, st.data())
def test_the_plain_parser_answers_what_h11_answers(
    reqs: list[tuple[bytes, bytes, bytes, list[bytes]]], data: st.DataObject
) -> None:
    wire = b"".join(
        _request(method, path, body, headers, i == len(reqs) - 1)
        for i, (method, path, body, headers) in enumerate(reqs)
    )
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(wire) - 1), max_size=3))))
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    plain = trio.run(_exchange, pieces, False)
    reference = trio.run(_exchange, pieces, True)
    assert plain == reference


def test_requests_as_clients_send_them_never_reach_h11(monkeypatch: pytest.MonkeyPatch) -> None:
    async def refuse(self: object) -> None:
        raise AssertionError("handed to h11")

    monkeypatch.setattr(H11Connection, "run", refuse)
    wire = _request(b"POST", b"/stream", b"hi", [], False) + _request(
        b"GET", b"/whole", b"", [b"connection: keep-alive"], True
    )
    out = trio.run(_exchange, [wire], False)
    assert out.count(b"HTTP/1.1 200 ") == 2, out
    assert out.endswith(b"body:"), out


def test_a_body_over_the_limit_gets_413_without_h11() -> None:
    wire = b"POST /whole HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n"
    out = trio.run(_exchange, [wire], False)
    assert out.startswith(b"HTTP/1.1 413 "), out
    assert out == trio.run(_exchange, [wire], True)
