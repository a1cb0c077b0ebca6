"""Which requests the router relays to a model's replicas, and where their model is named.

Plain decisions on the request's method, path and body, no I/O (issue 21). A relayed
request names its model in its JSON body's `model`, or, for the audio paths, in the
`model` field of its multipart form. Engines' management paths are never relayed,
whatever the body says: they change what an engine serves for every client of it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from llmgw_core.api_paths import ANTHROPIC_PATHS, FORM_PATHS, JSON_PATHS, MANAGEMENT_PATHS

__all__ = ["ANTHROPIC_PATHS", "Kind", "Routes", "form_boundary", "form_model"]

# A form's model field is short; the head of a part is a few lines.
MAX_MODEL_BYTES = 1024
MAX_PART_HEAD_BYTES = 8 * 1024


class Kind(enum.Enum):
    JSON = "json"  # relayed, the model in the JSON body
    FORM = "form"  # relayed, the model in a multipart form field
    MANAGEMENT = "management"  # refused: an engine's own administration
    OTHER = "other"  # answered here, or 404


class Routes:
    """The relayed paths: the built-in ones and `[router] extra_paths` (JSON bodies)."""

    def __init__(self, extra_paths: Iterable[str] = ()) -> None:
        self.json = JSON_PATHS | {p.encode() for p in extra_paths}
        self.relayed = self.json | FORM_PATHS

    def kind(self, path: bytes) -> Kind:
        if path in self.json:
            return Kind.JSON
        if path in FORM_PATHS:
            return Kind.FORM
        if path in MANAGEMENT_PATHS:
            return Kind.MANAGEMENT
        return Kind.OTHER


def form_boundary(content_type: bytes | None) -> bytes | None:
    """The boundary of a multipart/form-data Content-Type (RFC 7578), or None."""
    if content_type is None:
        return None
    kind, _, params = content_type.partition(b";")
    if kind.strip().lower() != b"multipart/form-data":
        return None
    for param in params.split(b";"):
        name, _, value = param.strip().partition(b"=")
        if name.strip().lower() == b"boundary":
            value = value.strip()
            if len(value) >= 2 and value[:1] == value[-1:] == b'"':
                value = value[1:-1]
            # RFC 2046 5.1.1: 1 to 70 characters.
            return value if 0 < len(value) <= 70 else None
    return None


def form_model(boundary: bytes, body: bytes) -> str | None:
    """The value of the form's `model` field, or None when it has none (or the body is no
    such form). Only the parts' heads are read, each at most MAX_PART_HEAD_BYTES, and the
    model's value at most MAX_MODEL_BYTES: a file part's content is skipped, not parsed."""
    delimiter = b"--" + boundary
    at = body.find(delimiter)
    while at >= 0:
        head_start = at + len(delimiter)
        if body[head_start : head_start + 2] != b"\r\n":
            return None  # "--boundary--" ends the form (or the form is broken)
        head_start += 2
        head_end = body.find(b"\r\n\r\n", head_start, head_start + MAX_PART_HEAD_BYTES)
        if head_end < 0:
            return None
        value_start = head_end + 4
        at = body.find(b"\r\n" + delimiter, value_start)
        if at < 0:
            return None
        if _field_name(body[head_start:head_end]) == b"model":
            value = body[value_start:at]
            if len(value) > MAX_MODEL_BYTES:
                return None
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                return None
        at += 2
    return None


def _field_name(head: bytes) -> bytes | None:
    """The `name` of a part's Content-Disposition: form-data header."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"content-disposition":
            continue
        kind, _, params = value.partition(b";")
        if kind.strip().lower() != b"form-data":
            return None
        for param in params.split(b";"):
            key, _, v = param.strip().partition(b"=")
            if key.strip().lower() == b"name":
                v = v.strip()
                return v[1:-1] if len(v) >= 2 and v[:1] == v[-1:] == b'"' else v
    return None
