"""The access log's content: one record per request, written as one logfmt or JSON line.

Pure: records in, text out. The router fills a record while it answers
(llmgw_server.router.recorder) and a writer puts the lines out.
"""

from __future__ import annotations

import json
import re
import time
from typing import NamedTuple, TypeGuard

import attrs

FORMATS = ("logfmt", "json")
REQUEST_ID_MAX = 128
_TEXT_MAX = 256  # a client's model name or path is its own text: bounded in the log
_USAGE_WINDOW = 4096  # a usage object is a few hundred bytes
_NEEDS_QUOTES = re.compile(r'[^\x21-\x7e]|["=\\]')
_USAGE_KEY = b'"usage"'
_decoder = json.JSONDecoder()


@attrs.define(slots=True)
class AccessRecord:
    """What one request did, filled in as it is answered."""

    started: float  # wall-clock time (time.time()) when the request arrived
    request_id: str
    method: str
    path: str
    key_id: str | None = None  # see key_id_of; None: the client sent no key
    tenant: str | None = None  # whose limits it counts against (tenancy_config); None: unrouted
    model: str | None = None  # as the client asked for it, None until read
    replica: str | None = None  # the engine's URL, None when none was tried
    status: int = 0  # 0: the client went away before the answer ended
    duration_s: float = 0.0
    ttfb_s: float | None = None  # until the first byte of the body went to the client
    bytes_sent: int = 0  # body bytes written to the client
    prompt_tokens: int | None = None  # from the engine's usage, when it sent one
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, where the engine's usage says (unlogged)
    queued_s: float | None = None  # held while no replica served its model, or in a fair queue
    # The prompt tokens the chosen engine should find cached, by its KV-cache events
    # (balancing = "precise"); None otherwise.
    cached_predicted: int | None = None
    # Times its stream went on from another replica after its engine broke it (0: never).
    migrated: int = 0


def key_id_of(digest_hex: str) -> str:
    """A short, public id of an API key: the first 8 hex digits of its SHA-256 digest,
    as it is written in [auth] after "sha256:". Never the key itself."""
    return digest_hex[:8]


def valid_request_id(value: bytes | None) -> str | None:
    """The client's x-request-id when it is printable ASCII without spaces and at most
    REQUEST_ID_MAX long; None otherwise (the router then makes its own)."""
    if not value or len(value) > REQUEST_ID_MAX:
        return None
    if not value.isascii():
        return None
    text = value.decode("ascii")
    return text if text.isprintable() and " " not in text else None


def logfmt_value(value: str | None) -> str:
    """A logfmt value: as it is when it needs no quotes, else a JSON string; None is -."""
    if value is None:
        return "-"
    if value and not _NEEDS_QUOTES.search(value):
        return value
    return json.dumps(value)  # quoted, with quotes, backslashes and controls escaped


def _repeating(value: str | None) -> str:
    """logfmt_value of a value that repeats from line to line (a method, path, model,
    replica or key id), each worked out once. Bounded (a client chooses its paths and
    model names): forgotten all at once when full."""
    known = _SEEN.get(value)
    if known is None:
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()
        known = _SEEN[value] = logfmt_value(value)
    return known


_SEEN: dict[str | None, str] = {}
_SEEN_MAX = 1024


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.3f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


_second_cache: tuple[int, str] = (-1, "")


def timestamp(wall: float) -> str:
    """RFC 3339 in UTC with milliseconds; the seconds part is formatted once a second."""
    global _second_cache
    second = int(wall)
    if _second_cache[0] != second:
        _second_cache = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{_second_cache[1]}.{int((wall - second) * 1000):03d}Z"


def _bounded(text: str | None) -> str | None:
    """A client's text (a model name, a path), cut short for the log."""
    return text if text is None or len(text) <= _TEXT_MAX else text[:_TEXT_MAX] + "..."


def format_logfmt(record: AccessRecord) -> str:
    return (
        f"time={timestamp(record.started)} request_id={logfmt_value(record.request_id)} "
        f"method={_repeating(record.method)} path={_repeating(_bounded(record.path))} "
        f"model={_repeating(_bounded(record.model))} status={record.status} "
        f"replica={_repeating(record.replica)} duration_ms={_ms(record.duration_s)} "
        f"ttfb_ms={_ms(record.ttfb_s)} bytes={record.bytes_sent} "
        f"key_id={_repeating(record.key_id)} tenant={_repeating(record.tenant)} "
        f"prompt_tokens={_count(record.prompt_tokens)} "
        f"completion_tokens={_count(record.completion_tokens)} "
        f"queued_ms={_ms(record.queued_s)} cached_predicted={_count(record.cached_predicted)} "
        f"migrated={record.migrated}\n"
    )


