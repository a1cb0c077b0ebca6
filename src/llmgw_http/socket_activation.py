"""Listening sockets handed over by systemd (socket activation: `sd_listen_fds(3)`).

With conf/systemd/llmgw-server.socket, systemd owns the router's listening socket and
keeps it open across `systemctl restart` (and `Restart=`): connections that arrive
while one process stops and the next starts wait in the socket's backlog instead of
being refused, and the next process accepts them. Without the socket unit (no
LISTEN_FDS for this process) the server binds `[server] listen` itself, as before.

The protocol: LISTEN_PID is this process's id, LISTEN_FDS the number of sockets,
passed as descriptors 3, 4, ...; both variables are removed once read, so that no
process started from here takes them for its own.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

import trio

SD_LISTEN_FDS_START = 3


def inherited_fds(environ: MutableMapping[str, str], pid: int) -> list[int]:
    """The descriptors systemd passed to process `pid` (none when the variables are
    absent or meant for another process); the variables are removed from `environ`.
    Raises ValueError when they are malformed."""
    fds = environ.pop("LISTEN_FDS", None)
    owner = environ.pop("LISTEN_PID", None)
    environ.pop("LISTEN_FDNAMES", None)
    if fds is None or owner is None:
        return []
    try:
        count, owner_pid = int(fds), int(owner)
    except ValueError:
        raise ValueError(f"LISTEN_FDS={fds!r} LISTEN_PID={owner!r} are not numbers") from None
    if owner_pid != pid:
        return []  # set for a parent (a shell, a supervisor) that did not take them
    if count < 0:
        raise ValueError(f"LISTEN_FDS={count} is negative")
    return list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))


def listeners_from(fds: list[int]) -> list[trio.SocketListener]:
    """Each inherited descriptor as a listener. Raises OSError naming one that is not a
    listening TCP socket (a socket unit with a Datagram or FIFO line, say)."""
    listeners = []
    for fd in fds:
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            sock.detach()
            raise OSError(
                f"descriptor {fd} from systemd (LISTEN_FDS) is not a listening TCP socket"
            )
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    return listeners


async def open_listeners(host: str, port: int) -> tuple[list[trio.SocketListener], bool]:
    """The sockets systemd passed (True), else `host:port` bound here (False)."""
    try:
        fds = inherited_fds(os.environ, os.getpid())
    except ValueError as exc:
        raise OSError(f"systemd's socket activation: {exc}") from None
    if fds:
        return listeners_from(fds), True
    return await trio.open_tcp_listeners(port, host=host), False
