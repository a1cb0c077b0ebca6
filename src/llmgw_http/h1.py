"""HTTP/1.1 framing on both sides of the router, as plain functions over bytes.

One grammar (RFC 9112), written once: a client's request head as the server's fast path
reads it, the heads the server writes, the request the router writes to an engine, the
engine's answer head and how its body is framed, and the chunked framing's lines (read
by `chunked.ChunkScanner`). No trio, no sockets: each is fed bytes and tested from bytes.

The two directions are read to different strictness on purpose. A client's head is
read here only where h11 would read it the same way (tests/test_plain_http.py and
tests/test_fuzz_http.py hold it to that); anything else goes to h11, which serves or
refuses it. An engine's head is read stricter than h11 reads it (an engine may be
buggy or taken over): an answer h11 refuses is never relayed
(tests/test_fuzz_engine_framing.py holds it to that).
"""

from __future__ import annotations

import re
from typing import Literal

from llmgw_core.openai_errors import error_body
from llmgw_http.request import Request

JSON = [(b"content-type", b"application/json")]

# RFC 9110 section 5.6.2: a header name, a method, a chunk extension's name.
TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
# RFC 9110 section 5.6.4, for a chunk extension's value.
QUOTED_STRING = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
# A Content-Length either side reads: one length of 18 digits at most (below 2**63, and
# far beyond any body): no list ("107, 107"), sign, space or 5,000-digit number.
_LENGTH = re.compile(rb"[0-9]{1,18}")
_TOKEN = re.compile(TOKEN)

# --- A client's request (the server's fast path) ----------------------------------

# Where h11 ends a request head (it also takes bare LF line ends).
REQUEST_HEAD_END = re.compile(rb"\n\r?\n")
_REQUEST_LINE = re.compile(rb"(%b) ([\x21-\x7e]+) HTTP/1\.1" % TOKEN)
# Requests the plain parser leaves to h11: their framing or semantics need its state machine.
_TO_H11 = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# Every field line at once (one match instead of two per line): a name, a colon, a value
# with nothing h11 would refuse. A head it does not match goes to h11 whole.
_REQUEST_FIELDS = re.compile(rb"(?:%b:[^\x00\r\n\x0b\x0c]*(?:\r\n|\Z))+" % TOKEN)
_SPECIAL = frozenset({b"content-length", b"host", b"connection", *_TO_H11})


def plain_request(head: bytes) -> tuple[Request, int, bool] | None:
    """(request, content length, whether the client asked to close) of a request head
    (without its blank line) that the plain parser serves: HTTP/1.1, one Host, at most
    one Content-Length, no Transfer-Encoding, Expect or Upgrade, nothing h11 would refuse
    or read otherwise. None: h11 reads it (and refuses it with its own words where it is
    malformed)."""
    line_end = head.find(b"\r\n")
    if line_end < 0:
        return None  # no Host
    match = _REQUEST_LINE.fullmatch(head, 0, line_end)
    if match is None or not _REQUEST_FIELDS.fullmatch(head, line_end + 2):
        return None  # also an obsolete folded line (it starts with a space)
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    hosts = 0
    close = False
    for line in head[line_end + 2 :].split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        if name in _SPECIAL:
            if name in _TO_H11:
                return None
            if name == b"content-length":
                if length >= 0 or not _LENGTH.fullmatch(value):
                    return None
                length = int(value)
            elif name == b"host":
                hosts += 1
            else:
                close = close or any(t.strip().lower() == b"close" for t in value.split(b","))
        headers.append((name, value))
    if hosts != 1:
        return None
    request = Request(method=match.group(1), target=match.group(2), headers=headers)
    return request, max(length, 0), close


# --- What the server writes ---------------------------------------------------------


