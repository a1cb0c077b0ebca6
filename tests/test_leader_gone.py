"""Whether a leader's process is gone (control_shell.leader_gone), over real sockets: a
port nothing listens on refuses; a listening port, even one whose process never accepts
(a frozen leader: its kernel still completes the handshake), proves nothing; nor does a
URL without a host."""

from __future__ import annotations

import socket

import trio

from llmgw_server.control_shell.leader_gone import refuses_connections


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_port_nothing_listens_on_refuses() -> None:
    with trio.fail_after(5):
        assert await refuses_connections(f"wss://127.0.0.1:{free_port()}")


async def test_a_listening_port_even_one_never_accepting_proves_nothing() -> None:
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)  # nobody ever accepts: a stopped process's kernel still answers
        port = frozen.getsockname()[1]
        with trio.fail_after(5):
            assert not await refuses_connections(f"wss://127.0.0.1:{port}")
            assert not await refuses_connections(f"ws://127.0.0.1:{port}/v1/agent")


async def test_no_host_or_a_bad_port_proves_nothing() -> None:
    with trio.fail_after(5):
        assert not await refuses_connections("wss:///v1/agent")
        assert not await refuses_connections("wss://127.0.0.1:99999")
        assert not await refuses_connections("wss://no-such-host.invalid:8081")
