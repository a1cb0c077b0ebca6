"""What a hostile client can make the server do (issue 17): the API key is checked from the
head, before any body is read; connections, body pace, head size and framing are bounded;
a client gone with bytes still buffered is noticed; hop-by-hop headers stay here.

In-process over socket pairs (the plain parser needs a socket) or loopback TCP where the
kernel's TCP state is the point; the memory test runs a real router process.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from llmgw_core import bearer, config_schema
from llmgw_core.config import parse_config
from llmgw_http.h11_connection import H11Connection
from llmgw_http.limits import BODY_RATE_GRACE_S, body_too_slow, pieces_too_small
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits
from llmgw_server.router import front
from llmgw_server.router.front import Router
from llmgw_server.router.headers import end_to_end
from procs import Procs, models_toml

MIB = 1024 * 1024


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


async def hello(request: Request, responder: Responder) -> None:
    await responder.whole(200, b"got %d" % len(request.body), [(b"content-type", b"text/plain")])


@asynccontextmanager
async def serving(server: HTTPServer, *, h11_only: bool = False) -> AsyncIterator[Any]:
    """A client socket whose peer the server serves: as a plain socket (the plain parser
    first), or with h11 alone (as a TLS connection is served)."""
    client, server_sock = trio.socket.socketpair()
    stream = trio.SocketStream(server_sock)

    async def serve() -> None:
        if h11_only:
            try:
                await H11Connection(server.terms, server.drain, stream).run()
            finally:
                await stream.aclose()
        else:
            await server.serve_connection(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        try:
            yield client
        finally:
            client.close()
            nursery.cancel_scope.cancel()


async def read_to_end(client: Any) -> bytes:
    """Everything the server sends until it closes (a reset is marked)."""
    out = b""
    try:
        while data := await client.recv(65536):
            out += data
    except ConnectionResetError:
        out += b"<reset>"
    return out


# -- the API key, from the head ------------------------------------------------------


def _router() -> Router:
    data = {
        "server": {"access_log": False},
        "auth": {
            "api_keys": [sha("sk-all")],
            "keys": [{"digest": sha("sk-a"), "models": ["a"]}],
        },
        "models": [
            {"name": "a", "endpoints": ["http://127.0.0.1:9"]},
            {"name": "b", "endpoints": ["http://127.0.0.1:9"]},
        ],
    }
    return Router(parse_config(data, "router.toml"))


def _router_server(router: Router) -> HTTPServer:
    return HTTPServer(
        router.handle, ServerLimits(), on_reject=router.rejected, check_head=router.check_head
    )


def _chat_head(length: int, key: str | None, chunked: bool = False) -> bytes:
    auth = b"" if key is None else b"authorization: Bearer %b\r\n" % key.encode()
    framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % length
    return b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n%b%b\r\n\r\n" % (auth, framing)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
@pytest.mark.parametrize("how", ["plain", "chunked", "h11"])
async def test_a_request_without_a_valid_key_is_refused_from_its_head(
    key: str | None, how: str
) -> None:
    # The client sends only the head of a 16 MiB upload and waits: the answer comes, and the
    # connection closes, without a byte of the body (old code waited for it: a timeout).
    router = _router()
    with trio.fail_after(5):
        async with serving(_router_server(router), h11_only=how == "h11") as client:
            await client.send(_chat_head(16 * MIB, key, chunked=how == "chunked"))
            answer = await read_to_end(client)
    assert answer.startswith(b"HTTP/1.1 401 "), answer
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert b"a valid API key is required" in answer
    assert not answer.endswith(b"<reset>")
    reason = "missing_key" if key is None else "invalid_key"
    assert router.metrics.auth_failures[reason] == 1


async def test_a_valid_key_is_hashed_once_and_per_model_refusals_read_the_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed: list[bytes] = []
    digest_of = config_schema.digest_of  # what bearer imported

    def counting(token: bytes) -> str:
        hashed.append(token)
        return digest_of(token)

    monkeypatch.setattr(bearer, "digest_of", counting)
    body = b'{"model": "b", "messages": []}'
    with trio.fail_after(5):
        async with serving(_router_server(_router())) as client:
            await client.send(_chat_head(len(body), "sk-a") + body)
            answer = await client.recv(65536)
    # The key may use "a" only: 403 needs the body's model (old code hashed the key twice).
    assert answer.startswith(b"HTTP/1.1 403 "), answer
    assert hashed == [b"sk-a"]


# -- connections, body pace, head size, framing ------------------------------------------


def test_the_server_keys_reach_the_inference_ports_limits() -> None:
    models = [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}]
    default = front.server_limits(parse_config({"models": models}, "r.toml").server)
    assert (default.max_connections, default.min_body_rate) == (4096, 1024)
    server = {"max_connections": 10, "min_body_rate": 0}
    limits = front.server_limits(
        parse_config({"server": server, "models": models}, "r.toml").server
    )
    assert (limits.max_connections, limits.min_body_rate) == (10, 0)


async def test_connections_past_max_connections_get_503_and_a_close() -> None:
    refused: list[tuple[int, str]] = []
    server = HTTPServer(
        hello,
        ServerLimits(max_connections=2),
        on_reject=lambda status, message: refused.append((status, message)),
    )
    get = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(server.serve, listeners)
            port = listeners[0].socket.getsockname()[1]
            held = []
            for _ in range(2):  # served, and kept alive
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(get)
                assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
                held.append(stream)
            third = await trio.open_tcp_stream("127.0.0.1", port)
            answer = b""
            while data := await third.receive_some(65536):
                answer += data
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"max_connections" in answer and b"connection: close" in answer
            assert [status for status, _ in refused] == [503]
            await held.pop().aclose()
            while server.plain_connections > 1:
                await trio.sleep(0.01)
            again = await trio.open_tcp_stream("127.0.0.1", port)
            await again.send_all(get)
            assert (await again.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
            for stream in [*held, third, again]:
                await stream.aclose()
            nursery.cancel_scope.cancel()


def test_the_body_pace_rule() -> None:
    assert not body_too_slow(0, BODY_RATE_GRACE_S - 0.1, 1024)  # the grace
    assert body_too_slow(1024 * 5 - 1, 5.0, 1024)
    assert not body_too_slow(1024 * 5, 5.0, 1024)
    assert not body_too_slow(1024 * 5, 60.0, 0)  # no minimum


def test_the_body_piece_rule() -> None:
    assert not pieces_too_small(1024, 1024)  # the first pieces are free
    assert pieces_too_small(1025, 1025)
    assert not pieces_too_small(2000, 64 * 2000)


async def test_a_body_in_tiny_chunks_is_refused() -> None:
    # Old code parsed a body of 1-byte chunks to its end, at most of a core's cost.
    server = HTTPServer(hello, ServerLimits())
    head = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"

    async def exchange(chunk: int) -> bytes:
        piece = b"%x\r\n%b\r\n" % (chunk, b"x" * chunk)
        async with serving(server) as client:
            wire = memoryview(head + piece * 3000 + b"0\r\n\r\n")
            try:
                while wire:
                    wire = wire[await client.send(wire) :]
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the whole body
            return bytes(await client.recv(65536))

    with trio.fail_after(10):
        tiny, fine = await exchange(1), await exchange(100)
    assert tiny.startswith(b"HTTP/1.1 400 ") and b"pieces too small" in tiny, tiny
    assert fine.startswith(b"HTTP/1.1 200 ") and fine.endswith(b"got 300000"), fine


async def _trickle(client: Any, head: bytes, piece: bytes, seconds: float) -> None:
    await client.send(head)
    deadline = trio.current_time() + seconds
    try:
        while trio.current_time() < deadline:
            await trio.sleep(1)
            await client.send(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass  # cut


@pytest.mark.parametrize("h11_only", [False, True])
async def test_a_body_slower_than_min_body_rate_gets_408(
    autojump_clock: trio.testing.MockClock, h11_only: bool
) -> None:
    server = HTTPServer(hello, ServerLimits(min_body_rate=1024, body_timeout_s=60))
    head = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n"
    with trio.fail_after(30):
        async with serving(server, h11_only=h11_only) as client, trio.open_nursery() as nursery:
            nursery.start_soon(_trickle, client, head, b"x" * 100, 50.0)
            answer = await read_to_end(client)
            cut_at = trio.current_time()
            nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"slower than the minimum of 1024 bytes/s" in answer
    assert BODY_RATE_GRACE_S <= cut_at <= BODY_RATE_GRACE_S + 1.1  # old code: 60 s


async def test_a_chunked_body_at_the_minimum_rate_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = HTTPServer(hello, ServerLimits(min_body_rate=1024, body_timeout_s=60))
    head = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    piece = b"800\r\n" + b"x" * 2048 + b"\r\n"  # 2 KiB a second, for 10 s
    with trio.fail_after(30):
        async with serving(server) as client:
            await _trickle(client, head, piece, 10.0)
            await client.send(b"0\r\n\r\n")
            answer = await client.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"got 20480"), answer


@pytest.mark.parametrize("h11_only", [False, True])
@pytest.mark.parametrize(
    "framing",
    [
        b"content-length: 5\r\ntransfer-encoding: chunked",
        b"transfer-encoding: chunked\r\ncontent-length: 5",
        b"content-length: 5\r\ntransfer-encoding:\r\n chunked",  # an obs-fold
    ],
)
async def test_a_request_with_content_length_and_transfer_encoding_is_refused_and_closed(
    h11_only: bool, framing: bytes
) -> None:
    # Old code served it (200) and kept the connection open for a next request.
    server = HTTPServer(hello, ServerLimits())
    with trio.fail_after(5):
        async with serving(server, h11_only=h11_only) as client:
            await client.send(b"POST / HTTP/1.1\r\nhost: x\r\n%b\r\n\r\n0\r\n\r\n" % framing)
            answer = await read_to_end(client)
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"both Transfer-Encoding and Content-Length" in answer


@pytest.mark.parametrize("h11_only", [False, True])
@pytest.mark.parametrize(
    "folded",
    [
        b"transfer-encoding:\r\n chunked",  # issue 34: read as chunked, answered, kept
        b"transfer-encoding: chunked\r\n\t",
        b"x-a: 1\r\n b",
        b"x-a: 1\n b",
    ],
)
@pytest.mark.parametrize("pieces", [1, 2])
async def test_a_request_with_a_folded_header_is_refused_and_closed(
    h11_only: bool, folded: bytes, pieces: int
) -> None:
    # Old code unfolded it (as h11 does), served it and read the next request (a proxy
    # before the router may have read a folded Transfer-Encoding otherwise).
    server = HTTPServer(hello, ServerLimits())
    head = b"POST / HTTP/1.1\r\nhost: x\r\n%b\r\n\r\n" % folded
    cut = head.index(folded) + folded.index(b"\n") + 1  # between the line end and the fold
    with trio.fail_after(5):
        async with serving(server, h11_only=h11_only) as client:
            if pieces == 2:
                await client.send(head[:cut])
                await trio.testing.wait_all_tasks_blocked()
                head = head[cut:]
            await client.send(head + b"3\r\nabc\r\n0\r\n\r\nGET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = await read_to_end(client)
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1 ") == 1, answer
    assert b"folded over lines" in answer


async def test_a_chunked_body_with_indented_lines_is_no_fold() -> None:
    server = HTTPServer(hello, ServerLimits())
    body = b'{\n  "model": "m"\n}'
    chunked = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
    with trio.fail_after(5):
        async with serving(server, h11_only=True) as client:
            await client.send(chunked % (len(body), body) + b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while answer.count(b"HTTP/1.1 200 ") < 2:
                answer += await client.recv(65536)
    assert b"got 18" in answer and b"got 0" in answer


@pytest.mark.parametrize("how", ["whole", "in pieces", "h11"])
async def test_a_head_over_the_limit_gets_431(how: str) -> None:
    # Old code let h11 take a head that came whole, or whole after a first piece: up to
    # the limit plus a read (64 KiB) more.
    server = HTTPServer(hello, ServerLimits(max_header_bytes=4096))

    async def exchange(pad: int) -> bytes:
        head = b"GET / HTTP/1.1\r\nhost: x\r\nx-pad: %b\r\n\r\n" % (b"a" * pad)
        async with serving(server, h11_only=how == "h11") as client:
            if how == "in pieces":
                await client.send(head[:100])
                await trio.testing.wait_all_tasks_blocked()
                head = head[100:]
            await client.send(head)
            return bytes(await client.recv(65536))

    with trio.fail_after(5):
        fits = await exchange(4096 - 36)  # a head of 4096 bytes
        too_large = await exchange(4096 - 35)
    assert fits.startswith(b"HTTP/1.1 200 "), fits
    assert too_large.startswith(b"HTTP/1.1 431 "), too_large


# -- a client gone with bytes buffered -------------------------------------------------


@pytest.mark.parametrize(
    ("framing", "byte_comes"),
    [
        ("plain", "with the request"),
        ("plain", "during the handler"),
        # (With the request, h11 holds the byte unparsed and the reader sees the close.)
        ("chunked (h11)", "during the handler"),
    ],
)
async def test_a_client_gone_with_a_pipelined_byte_buffered_cancels_the_handler(
    byte_comes: str, framing: str
) -> None:
    started, cancelled = trio.Event(), trio.Event()

    async def slow(request: Request, responder: Responder) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    server = HTTPServer(slow, ServerLimits())
    if framing == "plain":
        request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    else:
        request = b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
    with trio.fail_after(5):  # old code: the handler ran on
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            await nursery.start(server.serve, listeners)
            port = listeners[0].socket.getsockname()[1]
            client = await trio.open_tcp_stream("127.0.0.1", port)
            if byte_comes == "with the request":
                await client.send_all(request + b"G")
                await started.wait()
            else:
                await client.send_all(request)
                await started.wait()
                await client.send_all(b"G")
            await client.aclose()
            await cancelled.wait()
            nursery.cancel_scope.cancel()


# -- what an engine is sent ----------------------------------------------------------------


def test_hop_by_hop_connection_named_and_lookalike_headers_are_not_forwarded() -> None:
    request = Request(
        b"POST",
        b"/v1/chat/completions",
        [
            (b"host", b"x"),
            (b"connection", b"keep-alive, X-Secret ,x-other-secret"),
            (b"x-secret", b"1"),
            (b"x_other_secret", b"2"),
            (b"transfer_encoding", b"chunked"),
            (b"content_length", b"5"),
            (b"keep_alive", b"timeout=5"),
            (b"content-type", b"application/json"),
            (b"x-kept", b"3"),
            (b"connection", b"x-third"),  # a second Connection header counts too
            (b"x-third", b"4"),
        ],
    )
    assert end_to_end(request.headers) == [
        (b"content-type", b"application/json"),
        (b"x-kept", b"3"),
    ]
    request.headers[1] = (b"connection", b"keep-alive")
    assert (b"x-secret", b"1") in end_to_end(request.headers)


def test_rewrite_headers_are_not_forwarded() -> None:
    # Old code relayed them: an engine behind a framework that honours them could be
    # sent to another path or method than the one the router checked (issue 34).
    headers = [
        (b"x-original-url", b"/v1/load_lora_adapter"),
        (b"x_rewrite_url", b"/sleep"),
        (b"x-http-method-override", b"DELETE"),
        (b"x-forwarded-prefix", b"/admin"),
        (b"content-type", b"application/json"),
    ]
    assert end_to_end(headers) == [(b"content-type", b"application/json")]


# -- memory, in a real router process --------------------------------------------------------


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_keyless_uploads_do_not_grow_the_routers_memory(procs: Procs) -> None:
    # Old code read every body whole before the key check: 30 such uploads held ~540 MiB.
    router = procs.router(
        models_toml({"m": ["http://127.0.0.1:9"]}) + f'\n[auth]\napi_keys = ["{sha("sk-real")}"]\n',
        server="workers = 1\naccess_log = false\n",
        wait=False,
    )
    router.wait_http("/healthz")
    before = _rss_mib(router.popen.pid)
    head = _chat_head(16 * MIB, None)
    body = b"x" * (16 * MIB - 1)  # one byte short: a body that never ends
    socks = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(30)]

    def upload(sock: socket.socket) -> None:
        try:
            sock.sendall(head + body)
        except OSError:
            pass  # refused and closed before the whole body

    threads = [threading.Thread(target=upload, args=(sock,)) for sock in socks]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(timeout=max(0.1, deadline - time.monotonic()))
    grown = _rss_mib(router.popen.pid) - before
    answers = set()
    for sock in socks:
        sock.settimeout(5)
        try:
            answers.add(sock.recv(13))
        except OSError:
            answers.add(b"<reset>")
        sock.close()
    assert grown <= 64, f"RSS grew by {grown:.0f} MiB"
    assert b"HTTP/1.1 401 " in answers