def has_body_length(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer's end is known without chunked framing (h11's _body_framing)."""
    if status < 200 or status in (204, 304):
        return True
    return any(name == b"content-length" for name, _ in headers)


def response_head(
    status: int, headers: list[tuple[bytes, bytes]], peer_closing: bool = False
) -> bytes:
    """The status line and headers, written as h11 writes them (no reason phrase; to a
    client that asked to close, its Connection header values, close among them, last)."""
    if peer_closing:
        tokens = {b"close"}
        kept = []
        for name, value in headers:
            if name.lower() == b"connection":
                tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
            else:
                kept.append((name, value))
        tokens.discard(b"keep-alive")
        headers = [*kept, *((b"Connection", t) for t in sorted(tokens))]
    lines = [b"HTTP/1.1 %d \r\n" % status]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def refusal(status: int, message: str, headers: list[tuple[bytes, bytes]] = JSON) -> bytes:
    """A whole answer that closes the connection, as the server writes its own refusals."""
    body = error_body(status, message)
    length = (b"content-length", str(len(body)).encode())
    return response_head(status, [*headers, length, (b"connection", b"close")]) + body


# --- The router's request to an engine ---------------------------------------------


def request_bytes(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """A request the router built itself (its headers already checked), with its body."""
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines += (b"\r\n", body)
    return b"".join(lines)


# --- An engine's answer --------------------------------------------------------------

RESPONSE_HEAD_END = re.compile(rb"\r?\n\r?\n")
MAX_RESPONSE_HEAD = 16 * 1024  # a response head longer than this is garbage (h11's limit too)
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9]{2})(?: [^\r\n]*)?")  # 100 to 599
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# Every header line at once, as engines write them: a token, a colon, a value with no
# control character but tab; CRLF or LF between lines. Anything else is read line by line.
_RESPONSE_FIELDS = re.compile(rb"(?:%b:[^\x00-\x08\x0a-\x1f\x7f]*(?:\r?\n|\Z))*" % TOKEN)

Framing = Literal["length", "chunked", "close"]


class BadHead(ValueError):
    """What makes a response head unreadable, in words."""


def parse_response_head(head: bytes) -> tuple[int, bool, list[tuple[bytes, bytes]]]:
    """(status, whether HTTP/1.1, headers with lower-case names) of a response head
    (without its blank line)."""
    lines = head.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    match = _STATUS_LINE.fullmatch(status_line)
    if match is None:
        raise BadHead(f"bad status line {status_line[:40]!r} (the status must be 100 to 599)")
    status, http11 = int(match.group(2)), match.group(1) == b"1"
    if _RESPONSE_FIELDS.fullmatch(head, len(lines[0]) + 1):  # as engines write heads
        return status, http11, [_field(line) for line in lines[1:]]
    headers: list[tuple[bytes, bytes]] = []
    for raw in lines[1:]:
        line = raw.rstrip(b"\r")
        if line[:1] in (b" ", b"\t"):  # an obsolete folded line continues the last header
            if not headers:
                raise BadHead("a continuation line with no header before it")
            name, value = headers[-1]
            headers[-1] = (name, value + b" " + line.strip(b" \t"))
            continue
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise BadHead(f"bad header line {line[:40]!r}")
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            raise BadHead(f"bad value of the header {name[:40]!r}")
        headers.append((name.lower(), value))
    return status, http11, headers


def _field(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.lower(), value.strip(b" \t\r")


def response_framing(
    status: int, headers: list[tuple[bytes, bytes]], head_only: bool
) -> tuple[Framing, int, bool]:
    """How the body is delimited (RFC 9112 section 6.3): ("length", n), ("chunked", 0) or
    ("close", 0), and whether the connection may be reused after it.

    With Transfer-Encoding, a Content-Length is ignored (and the connection not reused:
    the answer may be an attempt at smuggling). More than one Content-Length, even
    identical ones, is garbage, as is a value that is not 1 to 18 digits.
    """
    if head_only or status in (204, 304):
        return "length", 0, True
    length = -1
    chunked = False
    for name, value in headers:
        if name == b"transfer-encoding":
            if value.lower() != b"chunked" or chunked:
                raise BadHead(f"unsupported transfer-encoding {value[:40]!r}")
            chunked = True
        elif name == b"content-length":
            if length >= 0:
                raise BadHead("more than one content-length")
            if not _LENGTH.fullmatch(value):
                raise BadHead(f"bad content-length {value[:40]!r}")
            length = int(value)
    if chunked:
        return "chunked", 0, length < 0
    if length >= 0:
        return "length", length, True
    return "close", 0, True


def keep_alive_timeout(headers: list[tuple[bytes, bytes]]) -> float | None:
    """The `timeout=N` of a `Keep-Alive` response header, if the engine sent one."""
    for key, value in headers:
        if key == b"keep-alive":
            for part in value.split(b","):
                name, _, number = part.strip().partition(b"=")
                if name.strip().lower() == b"timeout":
                    try:
                        timeout = float(number.strip())
                    except ValueError:
                        return None
                    return timeout if timeout >= 0 else None
    return None


# --- Chunked framing (RFC 9112 section 7.1), read by chunked.ChunkScanner ------------

# 16 hex digits at most: no 0x, _, signs or spaces (int() would take some of those); then
# extensions `;name` or `;name=value` (a token, or a quoted-string); CRLF only.
CHUNK_SIZE_LINE = re.compile(
    rb"([0-9A-Fa-f]{1,16})(?:;%b(?:=(?:%b|%b))?)*\r\n" % (TOKEN, TOKEN, QUOTED_STRING)
)
TRAILER_LINE = re.compile(rb"%b:[^\x00-\x08\x0a-\x1f\x7f]*\r\n" % TOKEN)
