"""Anthropic's Messages API as vLLM 0.32.0 answers it, for the mock engine: the request
read as chat messages, the message, its streaming events, count_tokens, and errors in
Anthropic's shape.

Checked against vLLM 0.32.0's vllm/entrypoints/anthropic/ (serving.py, protocol.py):
vLLM answers through its chat completions, so a message's id is the chat completion's,
`chatcmpl-` and the request's X-Request-Id (else a random id); the stream is `event:
TYPE` / `data: JSON` pairs: message_start (usage with the prompt's tokens and 0 output),
content_block_start, content_block_delta..., content_block_stop, message_delta (the stop
reason and the usage), message_stop. vLLM sends no `ping` event (Anthropic's own API
does); neither does the mock.

Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any


def error(code: int, message: str, kind: str | None = None) -> bytes:
    """vLLM's translation of its errors for this API (api_router's translate_error_response)."""
    kind = kind or ("NotFoundError" if code == 404 else "BadRequestError")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM makes of the request: `system` (a string or text blocks) first,
    then each message, its content blocks' text joined (other blocks as their JSON)."""
    messages = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system)})
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            role = message.get("role", "user")
            messages.append({"role": role, "content": _text(message.get("content", ""))})
    return messages


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            block["text"]
            if isinstance(block, dict) and isinstance(block.get("text"), str)
            else json.dumps(block)
            for block in content
        )
    return json.dumps(content)


def usage(prompt_tokens: int, cached_tokens: int | None, output_tokens: int) -> dict[str, Any]:
    """vLLM's _build_anthropic_usage: the cached tokens (when the engine reports them) are
    taken out of input_tokens and given as cache_read_input_tokens."""
    if cached_tokens is None:
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    return {
        "input_tokens": max(0, prompt_tokens - cached_tokens),
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached_tokens,
    }


def stop_reason(stopped_at_limit: bool) -> str:
    return "max_tokens" if stopped_at_limit else "end_turn"


def message(
    message_id: str, model: str, text: str, stopped_at_limit: bool, used: dict[str, Any]
) -> dict[str, Any]:
    """The answer, unstreamed (serialized by vLLM with exclude_none: no stop_sequence)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": stop_reason(stopped_at_limit),
        "usage": used,
    }


def event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def stream_head(message_id: str, model: str, used: dict[str, Any]) -> bytes:
    """message_start, then the text block's start."""
    started: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": used,
    }
    return event("message_start", message=started) + event(
        "content_block_start", index=0, content_block={"type": "text", "text": ""}
    )


def stream_delta(piece: str) -> bytes:
    return event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})


def stream_tail(stopped_at_limit: bool, used: dict[str, Any]) -> bytes:
    delta = {"stop_reason": stop_reason(stopped_at_limit), "stop_sequence": None}
    return (
        event("content_block_stop", index=0)
        + event("message_delta", delta=delta, usage=used)
        + event("message_stop")
    )


def count_tokens(input_tokens: int) -> dict[str, Any]:
    management = {"original_input_tokens": input_tokens}
    return {"input_tokens": input_tokens, "context_management": management}
