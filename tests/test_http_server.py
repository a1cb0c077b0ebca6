"""The shared HTTP/1.1 server: keep-alive, pipelining, and websocket upgrades on one port."""

from __future__ import annotations

import trio
import trio_websocket

from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits


async def hello(request: Request, responder: Responder) -> None:
    await responder.whole(200, b"hello " + request.path, [(b"content-type", b"text/plain")])


async def echo_upgrade(request: Request, stream: trio.abc.Stream) -> None:
    async with trio.open_nursery() as nursery:
        ws = await (await trio_websocket.wrap_server_stream(nursery, stream)).accept()
        try:
            while True:
                message = await ws.get_message()
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
