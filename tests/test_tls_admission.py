"""The control port's TLS handshakes in a registration storm: a client that gave up
while it waited to be served costs no handshake (it is seen to have left)."""

from __future__ import annotations

import trio

from llmgw_core.http_server import _peer_left


async def test_a_client_that_closed_or_reset_is_seen_to_have_left() -> None:
    with trio.fail_after(10):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        staying = await trio.open_tcp_stream("127.0.0.1", port)
        leaving = await trio.open_tcp_stream("127.0.0.1", port)
        first = await listeners[0].accept()
        second = await listeners[0].accept()
        assert not _peer_left(first) and not _peer_left(second)
        await leaving.aclose()  # a FIN, as a client's connect timeout sends
        while not _peer_left(second):
            await trio.sleep(0.01)
        assert not _peer_left(first)
        for stream in (staying, first, second, *listeners):
            await stream.aclose()
