"""A prompt's token ids as its engine sees them, for `balancing = "precise"`.

The router asks an engine of the model its own `POST /tokenize` (vLLM's, and the mock
engine's: `{"model", "messages", "add_generation_prompt": true}` for a chat, with the
request's `tools` and `chat_template_kwargs`; `{"model", "prompt"}` for a completion),
so that the chat template and the special tokens are the engine's, exactly. Answers are
kept by the prompt's own hash (cache_aware's, computed anyway: the whole canonical text)
and model, least recently used first out: at most `MAX_ENTRIES` prompts and
`MAX_TOKENS` token ids in all (4 bytes each), so the cache stays under 20 MB. An engine
that cannot say within `TIMEOUT_S` (or answers anything else than a list of token ids,
at most `MAX_ANSWER_BYTES`) leaves the request to be routed without token ids.
"""

from __future__ import annotations

import array
import json
import logging
from collections import OrderedDict
from typing import Any

import msgspec
import trio

from llmgw_core.ratelog import RateLimit
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.upstream import Pool, UpstreamError

log = logging.getLogger("llmgw.tokenizer")

MAX_ENTRIES = 4096
MAX_TOKENS = 4_000_000
MAX_ANSWER_BYTES = 8 << 20
TIMEOUT_S = 2.0
_JSON = [(b"content-type", b"application/json")]
_CHAT_FIELDS = ("messages", "tools", "chat_template", "chat_template_kwargs")


class _Answer(msgspec.Struct):
    """What the router reads of a /tokenize answer (vLLM's has more: count, max_model_len)."""

    tokens: list[int]


# msgspec: a list of 3,000 ids in 56 us, where json.loads takes 120 (issue 22's CPU budget).
_decode_answer = msgspec.json.Decoder(_Answer).decode
_encode = msgspec.json.Encoder().encode


class Tokenizer:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._kept: OrderedDict[tuple[str, int, int], array.array[int]] = OrderedDict()
        self._tokens = 0
        self.asked = 0  # requests sent to engines
        self.hits = 0  # prompts answered from the cache
        self._failures = RateLimit(period_s=10.0)

    async def tokens(
        self, pool: Pool, model: str, body: dict[str, Any], chat: bool, prompt: PromptKey
    ) -> array.array[int] | None:
        """The prompt's token ids (an array of uint32 shared with the cache: never to be
        modified), or None when no engine could say."""
        key = (model, prompt.chain[-1], prompt.size)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            self.hits += 1
            return kept
        ask: dict[str, Any] = {"model": model}
        if chat:
            ask.update((f, body[f]) for f in _CHAT_FIELDS if f in body)
            ask["add_generation_prompt"] = True
        else:
            ask["prompt"] = body.get("prompt")
        self.asked += 1
        try:
            request = _encode(ask)  # 3 us for a 3,000-word chat, where json.dumps takes 25
        except UnicodeEncodeError:  # a lone surrogate, which json.loads lets through
            request = json.dumps(ask).encode()
        found = await self._ask(pool, request)
        if found is not None:
            self._keep(key, found)
        return found

    async def _ask(self, pool: Pool, request: bytes) -> array.array[int] | None:
        try:
            with trio.move_on_after(TIMEOUT_S):
                exchange = await pool.open(b"POST", b"/tokenize", _JSON, request, TIMEOUT_S)
                try:
                    status = exchange.status
                    body = await exchange.read_body(MAX_ANSWER_BYTES)
                finally:
                    exchange.release()
                return self._read(pool, status, body)
            self._failed(pool, f"no answer within {TIMEOUT_S:g} s")
        except UpstreamError as exc:
            self._failed(pool, str(exc))
        return None

    def _read(self, pool: Pool, status: int, body: bytes) -> array.array[int] | None:
        if status != 200:
            self._failed(pool, f"it answered {status}")
            return None
        try:
            ids = array.array("I", _decode_answer(body).tokens)  # 0 to 2**32 - 1, checked in C
        except (msgspec.DecodeError, OverflowError):  # ValidationError is a DecodeError
            self._failed(pool, "its answer holds no list of token ids")
            return None
        return ids

    def _keep(self, key: tuple[str, int, int], tokens: array.array[int]) -> None:
        if len(tokens) > self.max_tokens:
            return
        self._kept[key] = tokens
        self._tokens += len(tokens)
        while len(self._kept) > self.max_entries or self._tokens > self.max_tokens:
            _, dropped = self._kept.popitem(last=False)
            self._tokens -= len(dropped)

    def _failed(self, pool: Pool, why: str) -> None:
        suppressed = self._failures.allow(pool.endpoint.url, trio.current_time())
        if suppressed is not None:
            more = f" ({suppressed} more since)" if suppressed else ""
            log.warning(
                "cannot tokenize through %s (%s): routing without token ids%s",
                pool.endpoint,
                why,
                more,
            )
