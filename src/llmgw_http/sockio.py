"""Reads and writes on a plain TCP socket without trio's per-call scheduling.

trio's SocketStream yields to the scheduler after every send that completes at
once, and tries a read before every wait even where the socket was just drained.
On the router's hot paths (a request, a relayed chunk) that is a scheduler pass
and a failed system call each time. These call the stdlib socket that trio
wraps directly and wait (through trio) only when it would block; a read or write
that did not wait yields once, so a peer that always has data cannot starve the
other tasks. Errors are trio's stream errors, as SocketStream raises them.
"""

from __future__ import annotations

import errno
import socket

import trio


def raw_socket(stream: trio.abc.Stream) -> socket.socket | None:
    """The stdlib socket under a plain trio.SocketStream; None for any other stream (TLS)."""
    if type(stream) is trio.SocketStream:
        sock = getattr(stream.socket, "_sock", None)  # trio's own wrapped socket
        if isinstance(sock, socket.socket):
            return sock
    return None


_TCP_GONE = {7, 8}  # Linux tcpi_state: TCP_CLOSE (reset), TCP_CLOSE_WAIT (the peer's FIN)


def peer_left(sock: socket.socket | trio.socket.SocketType) -> bool:
    """The peer closed or reset the connection (seen in the kernel's TCP state, without
    reading: bytes it sent before leaving stay unread)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except (OSError, AttributeError):
        return False
    return info[0] in _TCP_GONE


def _stream_error(exc: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    if exc.errno == errno.EBADF:
        return trio.ClosedResourceError("the socket was closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


async def send_all(sock: socket.socket, data: bytes | bytearray | memoryview) -> None:
    """Everything in `data`, waiting for room only when the kernel's buffer is full."""
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError as exc:
        raise _stream_error(exc) from exc
    if sent == len(data):
        return
    view = memoryview(data)
    while sent < len(view):
        await trio.lowlevel.wait_writable(sock)
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            pass
        except OSError as exc:
            raise _stream_error(exc) from exc


async def receive_some(sock: socket.socket, max_bytes: int, *, wait_first: bool = False) -> bytes:
    """One read of up to `max_bytes` (b"" at end of file).

    `wait_first`: the caller drained the socket on its last read, so the read that would
    fail is skipped and the wait comes first.
    """
    waited = False
    if wait_first:
        await trio.lowlevel.wait_readable(sock)
        waited = True
    while True:
        try:
            data = sock.recv(max_bytes)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            waited = True
            continue
        except OSError as exc:
            raise _stream_error(exc) from exc
        if not waited:  # shielded: the bytes read are never lost to a cancellation
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data


def send_now(sock: socket.socket, data: bytes | bytearray | memoryview) -> int:
    """What of `data` the kernel takes at once (0 when its buffer is full); never waits."""
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        raise _stream_error(exc) from exc
