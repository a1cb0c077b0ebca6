"""A JSON text frame read as one member of a tagged union (its `type` names which), the
way both streams read theirs: the agents' (`wire`) and the route feed's. Every failure,
from a binary frame to a field of the wrong type, is the stream's own error, worded for
the peer."""

from __future__ import annotations

import json
from typing import Any

import attrs
import cattrs


@attrs.frozen
class TaggedFrames:
    """One stream's frames: structured by its `converter`, refused with its `error`;
    `protocol` names the stream where a binary frame is refused."""

    converter: cattrs.Converter
    error: type[Exception]
    protocol: str
    max_chars: int

    def decode(self, frame: str | bytes, union: Any, known: frozenset[str]) -> Any:
        """`frame` structured as the member of `union` its `type` names (one of `known`);
        `error` raised with a reason where it cannot be."""
        error = self.error
        if isinstance(frame, bytes):
            raise error(f"binary frames are not part of {self.protocol}; send JSON text")
        if len(frame) > self.max_chars:
            raise error(f"a frame of {len(frame)} characters exceeds {self.max_chars}")
        try:
            data = json.loads(frame)
        except (ValueError, RecursionError) as exc:
            raise error(f"the frame is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise error("a frame must be a JSON object")
        tag = data.get("type")
        if not isinstance(tag, str) or tag not in known:
            expected = ", ".join(sorted(known))
            raise error(f"unknown message type {tag!r} (expected one of {expected})")
        try:
            return self.converter.structure(data, union)
        except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise error(f"a {tag!r} frame is malformed: {describe(exc)}") from None


def describe(exc: BaseException) -> str:
    """Why a frame's fields could not be structured, with their paths."""
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="frame"))
    return f"{type(exc).__name__}: {exc}"
