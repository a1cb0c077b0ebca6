"""OpenAI's Responses API as vLLM 0.32.0 answers it, for the mock engine: the request read
as a conversation, the response object, its streaming events, and the store that keeps
responses for `previous_response_id` and `GET /v1/responses/{id}`.

Checked against vLLM 0.32.0's vllm/entrypoints/openai/responses/ (serving.py,
protocol.py's ResponsesResponse.from_request, streaming_events.py's simple, non-harmony
path): the response's id is the request's `request_id` (a router names it so: see
llmgw_server.router.stored), else `resp_` and 32 hex digits; a stream is
`event: TYPE` / `data: JSON` pairs with a `sequence_number` from 0.

Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any

import attrs

# What the store keeps at most, the oldest response dropped first. vLLM keeps every
# stored response until it exits (its own warning: "a memory leak"); a mock that runs
# for hours under a benchmark must not. A dropped id is answered as one never stored.
STORED_RESPONSES = 10_000
STORED_BYTES = 64 * 1024 * 1024


def not_found(response_id: str) -> dict[str, Any]:
    """vLLM's 404 for an id it does not hold (serving.py's _make_not_found_error)."""
    return error(404, f"Response with id '{response_id}' not found.", "response_id")


def error(code: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape (ErrorResponse): its type for a client's mistake."""
    kind = "NotFoundError" if code == 404 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def response_id_of(body: dict[str, Any]) -> str:
    """The response's id: the request's `request_id`, as vLLM takes it."""
    given = body.get("request_id")
    return given if isinstance(given, str) and given else f"resp_{uuid.uuid4().hex}"


def conversation(body: dict[str, Any], previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages the request asks about: the stored conversation it follows,
    its `instructions` as a system message, then its `input` (a string, or a list of
    messages whose content is a string or a list of parts)."""
    messages = list(previous)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input", "")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    for item in given if isinstance(given, list) else [given]:
        if not isinstance(item, dict):
            messages.append({"role": "user", "content": json.dumps(item)})
            continue
        content = item.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if all(isinstance(t, str) for t in texts):
                content = " ".join(t for t in texts if isinstance(t, str))
        role = item.get("role", "user")
        messages.append({"role": role, "content": content})
    return messages


def text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    """An output_text part: vLLM's logprobs are [] while it is open, null once done."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = text_part(text, None)
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "content": [part] if text else [],
        "status": status,
    }


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """vLLM's ResponseUsage, one turn."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [prompt_tokens],
            "cached_tokens_per_turn": [cached_tokens],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [output_tokens],
            "tool_output_tokens_per_turn": [0],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def response(
    body: dict[str, Any],
    response_id: str,
    created_at: int,
    max_output_tokens: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    used: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response object, as ResponsesResponse.from_request fills it from the request;
    `status` "incomplete" when the answer stopped at its token limit."""
    parallel = body.get("parallel_tool_calls")
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": body.get("model"),
        "object": "response",
        "output": output,
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": body.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_p": body.get("top_p", 1.0),
        "background": bool(body.get("background", False)),
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": body.get("prompt"),
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": body.get("top_logprobs"),
        "truncation": body.get("truncation", "disabled"),
        "usage": used,
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty", 0.0),
        "frequency_penalty": body.get("frequency_penalty", 0.0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


@attrs.define
class EventStream:
    """A streamed response's events, numbered in order (vLLM's sequence_number)."""

    item_id: str = attrs.field(factory=lambda: f"msg_{uuid.uuid4().hex}")
    number: int = 0
    text: str = ""

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def _at(self) -> dict[str, Any]:
        return {"output_index": 0, "item_id": self.item_id, "content_index": 0}

    def head(self, initial: dict[str, Any]) -> bytes:
        """response.created and response.in_progress, for the response as it starts."""
        return self._event("response.created", response=initial) + self._event(
            "response.in_progress", response=initial
        )

    def opened(self) -> bytes:
        """The message and its text part begin (before the first piece of text)."""
        item = output_message(self.item_id, "", "in_progress")
        part = text_part("", [])
        return self._event("response.output_item.added", output_index=0, item=item) + (
            self._event("response.content_part.added", part=part, **self._at())
        )

    def delta(self, piece: str) -> bytes:
        self.text += piece
        return self._event("response.output_text.delta", delta=piece, logprobs=[], **self._at())

    def closed(self) -> bytes:
        """The text, its part and its message done (after the last piece)."""
        item = output_message(self.item_id, self.text, "completed")
        part = text_part(self.text, None)
        return (
            self._event("response.output_text.done", text=self.text, logprobs=[], **self._at())
            + self._event("response.content_part.done", part=part, **self._at())
            + self._event("response.output_item.done", output_index=0, item=item)
        )

    def completed(self, final: dict[str, Any]) -> bytes:
        return self._event("response.completed", response=final)


@attrs.define
class Stored:
    response: dict[str, Any]
    # The conversation up to and with this response's answer: what a follow-up that
    # names it continues (vLLM's msg_store).
    messages: list[dict[str, Any]]
    size: int


@attrs.define
class ResponseStore:
    """Stored responses by id, oldest dropped first past `max_count` or `max_bytes` (the
    JSON size of each response and its conversation)."""

    max_count: int = STORED_RESPONSES
    max_bytes: int = STORED_BYTES
    held: OrderedDict[str, Stored] = attrs.field(factory=OrderedDict)
    bytes: int = 0
    dropped: int = 0  # for /mock/stats: how many were dropped for room

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> int:
        """Keep `response`; how many older ones were dropped to make room."""
        size = len(json.dumps(response)) + len(json.dumps(messages))
        self.remove(response["id"])
        self.held[response["id"]] = Stored(response, messages, size)
        self.bytes += size
        before = self.dropped
        while len(self.held) > 1 and (
            len(self.held) > self.max_count or self.bytes > self.max_bytes
        ):
            _, oldest = self.held.popitem(last=False)
            self.bytes -= oldest.size
            self.dropped += 1
        return self.dropped - before

    def get(self, response_id: str) -> Stored | None:
        return self.held.get(response_id)

    def remove(self, response_id: str) -> None:
        gone = self.held.pop(response_id, None)
        if gone is not None:
            self.bytes -= gone.size
