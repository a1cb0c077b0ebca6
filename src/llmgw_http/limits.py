"""What the server holds a client's request to: its limits, and the rules a request
body's pace is judged by (plain functions of counts and time)."""

from __future__ import annotations

import attrs

# A request body's first seconds are not held to `min_body_rate` (a client's first write
# may wait on its own start); from then on it is checked this often.
BODY_RATE_GRACE_S = 5.0
BODY_RATE_CHECK_S = 1.0
# Past its first pieces, a request body (its chunks, or what each read brings) must
# average this many bytes a piece: h11's cost is per piece, and 1-byte chunks would
# spend most of a core on a body that meets any byte rate.
BODY_FREE_PIECES = 1024
BODY_PIECE_MIN_AVERAGE = 64


@attrs.frozen
class ServerLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    # Connections on plain listeners served at once; past it a new one is answered 503
    # and closed. None: no limit.
    max_connections: int | None = None
    # A request body must average at least this many bytes/s since its start, from
    # BODY_RATE_GRACE_S on (408 otherwise); 0: no minimum.
    min_body_rate: int = 1024


def head_too_large(limits: ServerLimits) -> str:
    return f"request head exceeds the limit of {limits.max_header_bytes} bytes"


def too_slow(limits: ServerLimits) -> str:
    return f"request body arrived slower than the minimum of {limits.min_body_rate} bytes/s"


def pieces_too_small(pieces: int, received: int) -> bool:
    """Whether a request body that came in `pieces` h11 events is cut for its overhead."""
    return pieces > BODY_FREE_PIECES and received < BODY_PIECE_MIN_AVERAGE * pieces


def body_too_slow(received: int, elapsed_s: float, min_rate: int) -> bool:
    """Whether a request body that brought `received` bytes in its first `elapsed_s` is
    cut: past the grace, it must have averaged `min_rate` bytes/s since its start."""
    return elapsed_s >= BODY_RATE_GRACE_S and received < min_rate * elapsed_s
