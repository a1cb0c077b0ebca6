"""Whether a leader's process is gone, asked of its host's kernel.

A SIGKILLed or crashed leader leaves its key in the store until its lease ends (the
lease's TTL, 2-10 s), while every agent saw its stream end at once. A standby told so by
the agents it holds (LOST_LEADER_HEADER) connects to the leader's control port: a refusal
(a TCP reset) comes from a kernel with nothing listening there, so that process no longer
runs and cannot act; the standby then ends that leadership in the store (a guarded delete
of its key, Election.depose) and the election goes on at once. Anything else (an answer,
a timeout: a frozen process, a lost host, a cut link) proves nothing, and the lease
decides as before."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import trio

# The connect's wait: a refusal comes within a round trip; silence proves nothing.
PROBE_S = 1.0
# The shortest time between two checks of one leadership: peers say the leader is lost
# in bursts (a fleet at once), and one that still answered may die a moment later.
RECHECK_S = 1.0


async def refuses_connections(url: str, timeout_s: float = PROBE_S) -> bool:
    """True when every address of `url`'s host refused a TCP connection to its port
    within `timeout_s`; False on any answer, timeout or other error."""
    parts = urlsplit(url)
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme in ("wss", "https") else 80)
    except ValueError:
        return False
    if not host:
        return False
    with trio.move_on_after(timeout_s):
        try:
            found = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return False
        if not found:
            return False
        for family, kind, proto, _, address in found:
            sock = trio.socket.socket(family, kind, proto)
            with sock:
                try:
                    await sock.connect(address)
                except ConnectionRefusedError:
                    continue
                except OSError:
                    return False
                return False  # something listens there
        return True
    return False
