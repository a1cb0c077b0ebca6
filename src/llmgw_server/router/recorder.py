"""What the router records of each answer as it goes out, and the access log's writer."""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import trio

from llmgw_core.openai_errors import OPENAI, ErrorShape
from llmgw_http.server import JSON, Responder
from llmgw_server.router.access_log import AccessRecord, usage_of

log = logging.getLogger("llmgw.router")

_USAGE_KEY = b'"usage"'
_REQUEST_ID = b"x-request-id"
# The head of a stream answered before its engine does (a request held while its model
# wakes): an event stream, which proxies neither cache nor buffer (nginx reads
# X-Accel-Buffering), so the comments that follow reach the client as they are sent.
EARLY_STREAM_HEAD = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
# An engine's error text, as much as an error event quotes of one that is not JSON.
_QUOTED_ERROR_CHARS = 512


def new_request_id() -> str:
    """24 random hex digits. A name, not a secret: Python's generator (reseeded in a forked
    worker) instead of a system call per request."""
    return f"{random.getrandbits(96):024x}"


class RecordingResponder(Responder):
    """The server's responder, seen through: every write goes to `inner` unchanged but
    for the request id (and `added`) in the head, and the record learns the status, the bytes,
    the time of the first body byte and the engine's token usage.

    Usage is looked for only in writes that hold the bytes `"usage"`: the whole body of a
    non-streamed answer, and with `stream_options.include_usage` the last event of a
    stream (engines write each event at once, so it is never split between writes); a
    Messages stream's first event counts its input, its last one its output.
    """

    __slots__ = (
        "_added",
        "_arrived",
        "count_events",
        "early",
        "errors",
        "events",
        "inner",
        "message",
        "record",
    )

    def __init__(
        self,
        inner: Responder,
        record: AccessRecord,
        arrived: float,
        added: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        # No Responder.__init__: nothing is written but through `inner`.
        self.inner = inner
        self.record = record
        self.message: str | None = None  # the error message of an answer made here
        self.errors: ErrorShape = OPENAI  # the shape of errors made here (the path's API)
        self.chunked = inner.chunked
        self.head = inner.head
        self.closing = inner.closing
        self.started = False
        # A stream's head (200, an event stream) went out while the request was held:
        # what follows can only be body events; an error becomes an error event.
        self.early = False
        self._arrived = arrived  # time.monotonic() when the request arrived
        # The request id, then the router's own (a worker's name): in every answer's head.
        self._added = ((_REQUEST_ID, record.request_id.encode()), *added)
        # A limited tenant's stream: its events are counted, one token each, for an
        # answer whose usage never comes (the client did not ask for it, or left).
        self.count_events = False
        self.events = 0

    def add_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """More headers for the answer's head (a limited tenant's x-ratelimit-*)."""
        self._added = (*self._added, *headers)

    def _headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        # An engine may echo the id too (vLLM's --enable-request-id-headers): sent once.
        return [*(h for h in headers if h[0] != _REQUEST_ID), *self._added]

    def _body(self, data: bytes) -> None:
        record = self.record
        if record.ttfb_s is None:
            record.ttfb_s = time.monotonic() - self._arrived
        if not self.head:
            record.bytes_sent += len(data)
        if self.count_events:
            # Engines write each event at once (see above): a write is an event, counted
            # without reading it (the last one, [DONE], counts one token too many).
            self.events += 1
        if _USAGE_KEY in data:
            usage = usage_of(data)
            if usage is not None:
                prompt, completion, cached = usage
                if prompt is not None:
                    record.prompt_tokens = prompt
                    record.cached_tokens = cached
                if completion is not None:
                    record.completion_tokens = completion

    async def start_early(self) -> None:
        """Send a stream's head now, before any engine answers: see `early`."""
        await self.start(200, EARLY_STREAM_HEAD)
        self.early = True

    async def comment(self, text: bytes) -> None:
        """An SSE comment line (`: text`), which clients skip: bytes on the wire while
        the request waits. Counted as sent, not as the answer's first byte."""
        data = b": " + text + b"\n\n"
        if not self.head:
            self.record.bytes_sent += len(data)
        await self.inner.send(data)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.early:  # sent already: the engine's own status and headers cannot be
            return
        self.record.status = status
        self.started = True
        await self.inner.start(status, self._headers(headers))

    async def send(self, data: bytes) -> None:
        self._body(data)
        await self.inner.send(data)

    async def send_chunks(self, framed: bytes) -> None:
        self._body(framed)
        await self.inner.send_chunks(framed)

    async def end(self) -> None:
        await self.inner.end()

    async def whole(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON
    ) -> None:
        if self.early:
            await self._after_early_head(status, body)
            return
        self.record.status = status
        self.started = True
        self._body(body)
        await self.inner.whole(status, body, self._headers(headers))

    async def error(self, status: int, message: str) -> None:
        self.message = message
        await self.whole(status, self.errors.body(status, message, None))

    async def _after_early_head(self, status: int, body: bytes) -> None:
        """A whole answer after the early head: its body as the stream's events, or an
        error answer as the error event that ends the stream (the access log keeps its
        status: the client's 200 said only that the stream began)."""
        if 200 <= status < 300:
            await self.send(body)
        else:
            self.record.status = status
            await self.inner.send(self.errors.event(status, _error_message(body)))
        await self.end()

    async def abort(self) -> None:
        await self.inner.abort()

    async def send_raw(self, data: bytes) -> None:
        self.started = True
        await self.inner.send_raw(data)


def _error_message(body: bytes) -> str:
    """The message of an error answer in OpenAI's or Anthropic's shape (both put it in
    `error.message`), else its text."""
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, UnicodeDecodeError, TypeError, KeyError):
        pass
    return body[:_QUOTED_ERROR_CHARS].decode("utf-8", "replace")


class LineWriter:
    """Access log lines, kept in memory and written out together every `interval_s`,
    or sooner once `max_lines` wait: one write for many requests, off the request's path.

    `run` owns the file (stderr when there is none) and writes what is left when it ends;
    a line that comes after that is written at once.
    """

    def __init__(
        self,
        format_line: Callable[[AccessRecord], str],
        path: Path | None = None,
        *,
        interval_s: float = 0.5,
        max_lines: int = 256,
    ) -> None:
        self.format_line = format_line
        self.path = path
        self.interval_s = interval_s
        self.max_lines = max_lines
        self._lines: list[str] = []
        self._out: BinaryIO | None = None
        self._running = False
        self._failed_at = -1e9

    def write(self, record: AccessRecord) -> None:
        self._lines.append(self.format_line(record))
        if len(self._lines) >= self.max_lines or not self._running:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        data = "".join(self._lines).encode()
        self._lines.clear()
        out = self._out or sys.stderr.buffer
        try:
            out.write(data)
            out.flush()
        except (OSError, ValueError) as exc:  # a full disk, a closed stream
            now = time.monotonic()
            if now - self._failed_at > 60:
                self._failed_at = now
                log.error("the access log lost lines: %s", exc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.path is not None:
            try:
                self._out = self.path.open("ab")
            except OSError as exc:
                log.error("cannot open the access log %s (%s): using stderr", self.path, exc)
        self._running = True
        task_status.started()
        try:
            while True:
                await trio.sleep(self.interval_s)
                self.flush()
        finally:
            self._running = False
            self.flush()
            if self._out is not None:
                self._out.close()
                self._out = None
