"""The mock engine's Responses API (`/v1/responses`, with stored responses) and Anthropic's
Messages API (`/v1/messages`, `/v1/messages/count_tokens`): the HTTP side of
llmgw_mock_engine.responses_api and messages_api, answering with the words, pace and
scheduler model of the engine's chat completions (a Responses `input` or a Messages
conversation gets the answer its chat messages would get)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import attrs

from llmgw_http.request import Request
from llmgw_http.responder import Responder
from llmgw_mock_engine import messages_api, responses_api
from llmgw_mock_engine.scheduler import PromptTooLong, prompt_tokens

if TYPE_CHECKING:
    from llmgw_mock_engine.engine import MockEngine

log = logging.getLogger("llmgw.mock_engine")

RESPONSES = b"/v1/responses"
MESSAGES = b"/v1/messages"
COUNT_TOKENS = b"/v1/messages/count_tokens"
PATHS = (RESPONSES, MESSAGES, COUNT_TOKENS)
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]


@attrs.define
class TextApis:
    engine: MockEngine
    store: responses_api.ResponseStore = attrs.field(factory=responses_api.ResponseStore)
    warned_dropping: bool = False

    def stats(self) -> dict[str, int]:
        store = self.store
        return {"stored": len(store.held), "bytes": store.bytes, "dropped": store.dropped}

    def _count(self, body: dict[str, Any], limit: object) -> tuple[int, bool]:
        """How many tokens to answer, and whether that is a limit it stops at (the mock's
        answers always stop at one: its own length or the request's)."""
        count = self.engine.settings.tokens
        if isinstance(limit, int) and 0 < limit < count:
            count = limit
        return count, True

    async def create(
        self, path: bytes, body: dict[str, Any], responder: Responder, request_id: bytes | None
    ) -> None:
        """POST /v1/responses, /v1/messages or /v1/messages/count_tokens, whose body is
        checked (a JSON object naming a model the engine serves); `request_id` the
        request's X-Request-Id, if it came with one."""
        try:
            if path == RESPONSES:
                await self._response(body, responder)
            elif path == MESSAGES:
                given = request_id.decode(errors="replace") if request_id else None
                await self._message(body, responder, given or uuid.uuid4().hex)
            else:
                chat = {"model": body["model"], "messages": messages_api.chat_messages(body)}
                answer = messages_api.count_tokens(len(prompt_tokens(chat)))
                await responder.whole(200, json.dumps(answer).encode(), list(_JSON))
        except PromptTooLong as exc:
            if path == RESPONSES:
                await responder.whole(400, json.dumps(responses_api.error(400, str(exc))).encode())
            else:
                await responder.whole(400, messages_api.error(400, str(exc)))

    async def _response(self, body: dict[str, Any], responder: Responder) -> None:
        if body.get("background"):
            message = "mock engine: background responses are not modelled"
            await responder.whole(400, json.dumps(responses_api.error(400, message)).encode())
            return
        previous_id = body.get("previous_response_id")
        previous: list[dict[str, Any]] = []
        if previous_id is not None:
            held = self.store.get(str(previous_id))
            if held is None:
                answer = responses_api.not_found(str(previous_id))
                await responder.whole(404, json.dumps(answer).encode(), list(_JSON))
                return
            previous = held.messages
        messages = responses_api.conversation(body, previous)
        chat = {"model": body["model"], "messages": messages}
        count, at_limit = self._count(body, body.get("max_output_tokens"))
        response_id = responses_api.response_id_of(body)
        created = int(time.time())
        async with self.engine.generation(chat, count) as gen:
            limit = body.get("max_output_tokens")
            if not isinstance(limit, int):
                limit = max(1, self.engine.settings.max_model_len - gen.prompt_tokens)
            status = "incomplete" if at_limit else "completed"

            def shaped(status: str, output: list[dict[str, Any]], used: Any) -> dict[str, Any]:
                return responses_api.response(
                    body, response_id, created, limit, status=status, output=output, used=used
                )

            used = responses_api.usage(gen.prompt_tokens, gen.cached_tokens or 0, count)
            if not body.get("stream"):
                text = await gen.whole()
                item = responses_api.output_message(f"msg_{response_id[-32:]}", text, "completed")
                final = shaped(status, [item], used)
                self._keep(body, final, messages, text)
                await responder.whole(200, json.dumps(final).encode(), list(_JSON))
                return
            events = responses_api.EventStream()
            await responder.start(200, list(_SSE))
            await responder.send(events.head(shaped("in_progress", [], None)))
            await responder.send(events.opened())
            async for piece in gen.each():
                await responder.send(events.delta(piece))
            await responder.send(events.closed())
            item = responses_api.output_message(events.item_id, events.text, "completed")
            final = shaped(status, [item], used)
            self._keep(body, final, messages, events.text)
            await responder.send(events.completed(final))
            await responder.end()

    def _keep(
        self, body: dict[str, Any], final: dict[str, Any], messages: list[Any], text: str
    ) -> None:
        """Store the response (`store`, true by default: vLLM with
        VLLM_ENABLE_RESPONSES_API_STORE=1) with the conversation a follow-up continues."""
        if body.get("store", True) is False:
            return
        dropped = self.store.put(final, [*messages, {"role": "assistant", "content": text}])
        if dropped and not self.warned_dropping:
            self.warned_dropping = True  # said once; /mock/stats counts every one
            log.warning(
                "mock engine: dropping the oldest stored responses past %d responses or "
                "%d bytes (their ids now get 404)",
                self.store.max_count,
                self.store.max_bytes,
            )

    async def _message(self, body: dict[str, Any], responder: Responder, request_id: str) -> None:
        chat = {"model": body["model"], "messages": messages_api.chat_messages(body)}
        count, at_limit = self._count(body, body.get("max_tokens"))
        message_id = f"chatcmpl-{request_id}"  # vLLM's: its chat completion's id
        model = str(body["model"])
        async with self.engine.generation(chat, count) as gen:
            used = messages_api.usage(gen.prompt_tokens, gen.cached_tokens, count)
            if not body.get("stream"):
                text = await gen.whole()
                whole = messages_api.message(message_id, model, text, at_limit, used)
                await responder.whole(200, json.dumps(whole).encode(), list(_JSON))
                return
            await responder.start(200, list(_SSE))
            started = messages_api.usage(gen.prompt_tokens, gen.cached_tokens, 0)
            await responder.send(messages_api.stream_head(message_id, model, started))
            async for piece in gen.each():
                await responder.send(messages_api.stream_delta(piece))
            await responder.send(messages_api.stream_tail(at_limit, used))
            await responder.end()

    async def stored(self, request: Request, responder: Responder) -> None:
        """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, as vLLM 0.32.0
        serves them (it has no DELETE: 405, as its router answers a method it lacks)."""
        rest = request.path[len(RESPONSES) + 1 :].decode(errors="replace")
        response_id, _, sub = rest.partition("/")
        if sub not in ("", "cancel") or not response_id:
            path = request.path.decode(errors="replace")
            await responder.error(404, f"mock engine: no route {path}")
            return
        wanted = b"GET" if sub == "" else b"POST"
        if request.method != wanted:
            await responder.error(405, f"mock engine: use {wanted.decode()} (as vLLM 0.32.0)")
            return
        held = self.store.get(response_id)
        if held is None:
            answer = responses_api.not_found(response_id)
            await responder.whole(404, json.dumps(answer).encode(), list(_JSON))
        elif sub == "cancel":
            # Every response the mock makes is synchronous, and vLLM's answer to those:
            message = "Cannot cancel a synchronous response."
            answer = responses_api.error(400, message, "response_id")
            await responder.whole(400, json.dumps(answer).encode(), list(_JSON))
        else:
            await responder.whole(200, json.dumps(held.response).encode(), list(_JSON))
