"""Which requests the router relays to a model's replicas, and where their model is named.

Plain decisions on the request's method, path and body, no I/O (issue 21). A relayed
request names its model in its JSON body's `model`, or, for the audio paths, in the
`model` field of its multipart form. Engines' management paths are never relayed,
whatever the body says: they change what an engine serves for every client of it.

A form is read as the engines' parser reads it (python-multipart under starlette, which
vLLM's and SGLang's FastAPI use), or refused (issue 34): where the two could disagree on
the model (two `model` parts, starlette takes the last; a repeated or RFC 2231 parameter,
a charset other than UTF-8), the form is refused before any engine sees it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

from llmgw_core.api_paths import (
    ANTHROPIC_PATHS,
    FORM_PATHS,
    JSON_PATHS,
    is_management,
    path_problem,
)

__all__ = [
    "ANTHROPIC_PATHS",
    "NOT_PLAIN",
    "FormRefused",
    "Kind",
    "Routes",
    "form_boundary",
    "form_model",
]

# A form's model field is short; the head of a part is a few lines.
MAX_MODEL_BYTES = 1024
MAX_PART_HEAD_BYTES = 8 * 1024
# The scan's bounds over a whole form, past which it is refused rather than relayed
# unscanned: an audio form has a handful of parts (vLLM's transcription form has about
# 20 fields), each head under 200 bytes. Scanning 256 parts costs well under a
# millisecond; a 16 MiB body of empty parts would be 1.4M of them.
MAX_FORM_PARTS = 256
MAX_FORM_HEAD_BYTES = 64 * 1024

# RFC 9110 section 5.6.2's token, and a quoted-string without backslash escapes (which
# parsers unescape differently) or control characters: a parameter in any other shape
# makes the form refused.
_TCHAR = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]"
_TYPE = re.compile(rb"[ \t]*(%b+(?:/%b+)?)[ \t]*" % (_TCHAR, _TCHAR))
_PARAM = re.compile(
    rb'[ \t]*;[ \t]*(%b+)[ \t]*=[ \t]*(%b+|"[^"\\\x00-\x08\x0a-\x1f\x7f]*")[ \t]*'
    % (_TCHAR, _TCHAR)
)
_UTF8 = frozenset({b"utf-8", b"utf8"})


# The answer to a path that is not plain (Kind.NOT_PLAIN), with the path after it.
NOT_PLAIN = (
    "a request path must be written plainly, without percent-escapes, backslashes, "
    "empty, '.' or '..' segments or a trailing slash"
)


class FormRefused(ValueError):
    """A form the router will not relay: what is wrong with it, in words (a 400)."""


class Kind(enum.Enum):
    JSON = "json"  # relayed, the model in the JSON body
    FORM = "form"  # relayed, the model in a multipart form field
    MANAGEMENT = "management"  # refused: an engine's own administration
    NOT_PLAIN = "not plain"  # refused (400): a path spelt with escapes, dot segments...
    OTHER = "other"  # answered here, or 404


class Routes:
    """The relayed paths: the built-in ones and `[router] extra_paths` (JSON bodies)."""

    def __init__(self, extra_paths: Iterable[str] = ()) -> None:
        self.json = JSON_PATHS | {p.encode() for p in extra_paths}
        self.relayed = self.json | FORM_PATHS

    def kind(self, path: bytes) -> Kind:
        """The relayed paths are plain (valid_extra_path) and matched exactly, first: a
        path spelt otherwise is never relayed, and is refused as a whole (the path of a
        request the router answers itself is plain too), so no spelling of a management
        path gets past is_management, and the relayed ones pay for none of this."""
        if path in self.json:
            return Kind.JSON
        if path in FORM_PATHS:
            return Kind.FORM
        if path_problem(path) is not None:
            return Kind.NOT_PLAIN
        if is_management(path):
            return Kind.MANAGEMENT
        return Kind.OTHER


def _params(value: bytes, what: str) -> tuple[bytes, dict[bytes, bytes]]:
    """(the lower-cased type, {lower-cased name: unquoted value}) of a header value of the
    shape `type; name=value; ...`, as python-multipart's parse_options_header reads it
    where it is that plain; refused otherwise, and where a parameter is repeated (the
    parser keeps the last) or has a `*` (RFC 2231, which some parser versions decode)."""
    match = _TYPE.match(value)
    if match is None:
        raise FormRefused(f"the {what} header is not of a plain `type; name=value` shape")
    params: dict[bytes, bytes] = {}
    at, end = match.end(), len(value)
    while at < end:
        param = _PARAM.match(value, at)
        if param is None:
            raise FormRefused(f"the {what} header is not of a plain `type; name=value` shape")
        at = param.end()
        name, v = param.group(1).lower(), param.group(2)
        if name in params:
            raise FormRefused(f"the {what} header names its {name.decode()!r} more than once")
        if b"*" in name:
            raise FormRefused(f"the {what} header has an RFC 2231 parameter ({name.decode()!r})")
        params[name] = v[1:-1] if v[:1] == b'"' else v
    return match.group(1).lower(), params


def form_boundary(content_type: bytes | None) -> bytes:
    """The boundary of a multipart/form-data Content-Type (RFC 7578); FormRefused where
    it is no such type, or names its charset as other than UTF-8 (starlette decodes the
    form's field names and values in that charset)."""
    if content_type is None:
        raise FormRefused("the request body must be multipart/form-data")
    kind, params = _params(content_type, "Content-Type")
    if kind != b"multipart/form-data":
        raise FormRefused("the request body must be multipart/form-data")
    charset = params.get(b"charset")
    if charset is not None and charset.lower() not in _UTF8:
        raise FormRefused("a multipart form's charset must be UTF-8")
    boundary = params.get(b"boundary", b"")
    if not 0 < len(boundary) <= 70:  # RFC 2046 section 5.1.1: 1 to 70 characters
        raise FormRefused(
            "a multipart/form-data Content-Type needs a boundary of 1 to 70 characters"
        )
    return boundary


def form_model(content_type: bytes | None, body: bytes) -> str | None:
    """The value of the form's `model` field, or None when its one form has none;
    FormRefused for a form that is broken, past the scan's bounds, or that the engine's
    parser could read otherwise. Only the parts' heads are parsed; each part's content is
    skipped by `bytes.find` (C), so the cost is linear in the body and small."""
    boundary = form_boundary(content_type)
    delimiter = b"--" + boundary
    if not body.startswith(delimiter):
        raise FormRefused("the form does not begin with its boundary")
    next_delimiter = b"\r\n" + delimiter
    at = len(delimiter)  # just past a delimiter
    parts = head_bytes = 0
    model: str | None = None
    while not body.startswith(b"--", at):  # the close delimiter ends the form
        if not body.startswith(b"\r\n", at):
            raise FormRefused("a form boundary is followed by neither a line end nor --")
        parts += 1
        if parts > MAX_FORM_PARTS:
            raise FormRefused(f"the form has more than {MAX_FORM_PARTS} parts")
        # From the delimiter's own CRLF, so that an empty head ends at once.
        head_end = body.find(b"\r\n\r\n", at, at + 4 + MAX_PART_HEAD_BYTES)
        if head_end < 0:
            raise FormRefused(
                f"a form part's head is unfinished or over {MAX_PART_HEAD_BYTES} bytes"
            )
        head_bytes += head_end - at
        if head_bytes > MAX_FORM_HEAD_BYTES:
            raise FormRefused(f"the form's part heads are over {MAX_FORM_HEAD_BYTES} bytes")
        value_start = head_end + 4
        end = body.find(next_delimiter, value_start)
        if end < 0:
            raise FormRefused("the form does not end with its closing boundary")
        if _part_name(body[at + 2 : head_end]) == b"model":
            if model is not None:
                raise FormRefused("the form names its model more than once")
            model = _model_value(body[value_start:end])
        at = end + len(next_delimiter)
    return model


def _part_name(head: bytes) -> bytes:
    """The `name` of a part's one Content-Disposition: form-data header."""
    disposition = None
    for line in head.split(b"\r\n"):
        header, _, value = line.partition(b":")
        if header.lower() == b"content-disposition":
            if disposition is not None:
                raise FormRefused("a form part has more than one Content-Disposition")
            disposition = value
    if disposition is None:
        raise FormRefused("a form part has no Content-Disposition")
    kind, params = _params(disposition, "Content-Disposition")
    if kind != b"form-data":
        raise FormRefused("a form part's Content-Disposition is not form-data")
    name = params.get(b"name")
    if name is None:  # starlette refuses such a form
        raise FormRefused("a form part has no name")
    if name == b"model" and b"filename" in params:
        raise FormRefused("the form's model is a file")
    return name


def _model_value(value: bytes) -> str:
    if len(value) > MAX_MODEL_BYTES:
        raise FormRefused(f"the form's model is over {MAX_MODEL_BYTES} bytes")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise FormRefused("the form's model is not UTF-8") from None
