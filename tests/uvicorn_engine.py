"""An OpenAI-compatible engine served by uvicorn, the HTTP server of vLLM and SGLang.

The answers are made up; what is real is the HTTP layer the router talks to:
uvicorn with httptools closes an idle keep-alive connection after
--timeout-keep-alive seconds (vLLM's default: 5) without `Connection: close`.

    python -m uvicorn uvicorn_engine:app --app-dir tests --http httptools --timeout-keep-alive 5
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_WORDS = "tokens arrive from a real http server one after another".split()


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        chunk: bytes = message.get("body", b"")
        body += chunk
        if not message.get("more_body"):
            return body


async def _json(send: Send, status: int, value: object) -> None:
    data = json.dumps(value).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if path == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/v1/models":
        await _json(send, 200, {"object": "list", "data": [{"id": "u", "object": "model"}]})
        return
    if path not in ("/v1/chat/completions", "/v1/completions"):
        await _json(send, 404, {"error": {"message": "Not Found", "code": 404}})
        return
    body = json.loads(await _read_body(receive))
    chat = path == "/v1/chat/completions"
    count = int(body.get("max_tokens") or 8)
    words = [_WORDS[i % len(_WORDS)] for i in range(count)]
    if not body.get("stream"):
        text = " ".join(words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        answer = {
            "id": "cmpl-uvicorn",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": count, "total_tokens": count + 1},
        }
        await _json(send, 200, answer)
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for i, word in enumerate([*words, ""]):
        finish = None if i < len(words) else "length"
        delta: dict[str, Any] = (
            {"delta": {"content": (" " if i else "") + word}} if chat else {"text": word}
        )
        event = {
            "id": "cmpl-uvicorn",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": finish, **delta}],
        }
        data = b"data: " + json.dumps(event).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
