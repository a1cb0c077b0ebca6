"""What a stream has sent its client, kept so that another replica can continue it when
its engine dies mid-answer (router.continuation builds the continued request). Pure:
bytes in, what the client has out; no trio, no sockets.

The hot path only keeps the bytes written to the client (a list append): most streams
end whole and are never read. Once a stream's kept bytes pass `COMPACT_BYTES` they are
read in one pass (the HTTP chunk framing taken off, the events split, their JSON parsed
in one call) into what a continuation needs: each choice's text, the token ids where
the engine gave them, the answer's id, created and model, and whether anything seen
makes a continuation unsafe. So a long stream keeps about its text, not its events
(vLLM's chat events are 150 to 250 bytes a token).

Bounds: a stream keeps at most `max_tokens` generated tokens (one event with text
counts one, or its token ids where it has them), and all streams of a process at most
`KeepBudget.limit` together; past either the stream stops keeping (it can no longer
continue: `seam` says why) and gives its share back.
"""

from __future__ import annotations

import json
import re

import attrs

from llmgw_http.chunked import ChunkDecoder, ChunkedError

# What `_skim` cannot read: events of another choice, a tool call, reasoning, an error,
# and the prompt's ids (in a stream's first event only, which is parsed whole).
_DEEP = re.compile(
    rb'"(?:index":\s*[1-9]|tool_calls"|function_call"|reasoning|error"|prompt_token_ids":\s*\[)'
)
# A text (a chat delta's content, a completion's text), a choice's token ids, a finish.
_FIELDS = re.compile(
    rb'"(?:(?:content|text)":\s*("(?:[^"\\]|\\.)*")'
    rb'|token_ids":\s*\[([0-9,\s]*)\]'
    rb'|finish_reason":\s*"([^"]*)")'
)
_USAGE = re.compile(rb'"usage":\s*\{')
_PAYLOAD = re.compile(rb"^data:[ \t]*(.*?)[ \t\r]*$", re.MULTILINE)
_DONE_LINE = b"data: [DONE]"
_EMPTY = b'""'
# Raw bytes a stream keeps before reading them (about 35 of vLLM's chat events): small
# passes, whose buffers the allocator reuses. With 32 KiB a pass, 60 kept streams grew
# the router's RSS by 359 KB each for 28 KB live (bench/migration_bench.py); with 8 KiB
# by 37 KB, for 0.3 us more an event.
COMPACT_BYTES = 8 * 1024
_EVENT_END = b"\n\n"
_DONE = b"[DONE]"


