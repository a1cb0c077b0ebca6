"""The shared HTTP/1.1 server: keep-alive, pipelining, and websocket upgrades on one port."""

from __future__ import annotations

import pytest
import trio
import trio_websocket

from llmgw_http import sockio
from llmgw_http.h11_connection import H11Connection
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits


async def hello(request: Request, responder: Responder) -> None:
    await responder.whole(200, b"hello " + request.path, [(b"content-type", b"text/plain")])


async def echo_upgrade(request: Request, stream: trio.abc.Stream) -> None:
    async with trio.open_nursery() as nursery:
        ws = await (await trio_websocket.wrap_server_stream(nursery, stream)).accept()
        try:
            while True:
                message = await ws.get_message()
                assert isinstance(message, str)
                await ws.send_message(f"{request.path.decode()} {message}")
        except trio_websocket.ConnectionClosed:
            pass


async def start(nursery: trio.Nursery) -> int:
    server = HTTPServer(hello, ServerLimits(), upgrade=echo_upgrade)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    await nursery.start(server.serve, listeners)
    return int(listeners[0].socket.getsockname()[1])


async def test_http_and_websocket_share_a_port() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await start(nursery)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            # Two pipelined requests on one keep-alive connection.
            await stream.send_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nGET /b HTTP/1.1\r\nhost: x\r\n\r\n")
            received = b""
            while received.count(b"hello") < 2:
                received += await stream.receive_some(65536)
            assert b"hello /a" in received and b"hello /b" in received
            await stream.aclose()
            async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/v1/agent") as ws:
                await ws.send_message("ping")
                assert await ws.get_message() == "/v1/agent ping"
            nursery.cancel_scope.cancel()


async def test_a_tcp_connection_is_served_by_the_plain_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path reads trio's private `SocketStream.socket._sock` (sockio.raw_socket):
    if trio renamed it, every connection would go to h11 and only be slower. This fails then."""

    async def refuse(self: object) -> None:
        raise AssertionError("a plain TCP connection was handed to h11")

    monkeypatch.setattr(H11Connection, "run", refuse)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await start(nursery)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            assert sockio.raw_socket(stream) is not None
            await stream.send_all(b"GET /fast HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            received = b""
            while data := await stream.receive_some(65536):
                received += data
            assert received.startswith(b"HTTP/1.1 200 "), received
            assert received.endswith(b"hello /fast"), received
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_raw_socket_is_the_stream_s_own_socket() -> None:
    with trio.fail_after(10):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        served = await listeners[0].accept()
        for stream in (client, served):
            sock = sockio.raw_socket(stream)
            assert sock is not None
            assert sock.fileno() == stream.socket.fileno()
        await client.aclose()
        await served.aclose()
        await listeners[0].aclose()
