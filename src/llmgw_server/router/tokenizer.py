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

An answer is no bigger than its prompt allows (`most_ids`): every token the engine's
template and tokenizer make covers a byte or more of the prompt's text (its canonical
text: the messages' roles and contents and the tools, or the completion's prompt) or of
a chat template the request sends, but for the few a template or tokenizer adds without
text (a BOS, a default system header: `SLACK_IDS`). An answer with more ids, or longer
than that many could be written (`ID_BYTES` each), is refused unread past its head (a
Content-Length) or undecoded, counted (`llmgw_tokenize_refused_total`) and said once per
engine. Without it, an engine answering 4M ids (8 MiB, too many to be cached, so asked
again per prompt) cost the router 0.46 s of CPU a request.
"""

from __future__ import annotations

import array
import json
import logging
from collections import Counter, OrderedDict
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
SLACK_IDS = 64  # ids an answer may hold beyond its prompt's bytes
ID_BYTES = 11  # an id's most bytes in an answer: 10 digits and a comma
_ANSWER_HEAD_BYTES = 1024  # the answer's other fields (vLLM's: count, max_model_len)
_JSON = [(b"content-type", b"application/json")]
_CHAT_FIELDS = ("messages", "tools", "chat_template", "chat_template_kwargs")


class _Answer(msgspec.Struct):
    """What the router reads of a /tokenize answer (vLLM's has more: count, max_model_len)."""

    tokens: list[int]


# msgspec: a list of 3,000 ids in 56 us, where json.loads takes 120 (issue 22's CPU budget).
_decode_answer = msgspec.json.Decoder(_Answer).decode
_encode = msgspec.json.Encoder().encode


def most_ids(body: dict[str, Any], prompt: PromptKey) -> int:
    """The most token ids an engine's answer for this prompt may hold."""
    template = body.get("chat_template")
    extra = len(template.encode("utf-8", "surrogatepass")) if isinstance(template, str) else 0
    return len(prompt.text) + extra + SLACK_IDS


class Tokenizer:
    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        max_tokens: int = MAX_TOKENS,
        refused: Counter[str] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._kept: OrderedDict[tuple[str, int, int], array.array[int]] = OrderedDict()
        self._tokens = 0
        self.asked = 0  # requests sent to engines
        self.hits = 0  # prompts answered from the cache
        # Answers refused for too many ids, by engine (the router's metrics: /metrics).
        self.refused = refused if refused is not None else Counter()
        self._failures = RateLimit(period_s=10.0)
        self._said: set[str] = set()  # engines whose refused answers were logged

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
        found = await self._ask(pool, request, most_ids(body, prompt))
        if found is not None:
            self._keep(key, found)
        return found

    async def _ask(self, pool: Pool, request: bytes, most: int) -> array.array[int] | None:
        limit = min(MAX_ANSWER_BYTES, most * ID_BYTES + _ANSWER_HEAD_BYTES)
        try:
            with trio.move_on_after(TIMEOUT_S):
                exchange = await pool.open(b"POST", b"/tokenize", _JSON, request, TIMEOUT_S)
                try:
                    status = exchange.status
                    length = exchange.content_length
                    if status == 200 and length is not None and length > limit:
                        self._refused(pool, f"{length} bytes, more than {limit}")
                        return None
                    body = await exchange.read_body(MAX_ANSWER_BYTES)
                finally:
                    exchange.release()
                if status == 200 and len(body) > limit:
                    self._refused(pool, f"{len(body)} bytes, more than {limit}")
                    return None
                return self._read(pool, status, body, most)
            self._failed(pool, f"no answer within {TIMEOUT_S:g} s")
        except UpstreamError as exc:
            self._failed(pool, str(exc))
        return None

    def _read(
        self, pool: Pool, status: int, body: bytes, most: int = MAX_TOKENS
    ) -> array.array[int] | None:
        if status != 200:
            self._failed(pool, f"it answered {status}")
            return None
        try:
            ids = array.array("I", _decode_answer(body).tokens)  # 0 to 2**32 - 1, checked in C
        except (msgspec.DecodeError, OverflowError):  # ValidationError is a DecodeError
            self._failed(pool, "its answer holds no list of token ids")
            return None
        if len(ids) > most:
            self._refused(pool, f"{len(ids)} ids, more than {most}")
            return None
        return ids

    def _refused(self, pool: Pool, why: str) -> None:
        """An answer bigger than its prompt allows: counted, said once per engine."""
        url = pool.endpoint.url
        self.refused[url] += 1
        if url not in self._said:
            self._said.add(url)
            log.warning(
                "the /tokenize answer of %s holds %s: its prompt's bytes allow no more "
                "(prompt text, chat template, %d more); routing without token ids "
                "(said once; llmgw_tokenize_refused_total counts them)",
                pool.endpoint,
                why,
                SLACK_IDS,
            )

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
