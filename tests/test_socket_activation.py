"""Sockets handed over by systemd (LISTEN_FDS): read only when meant for this process,
and only listening TCP sockets taken. The whole restart: tests/test_restart_e2e.py."""

from __future__ import annotations

import socket

import pytest

from llmgw_http.socket_activation import inherited_fds, listeners_from


def test_the_descriptors_are_taken_only_when_meant_for_this_process() -> None:
    environ = {"LISTEN_FDS": "2", "LISTEN_PID": "42", "LISTEN_FDNAMES": "a:b", "HOME": "/"}
    assert inherited_fds(environ, 42) == [3, 4]
    assert environ == {"HOME": "/"}  # read once: no child takes them for its own
    assert inherited_fds({"LISTEN_FDS": "1", "LISTEN_PID": "41"}, 42) == []  # a parent's
    assert inherited_fds({"LISTEN_FDS": "1"}, 42) == []
    assert inherited_fds({}, 42) == []


@pytest.mark.parametrize("fds, pid", [("x", "42"), ("1", "me"), ("-1", "42")])
def test_malformed_variables_are_an_error(fds: str, pid: str) -> None:
    with pytest.raises(ValueError, match="LISTEN_FDS"):
        inherited_fds({"LISTEN_FDS": fds, "LISTEN_PID": pid}, 42)


def test_a_descriptor_that_is_not_a_listening_tcp_socket_is_refused() -> None:
    with socket.socket() as unbound, socket.socket(type=socket.SOCK_DGRAM) as datagram:
        for sock in (unbound, datagram):
            with pytest.raises(OSError, match="not a listening TCP socket"):
                listeners_from([sock.fileno()])
            sock.getsockname()  # still open: refused, not closed under its owner


async def test_a_listening_socket_is_served() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        (listener,) = listeners_from([socket.dup(sock.fileno())])
        assert listener.socket.getsockname() == sock.getsockname()
        listener.socket.close()
