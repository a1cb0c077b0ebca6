"""A JSON text frame read as one member of a tagged union (its `type` names which), the
way both streams read theirs: the agents' (`wire`) and the route feed's. Every failure,
from a binary frame to a field of the wrong type, is the stream's own error, worded for
the peer."""

from __future__ import annotations

import json
from typing import Any

import cattrs


def decode_tagged(
    frame: str | bytes,
    union: Any,
    known: frozenset[str],
    *,
    converter: cattrs.Converter,
    error: type[Exception],
    protocol: str,
    max_chars: int,
) -> Any:
    """`frame` structured as the member of `union` its `type` names (one of `known`);
    `error` raised with a reason where it cannot be. `protocol` names the stream in the
    reason a binary frame gets."""
    if isinstance(frame, bytes):
        raise error(f"binary frames are not part of {protocol}; send JSON text")
    if len(frame) > max_chars:
        raise error(f"a frame of {len(frame)} characters exceeds {max_chars}")
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError) as exc:
        raise error(f"the frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error("a frame must be a JSON object")
    tag = data.get("type")
    if not isinstance(tag, str) or tag not in known:
        raise error(f"unknown message type {tag!r} (expected one of {', '.join(sorted(known))})")
    try:
        return converter.structure(data, union)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise error(f"a {tag!r} frame is malformed: {describe(exc)}") from None


def describe(exc: BaseException) -> str:
    """Why a frame's fields could not be structured, with their paths."""
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="frame"))
    return f"{type(exc).__name__}: {exc}"
