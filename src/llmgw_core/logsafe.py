"""Peers' words in our log: escaped, so that one event stays one line whatever they send.

A node (or a router, or a client) chooses the text of a failure detail, an ack error,
its own name. Written raw, a newline starts a forged log line and an ANSI escape
rewrites the operator's terminal. `escaped` writes what is not printable as `repr`
does (`\\n`, `\\x1b`, `\\u2028`), backslashes doubled so that a literal `\\n` cannot pass
for an escaped newline, without quotes, and cuts the text at `limit` characters.
"""

from __future__ import annotations

import re

LIMIT = 1000  # characters of one peer's string in one log line

# Anything but printable ASCII, or a backslash: only such text needs the slow path.
_SUSPECT = re.compile(r"[^\x20-\x5b\x5d-\x7e]")


def escaped(text: object, limit: int = LIMIT) -> str:
    """`text` fit for one log line: non-printable characters and backslashes escaped as
    `repr` writes them, at most `limit` characters of it kept (the rest counted). Bytes
    (a header's value) are read as Latin-1, as h11 reads them; anything else is str()."""
    if isinstance(text, bytes):
        value = text.decode("latin-1")
    else:
        value = text if isinstance(text, str) else str(text)
    cut = len(value) - limit
    if cut > 0:
        value = value[:limit]
    if _SUSPECT.search(value) is not None:
        value = "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in value)
    return f"{value}... ({cut} more characters)" if cut > 0 else value


def peer_address(stream: object) -> tuple[str, str]:
    """A connection's peer: its host, and its host:port for the log; ("?", "an unknown
    peer") where the stream has no socket or its peer is gone."""
    try:
        host, port, *_ = stream.socket.getpeername()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return "?", "an unknown peer"
    return str(host), f"{host}:{port}"