def format_json(record: AccessRecord) -> str:
    ttfb = record.ttfb_s
    line = {
        "time": timestamp(record.started),
        "request_id": record.request_id,
        "method": record.method,
        "path": _bounded(record.path),
        "model": _bounded(record.model),
        "status": record.status,
        "replica": record.replica,
        "duration_ms": round(record.duration_s * 1000, 3),
        "ttfb_ms": None if ttfb is None else round(ttfb * 1000, 3),
        "bytes": record.bytes_sent,
        "key_id": record.key_id,
        "tenant": record.tenant,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "queued_ms": None if record.queued_s is None else round(record.queued_s * 1000, 3),
        "cached_predicted": record.cached_predicted,
        "migrated": record.migrated,
    }
    return json.dumps(line, separators=(",", ":")) + "\n"


FORMATTERS = {"logfmt": format_logfmt, "json": format_json}


class Usage(NamedTuple):
    prompt: int | None
    completion: int | None
    cached: int | None = None  # prompt tokens the engine found cached, where it says


def usage_in(data: bytes) -> tuple[int | None, int | None] | None:
    """(prompt, completion) token counts: `usage_of`'s without the cached count."""
    usage = usage_of(data)
    return None if usage is None else (usage.prompt, usage.completion)


def usage_of(data: bytes) -> Usage | None:
    """The token counts from the last `"usage": {...}` in `data`, a JSON answer or some
    server-sent events; None when there is none or it is cut off.

    Chat and completions count `prompt_tokens` / `completion_tokens`; the Responses and
    Messages APIs `input_tokens` / `output_tokens`. Either count may be missing: an
    embeddings answer has no completion, and a Messages stream's last event carries only
    its `output_tokens` (the input came in its first): the caller keeps what it had.
    Only the usage object is parsed, never the whole answer: inside a JSON string a quote
    is escaped, so the bytes `"usage"` followed by a colon can only be a key.
    """
    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None
    at = data.rfind(_USAGE_KEY)
    while at >= 0 and (prompt is None or completion is None):
        found = _usage_at(data, at + len(_USAGE_KEY))
        if found is not None:  # the latest count of each kind (events may share a write)
            if prompt is None and found.prompt is not None:
                prompt, cached = found.prompt, found.cached
            completion = found.completion if completion is None else completion
            if found.prompt is not None and found.completion is not None:
                break  # one object with both: what chat and completions send, once
        at = data.rfind(_USAGE_KEY, 0, at)
    return None if prompt is None and completion is None else Usage(prompt, completion, cached)


def _usage_at(data: bytes, after_key: int) -> Usage | None:
    window = data[after_key : after_key + _USAGE_WINDOW]
    stripped = window.lstrip()
    if stripped[:1] != b":":
        return None
    value = stripped[1:].lstrip()
    if value[:1] != b"{":  # "usage": null in the chunks before the last one
        return None
    try:
        usage, _ = _decoder.raw_decode(value.decode("utf-8", errors="replace"))
    except ValueError:
        return None
    if not isinstance(usage, dict):
        return None
    # Chat's names, else the Responses and Messages APIs'; a count that is no count
    # (under either name) and the usage is not believed.
    get = usage.get
    prompt, given_in = get("prompt_tokens"), get("input_tokens")
    completion, given_out = get("completion_tokens"), get("output_tokens")
    for count in (prompt, given_in, completion, given_out):
        if count is not None and not _is_count(count):
            return None
    prompt = given_in if prompt is None else prompt
    completion = given_out if completion is None else completion
    if prompt is None and completion is None:
        return None
    # vLLM's (--enable-prompt-tokens-details) and OpenAI's prompt_tokens_details; the
    # Responses API's input_tokens_details; Anthropic's cache_read_input_tokens.
    details = get("prompt_tokens_details") or get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is None:
        cached = get("cache_read_input_tokens")
    if not _is_count(cached) or prompt is None or cached > prompt:
        cached = None
    return Usage(prompt, completion, cached)


def _is_count(value: object) -> TypeGuard[int]:
    return type(value) is int and value >= 0