class KeepBudget:
    """The generated tokens all kept streams of a process may hold together."""

    __slots__ = ("kept", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = 0


@attrs.define(slots=True)
class Seam:
    """What the client has of the answer when its engine's stream broke."""

    id: object = None
    created: object = None
    model: object = None
    fingerprint: object = None
    text: str = ""  # choice 0's text so far (a chat's content, a completion's text)
    token_ids: list[int] | None = None  # its token ids, where every event gave them
    prompt_ids: list[int] | None = None  # the prompt as the engine tokenized it, if it said
    tokens: int = 0  # generated tokens sent (ids counted where given, else text events)
    finished: str | None = None  # the finish_reason, once one came
    usage_sent: bool = False
    done_sent: bool = False  # `data: [DONE]` went out: the stream is whole


class KeptStream:
    """One stream's sent bytes, as written to its client: `feed_framed` for bytes with
    HTTP/1.1 chunk framing (relayed undecoded), `feed` for bare body bytes."""

    __slots__ = (
        "_budget",
        "_decoder",
        "_held",
        "_raw",
        "_raw_bytes",
        "_tail",
        "_text",
        "max_tokens",
        "seam",
        "unsafe",
    )

    def __init__(self, max_tokens: int, budget: KeepBudget) -> None:
        self.max_tokens = max_tokens
        self._budget = budget
        self._raw: list[bytes] = []
        self._raw_bytes = 0
        self._decoder: ChunkDecoder | None = None  # set by the first framed bytes
        self._tail = b""  # the start of an event not yet whole
        self._text: list[str] = []
        self._held = 0  # tokens this stream counts in the budget
        self.seam = Seam()
        # Why this stream cannot be continued, once something says so (None: it can).
        self.unsafe: str | None = None

    def feed_framed(self, data: bytes) -> bytes:
        """Keeps `data` (with its chunk framing) and gives it back, to be sent on."""
        if self._decoder is None:
            if self._raw:  # bare bytes came first: read them before framed ones follow
                self._compact()
            self._decoder = ChunkDecoder()
        if self.unsafe is None:  # the hot path: one append a write
            self._raw.append(data)
            self._raw_bytes += len(data)
            if self._raw_bytes > COMPACT_BYTES:
                self._compact()
        return data

    def feed_framed_blanked(self, data: bytes) -> bytes:
        """Keeps `data` and gives it back with the token ids the router asked for (and the
        client did not) written over with spaces: the JSON stays valid and every chunk
        keeps its length, so the framing goes on untouched (an id list split between two
        reads is left as it came, and the client sees its ids)."""
        return blanked(self.feed_framed(data))

    def feed(self, data: bytes) -> None:
        if self._decoder is not None:  # after a seam the continuation is written bare
            self._compact()
            self._decoder = None
        if self.unsafe is None:
            self._raw.append(data)
            self._raw_bytes += len(data)
            if self._raw_bytes > COMPACT_BYTES:
                self._compact()

    def read(self) -> Seam | str:
        """What the client has, or why the stream cannot be continued from it (its last
        event came in part, it was too long to keep, something in it is unsafe)."""
        self._compact()
        if self.unsafe is not None:
            return self.unsafe
        if self._tail.strip():
            return "the client has part of an event"
        seam = self.seam
        seam.text = "".join(self._text)
        self._text = [seam.text]
        return seam

    def release(self) -> None:
        """The stream ended: what it kept goes, and its tokens leave the budget."""
        self._budget.kept -= self._held
        self._held = 0
        self._raw = []
        self._text = []

    def _compact(self) -> None:
        raw = self._raw
        if not raw:
            return
        data = b"".join(raw)
        self._raw = []
        self._raw_bytes = 0
        if self.unsafe is not None:
            return
        if self._decoder is not None:
            try:
                data = self._decoder.feed(data)
            except ChunkedError:
                self._stop("the answer broke HTTP's chunk framing")
                return
        data = self._tail + data
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._tail = data
            return
        whole, self._tail = data[: end + 2], data[end + 2 :]
        if _DONE_LINE in whole:
            self.seam.done_sent = True
        if self.seam.id is None:
            first = _PAYLOAD.search(whole)
            if first is None:
                return  # comments alone so far
            try:
                self._take(json.loads(first.group(1)))
            except (ValueError, UnicodeDecodeError):
                self._stop("an event of the answer is not JSON")
            if self.unsafe is not None:
                return
            whole = whole[first.end() :]
        if not _DEEP.search(whole):
            self._skim(whole)
            return
        payloads = [p for p in _PAYLOAD.findall(whole) if p != _DONE]
        try:
            parsed = json.loads(b"[" + b",".join(payloads) + b"]")
        except (ValueError, UnicodeDecodeError):
            self._stop("an event of the answer is not JSON")
            return
        start = len(self._text)
        for event in parsed:
            self._take(event)
            if self.unsafe is not None:
                return
        if len(self._text) - start > 1:
            # One string for what this pass read, not one a token: a token's str object
            # is about 57 bytes for its 4 or 5 of text.
            self._text[start:] = ["".join(self._text[start:])]

    def _skim(self, blob: bytes) -> None:
        """Events of one choice's plain text read without parsing each: their text
        strings, token ids and finish reason, in the order they come (what `_take`
        would find in them, at a third of its cost; tests/test_continuation.py holds
        the two to the same result). A text waits for the ids that follow it in its
        event; the next text, or the end, says it had none."""
        seam = self.seam
        texts: list[bytes] = []
        ids: list[int] = []
        without_ids = 0  # texts that had no ids
        pending = False  # a text whose ids may follow
        for text, listed, finish in _FIELDS.findall(blob):
            if text:
                without_ids += pending
                pending = text != _EMPTY
                if pending:
                    texts.append(text)
            elif finish:
                seam.finished = finish.decode("utf-8", "replace")
            else:
                if listed.strip():
                    try:
                        ids.extend(map(int, listed.split(b",")))
                    except ValueError:  # "1,,2", or a number of thousands of digits
                        self._stop("an event's token ids are not numbers")
                        return
                pending = False
        without_ids += pending
        if _USAGE.search(blob):
            seam.usage_sent = True
        if ids:
            self._count(ids, 0)
        if without_ids:
            self._count(None, without_ids)
        if texts and self.unsafe is None:
            try:
                self._text.append("".join(json.loads(b"[" + b",".join(texts) + b"]")))
            except (ValueError, UnicodeDecodeError):
                self._stop("an event of the answer is not JSON")

    def _take(self, event: object) -> None:
        if not isinstance(event, dict):
            self._stop("an event of the answer is not a JSON object")
            return
        seam = self.seam
        if "error" in event:
            self._stop("the engine sent an error event")
            return
        if seam.id is None:
            seam.id = event.get("id")
            seam.created = event.get("created")
            seam.model = event.get("model")
            seam.fingerprint = event.get("system_fingerprint")
        if event.get("usage") is not None:
            seam.usage_sent = True
        if seam.prompt_ids is None:  # vLLM's return_token_ids: a chat's on the event
            seam.prompt_ids = _ids(event.get("prompt_token_ids"))
        choices = event.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                self._stop("a choice is not a JSON object")
                return
            if choice.get("index", 0) != 0:
                self._stop("more than one choice (n > 1)")
                return
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("tool_calls") or delta.get("function_call"):
                    self._stop("a tool call was being written")
                    return
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self._stop("reasoning was being written")
                    return
                text = delta.get("content")
            else:
                text = choice.get("text")
            ids = choice.get("token_ids")
            if seam.prompt_ids is None:  # and a completion's on its choice
                seam.prompt_ids = _ids(choice.get("prompt_token_ids"))
            if isinstance(text, str) and text:
                self._text.append(text)
                self._count(ids if isinstance(ids, list) else None, 1)
            elif isinstance(ids, list) and ids:
                self._count(ids, 0)
            finish = choice.get("finish_reason")
            if finish is not None:
                seam.finished = str(finish)

    def _count(self, ids: list[int] | None, events: int) -> None:
        seam = self.seam
        if ids is not None:
            if seam.token_ids is None and seam.tokens == 0:
                seam.token_ids = []
            if seam.token_ids is not None:
                seam.token_ids.extend(ids)
            added = len(ids)
        else:
            seam.token_ids = None  # an event without ids: text alone from here
            added = events
        seam.tokens += added
        self._held += added
        self._budget.kept += added
        if seam.tokens > self.max_tokens or self._budget.kept > self._budget.limit:
            self._stop("the answer is longer than the router keeps")

    def _stop(self, why: str) -> None:
        self.unsafe = why
        self._budget.kept -= self._held
        self._held = 0
        self._raw = []
        self._text = []
        self._tail = b""


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return value
    return None


# The ids vLLM adds to a stream's events with `return_token_ids` (as pydantic writes
# them: no spaces), which the router asks for to keep and the client did not.
IDS = re.compile(rb',"(?:prompt_)?token_ids":(?:\[[0-9,]*\]|null)|,"prompt_text":null')


def _spaces(match: re.Match[bytes]) -> bytes:
    return b" " * (match.end() - match.start())


def blanked(events: bytes) -> bytes:
    """`events` with the router's token ids written over with as many spaces."""
    if b'token_ids"' not in events and b'"prompt_text"' not in events:
        return events
    return IDS.sub(_spaces, events)
