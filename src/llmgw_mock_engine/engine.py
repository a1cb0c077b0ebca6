"""The mock engine: what it is and does, in its help's words, is
llmgw_mock_engine.options.DESCRIPTION; its settings come from that module's parser.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import sys
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from llmgw_core.openai_errors import error_body
from llmgw_http.server import HTTPServer, Request, Responder, ServerLimits
from llmgw_mock_engine import messages_api
from llmgw_mock_engine.kv_events import BatchEncoder, KvEventsConfig, token_ids
from llmgw_mock_engine.options import ENCODINGS, as_serve, build_parser
from llmgw_mock_engine.scheduler import (
    Admission,
    EngineModel,
    PromptTooLong,
    Scheduler,
    prompt_tokens,
)
from llmgw_mock_engine.text_apis import MESSAGES as MESSAGES_PATH
from llmgw_mock_engine.text_apis import PATHS as TEXT_API_PATHS
from llmgw_mock_engine.text_apis import TextApis

if TYPE_CHECKING:
    from llmgw_mock_engine.kv_publisher import KvEventPublisher

log = logging.getLogger("llmgw.mock_engine")

_WORDS = tuple(
    "the quick brown fox jumps over a lazy dog while gpus hum in the rack and tokens "
    "stream out one by one to every patient client".split()
)
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]


@attrs.define
class MockSettings:
    model: str
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    tokens: int = 16
    tokens_per_second: float = 0.0  # 0: as fast as it can write
    startup_delay_s: float = 0.0
    exit_after_s: float = 0.0  # 0: never
    fail_status: int = 0  # answer every inference request with this status (0: no)
    retry_after: int = 0  # with fail_status: a Retry-After header in seconds (0: none)
    garbage: bool = False  # answer inference requests with bytes that are not HTTP
    break_after_chunks: int = 0  # close a stream abruptly after N chunks (0: no)
    sse_ping: bool = False  # send a `: ping` comment before the first chunk
    embedding_dim: int = 16
    headless: bool = False  # a non-head rank of a multi-node replica: serves nothing
    # Like the real engines: idle keep-alive connections are closed after this, without
    # `Connection: close` (uvicorn's default --timeout-keep-alive, and llama-server's).
    keepalive_s: float = 5.0
    close_after_stream: bool = False  # close the connection after each stream (llama-server)
    unsupported: tuple[str, ...] = ()  # endpoints answered 501 (llama-server without a flag)
    api_key: str = ""  # required as a bearer token on /v1 (vLLM's --api-key / VLLM_API_KEY)
    # The scheduler model (llmgw_mock_engine.scheduler), on when kv_blocks > 0.
    kv_blocks: int = 0
    block_size: int = 16
    prefill_tps: float = 8000.0
    decode_tps: float = 0.0  # 0: tokens_per_second
    max_seqs: int = 16
    # LoRA adapters, as vLLM's --lora-modules name=path: each name is served too, with
    # answers of its own, and listed with the base as its parent.
    lora_modules: dict[str, str] = attrs.field(factory=dict)
    # vLLM's --kv-events-config, when it enables events (they need the scheduler model).
    kv_events: KvEventsConfig | None = None
    kv_events_encoding: str = "map"  # "map" (vLLM 0.32.0) or "array" (the versions before)

    @property
    def max_model_len(self) -> int:
        """What /tokenize reports: the longest prompt plus answer the model's cache holds
        (4096 with the model off)."""
        return self.kv_blocks * self.block_size if self.kv_blocks > 0 else 4096

    def engine_model(self) -> EngineModel | None:
        if self.kv_blocks <= 0:
            return None
        return EngineModel(
            kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            prefill_tps=self.prefill_tps,
            decode_tps=self.decode_tps or self.tokens_per_second,
            max_seqs=self.max_seqs,
        )


_CONTROLLABLE = (
    "tokens",
    "tokens_per_second",
    "fail_status",
    "retry_after",
    "garbage",
    "break_after_chunks",
    "sse_ping",
)


def parse_args(argv: Sequence[str], env: dict[str, str]) -> MockSettings:
    parser = build_parser(env)
    args, unknown = parser.parse_known_args(list(argv))
    for flag in unknown:
        if flag.startswith("-"):
            log.info("mock engine: accepting and ignoring %s", flag)
    lora_modules = {}
    for item in args.lora_modules:
        name, equals, path = item.partition("=")
        if not equals or not name or "," in item:
            parser.error(f"--lora-modules takes name=path, not {item!r}")
        lora_modules[name] = path
    if lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora (vLLM cannot load them without it)")
    kv_events = None
    if args.kv_events_config is not None:
        try:
            kv_events = KvEventsConfig.parse(args.kv_events_config)
        except ValueError as exc:
            parser.error(str(exc))
        if not kv_events.enabled:
            kv_events = None
        elif args.mock_kv_blocks <= 0:
            parser.error(
                "--kv-events-config enables KV-cache events, which come from the scheduler "
                "model: give --mock-kv-blocks N (N > 0) too"
            )
    if args.mock_kv_events_encoding not in ENCODINGS:  # from the environment: unchecked
        encoding = args.mock_kv_events_encoding
        parser.error(f"--mock-kv-events-encoding takes map or array, not {encoding!r}")
    settings = MockSettings(
        model=args.model,
        served_model_names=args.served_model_name or [args.model],
        host=args.host,
        port=args.port,
        tokens=args.mock_tokens,
        tokens_per_second=args.mock_tokens_per_second,
        startup_delay_s=args.mock_startup_delay,
        exit_after_s=args.mock_exit_after,
        fail_status=args.mock_fail_status,
        garbage=args.mock_garbage,
        break_after_chunks=args.mock_break_after_chunks,
        sse_ping=args.mock_sse_ping,
        headless=args.headless,
        keepalive_s=args.mock_keepalive,
        close_after_stream=args.mock_close_after_stream,
        unsupported=tuple(args.mock_unsupported),
        api_key=args.api_key,
        kv_blocks=args.mock_kv_blocks,
        block_size=args.mock_block_size,
        prefill_tps=args.mock_prefill_tps,
        decode_tps=args.mock_decode_tps,
        max_seqs=args.mock_max_seqs,
        lora_modules=lora_modules,
        kv_events=kv_events,
        kv_events_encoding=args.mock_kv_events_encoding,
    )
    try:
        settings.engine_model()
    except ValueError as exc:
        parser.error(f"the scheduler model: {exc}")
    return settings


def _words(seed_text: str, count: int, start: int = 0) -> Iterator[str]:
    """Generated one at a time: a long stream must not hold its whole answer in memory."""
    seed = zlib.crc32(seed_text.encode())
    return (_WORDS[(seed + i * 7) % len(_WORDS)] for i in range(start, count))


def answer_text(body: dict[str, Any], count: int, adapters: Collection[str] = ()) -> str:
    """The answer of `count` tokens the mock engine gives to a request `body`, serving
    the LoRA adapters named `adapters`."""
    return " ".join(_words(_seed_of(body, adapters), count))


def _seed_of(body: dict[str, Any], adapters: Collection[str]) -> str:
    """What an answer's words are drawn from: the prompt, and for an adapter its name too
    (an adapter answers otherwise than its base, as a real one does)."""
    model = body.get("model")
    prompt = _prompt_of(body)
    return f"{model}\x1f{prompt}" if model in adapters else prompt


def _prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts = []
        for message in body["messages"] or []:
            content = message.get("content") if isinstance(message, dict) else None
            parts.append(content if isinstance(content, str) else json.dumps(content))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


_WORD_SET = frozenset(_WORDS)
_LONGEST_WORD = max(map(len, _WORDS))


def _chat_cut(
    body: dict[str, Any], adapters: Collection[str], tokens: int
) -> tuple[dict[str, Any], int] | None:
    """With `continue_final_message`, a final assistant message that is the first k words
    of the mock's own answer to the messages before it: that request and k. None
    otherwise, and the request is answered afresh, from a seed of all its messages."""
    messages = body.get("messages")
    if not body.get("continue_final_message") or not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None
    text = last.get("content")
    if not isinstance(text, str):
        return None
    original = {**body, "messages": messages[:-1]}
    done = text.count(" ") + 1 if text else 0
    if done > tokens or text != " ".join(_words(_seed_of(original, adapters), done)):
        return None
    return original, done


def _completion_cut(
    body: dict[str, Any], adapters: Collection[str], tokens: int
) -> tuple[dict[str, Any], int] | None:
    """A prompt P + G where G is the first k >= 1 words of the mock's own answer to P
    (the first glued to P, as a completion follows its prompt): that request and the
    longest such k. None when there is none: the prompt is answered afresh.

    G can only be words of _WORDS joined by single spaces, so the split points are
    found walking back at most `tokens` words, whatever the prompt's length."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return None
    after: list[str] = []  # the whole words that end the prompt, the last first
    splits: list[tuple[int, str, int]] = []  # (len(P), G's first word, k), k growing
    end = len(prompt)
    while len(after) < tokens:
        start = prompt.rfind(" ", 0, end) + 1
        splits += [
            (end - len(word), word, len(after) + 1)
            for word in _WORD_SET
            if end - start >= len(word) and prompt.endswith(word, start, end)
        ]
        whole = prompt[start:end] if end - start <= _LONGEST_WORD else ""
        if start == 0 or whole not in _WORD_SET:
            break
        after.append(whole)
        end = start - 1
    for head, first, done in reversed(splits):
        original = {**body, "prompt": prompt[:head]}
        wanted = [first, *reversed(after[: done - 1])]
        if list(_words(_seed_of(original, adapters), done)) == wanted:
            return original, done
    return None


@attrs.frozen
class _Plan:
    """What a (chat) completion request gets: words [done, total) of the answer to the
    request `seed` is drawn from (itself, or the one whose cut answer it continues)."""

    seed: str
    done: int
    total: int
    prompt_tokens: int  # with the scheduler model off
    finish: str

    @property
    def count(self) -> int:
        return self.total - self.done


# vllm:time_to_first_token_seconds's buckets, as vLLM's PrometheusStatLogger declares them
# (vllm/v1/metrics/loggers.py at 005a810bc40faa25b8870fbc8559c3462581eee3).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_INFERENCE_PATHS = (
    b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings", *TEXT_API_PATHS
)  # fmt: skip
_RECORDS_KEPT = 100_000  # per-request records in /mock/stats, the oldest dropped first


@attrs.define
class _Turn:
    """A request the scheduler model has prefilled: its answer is decoded from here."""

    first_token_at: float  # trio time
    decode_tps: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    emitted: list[str] = attrs.field(factory=list)
    completed: bool = False

    def token_at(self, index: int) -> float:
        """When the answer's token `index` (from 0) is ready."""
        return self.first_token_at + (index / self.decode_tps if self.decode_tps > 0 else 0.0)


@attrs.define
class Generation:
    """An answer the Responses and Messages APIs send: the words a chat completion of
    the same messages gets, paced as it is (by the scheduler model's turn when it is on)."""

    words: Iterator[str]
    prompt_tokens: int
    cached_tokens: int | None  # None with the scheduler model off: nothing to report
    turn: _Turn | None
    pace: Callable[[int], Awaitable[None]]

    async def each(self) -> AsyncIterator[str]:
        """Each piece of text as it is ready (a word, after the first with its space)."""
        for i, word in enumerate(self.words):
            if self.turn:
                await trio.sleep_until(self.turn.token_at(i))
                self.turn.emitted.append(word)
            else:
                await self.pace(1)
            yield word if i == 0 else " " + word
        if self.turn:
            self.turn.completed = True

    async def whole(self) -> str:
        return "".join([piece async for piece in self.each()])


class _Modelled:
    """The scheduler model inside the engine: the pure scheduler, the requests waiting for
    it to admit them, and what is reported about them."""

    def __init__(self, model: EngineModel, scheduler: Scheduler | None = None) -> None:
        self.model = model
        self.scheduler = scheduler or Scheduler(model)
        self.wakeups: dict[int, trio.Event] = {}
        self.admitted: dict[int, Admission] = {}
        self.records: deque[dict[str, Any]] = deque(maxlen=_RECORDS_KEPT)
        self.ttft_buckets = [0] * len(_TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.next_id = 0

    def dispatch(self, admissions: list[Admission]) -> None:
        for admission in admissions:
            self.admitted[admission.seq_id] = admission
            self.wakeups[admission.seq_id].set()

    def observe_ttft(self, seconds: float) -> None:
        for i, bound in enumerate(_TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_buckets[i] += 1
        self.ttft_sum += seconds
        self.ttft_count += 1

    def stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {
            "model": attrs.asdict(self.model),
            "running": scheduler.running,
            "waiting": scheduler.waiting,
            "kv_cache_usage": scheduler.kv_usage,
            "cached_blocks": scheduler.cache.cached,
            "evictions": scheduler.cache.evictions,
            "prefix_cache_queries": scheduler.queried_tokens,
            "prefix_cache_hits": scheduler.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "requests": list(self.records),
        }


class MockEngine:
    def __init__(self, settings: MockSettings) -> None:
        self.settings = settings
        self.ready_at = time.monotonic() + settings.startup_delay_s
        self.running = 0
        self.served = 0
        self.counter = 0
        self.fingerprint = f"mock:{settings.port}"
        model = settings.engine_model()
        self.modelled = None
        if model is not None:
            recording = settings.kv_events is not None
            self.modelled = _Modelled(model, Scheduler(model, record_events=recording))
        self.kv_publisher: KvEventPublisher | None = None  # set by main() once open
        self.text_apis = TextApis(self)

    @contextlib.asynccontextmanager
    async def generation(self, chat: dict[str, Any], count: int) -> AsyncIterator[Generation]:
        """The answer of `count` tokens to the chat request `chat` (its model and
        messages), through the scheduler model when it is on (PromptTooLong when the
        prompt cannot fit)."""
        words = _words(_seed_of(chat, self.settings.lora_modules), count)
        tokens = prompt_tokens(chat)
        if self.modelled is None:
            yield Generation(words, len(tokens), None, None, self._pace)
            return
        model = chat.get("model")
        lora = model if isinstance(model, str) and model in self.settings.lora_modules else None
        async with self._scheduled(self.modelled, tokens, count, lora) as turn:
            yield Generation(words, turn.prompt_tokens, turn.cached_tokens, turn, self._pace)

    def _publish_kv_events(self) -> None:
        """Publish what the scheduler model's cache did in the step just taken, as one
        message (nothing when it did nothing)."""
        if self.modelled is not None:
            events = self.modelled.scheduler.take_events()
            if events and self.kv_publisher is not None:
                self.kv_publisher.publish(events)

    async def handle(self, request: Request, responder: Responder) -> None:
        path = request.path
        if path == b"/health":
            if time.monotonic() < self.ready_at:
                await responder.whole(503, b"loading")
            else:
                await responder.whole(200, b"", [])
            return
        if path == b"/metrics":
            await responder.whole(200, self._metrics(), [(b"content-type", b"text/plain")])
            return
        if self.settings.api_key and path.startswith(b"/v1") and not self._authorized(request):
            await responder.whole(401, b'{"error": "Unauthorized"}')  # vLLM's answer
            return
        if path == b"/v1/models":
            await responder.whole(200, self._models())
            return
        if path == b"/mock/control" and request.method == b"POST":
            await self._control(request, responder)
            return
        if path == b"/mock/stats" and request.method == b"GET":
            stats = self.modelled.stats() if self.modelled else {"model": None, "requests": []}
            if self.kv_publisher is not None:
                stats["kv_events"] = self.kv_publisher.stats()
            stats["stored_responses"] = self.text_apis.stats()
            await responder.whole(200, json.dumps(stats).encode())
            return
        if path == b"/mock/reset" and request.method == b"POST":
            await self._reset(responder)
            return
        if path == b"/tokenize" and "/tokenize" not in self.settings.unsupported:
            # Outside /v1, so open without the key, as vLLM guards only /v1 (and /v2, ...).
            if request.method != b"POST":
                await responder.error(405, "use POST")
            else:
                await self._tokenize(request, responder)
            return
        if path.startswith(b"/v1/responses/"):
            await self.text_apis.stored(request, responder)
            return
        if path not in _INFERENCE_PATHS:
            # Said to be the engine's: a client must not read it as llmgw lacking the path.
            await responder.error(404, f"mock engine: no route {path.decode(errors='replace')}")
            return
        if path.decode() in self.settings.unsupported:
            # llama-server's answer to /v1/embeddings when started without --embeddings.
            message = f"This server does not support {path.decode()}"
            await responder.whole(501, error_body(501, message, "not_supported_error"))
            return
        if request.method != b"POST":
            await responder.error(405, "use POST")
            return
        if time.monotonic() < self.ready_at:
            await responder.error(503, "the model is still loading")
            return
        settings = self.settings
        if settings.garbage:
            await responder.send_raw(b"\x00\x01garbage from a broken engine\r\n\r\n")
            await responder.abort()
            return
        if settings.fail_status:
            body = error_body(settings.fail_status, "mock engine failing as asked")
            headers = list(_JSON)
            if settings.retry_after:
                headers.append((b"retry-after", str(settings.retry_after).encode()))
            await responder.whole(settings.fail_status, body, headers)
            return
        asked = await _json_object(request, responder)
        if asked is None:
            return
        model = asked.get("model")
        if model not in settings.served_model_names and model not in settings.lora_modules:
            message = f"the model {model!r} does not exist"
            if path.startswith(MESSAGES_PATH):
                await responder.whole(404, messages_api.error(404, message))
            else:
                await responder.error(404, message)
            return
        self.running += 1
        try:
            if path == b"/v1/embeddings":
                await self._embeddings(asked, responder)
            elif path in TEXT_API_PATHS:
                request_id = request.header(b"x-request-id")
                await self.text_apis.create(path, asked, responder, request_id)
            else:
                await self._generate(path == b"/v1/chat/completions", asked, responder)
            self.served += 1
        finally:
            self.running -= 1

    def _authorized(self, request: Request) -> bool:
        value = request.header(b"authorization") or b""
        return hmac.compare_digest(value, b"Bearer " + self.settings.api_key.encode())

    async def _control(self, request: Request, responder: Responder) -> None:
        try:
            changes = json.loads(request.body)
            for key, value in changes.items():
                if key not in _CONTROLLABLE:
                    raise ValueError(f"{key} cannot be changed")
                setattr(self.settings, key, type(getattr(self.settings, key))(value))
        except (ValueError, AttributeError, TypeError) as exc:
            await responder.error(400, str(exc))
            return
        await responder.whole(200, json.dumps(attrs.asdict(self.settings)).encode())

    async def _reset(self, responder: Responder) -> None:
        modelled = self.modelled
        if modelled is None:
            await responder.error(409, "the scheduler model is off (--mock-kv-blocks 0)")
            return
        if modelled.scheduler.running or modelled.scheduler.waiting:
            await responder.error(409, "requests are still scheduled: reset when idle")
            return
        modelled.scheduler.reset()
        self._publish_kv_events()  # AllBlocksCleared
        self.modelled = _Modelled(modelled.model, modelled.scheduler)
        await responder.whole(200, b"{}")

    async def _tokenize(self, request: Request, responder: Responder) -> None:
        """vLLM's POST /tokenize (vllm/entrypoints/serve/tokenize/protocol.py, 0.32.0):
        `{"model", "prompt"}` or `{"model", "messages", "add_generation_prompt"}` (true by
        default), answered `{"count", "max_model_len", "tokens", "token_strs"}`; the
        tokens are the ids of the words the scheduler model sees, token_strs the words
        with `return_token_strs`."""
        settings = self.settings
        body = await _json_object(request, responder)
        if body is None:
            return
        model = body.get("model")
        if model is not None and model not in settings.served_model_names and (
            model not in settings.lora_modules
        ):
            await responder.error(404, f"The model `{model}` does not exist.")
            return
        if isinstance(body.get("messages"), list):
            words = prompt_tokens({"messages": body["messages"]})
            if body.get("add_generation_prompt", True) is False:
                words.pop()  # the generation prompt <|assistant|> comes last
        elif isinstance(body.get("prompt"), str):
            words = prompt_tokens({"prompt": body["prompt"]})
        else:
            await responder.error(400, "give a string prompt or a list of messages")
            return
        answer = {
            "count": len(words),
            "max_model_len": settings.max_model_len,
            "tokens": token_ids(words),
            "token_strs": words if body.get("return_token_strs") else None,
        }
        await responder.whole(200, json.dumps(answer).encode(), list(_JSON))

    async def _generate(self, chat: bool, body: dict[str, Any], responder: Responder) -> None:
        settings = self.settings
        no_generation_prompt = chat and body.get("add_generation_prompt", True) is False
        if chat and body.get("continue_final_message") and not no_generation_prompt:
            message = "continue_final_message and add_generation_prompt cannot both be true"
            await responder.error(400, message)
            return
        # A router that resumes a broken stream elsewhere sends the answer so far.
        cut_of = _chat_cut if chat else _completion_cut
        original, done = cut_of(body, settings.lora_modules, settings.tokens) or (body, 0)
        total = settings.tokens
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, int) and limit > 0:
            total = min(total, done + limit)
        plan = _Plan(
            seed=_seed_of(original, settings.lora_modules),
            done=done,
            total=total,
            prompt_tokens=len(_prompt_of(original).split()) + done,
            finish="length" if total == settings.tokens or total - done == limit else "stop",
        )
        if self.modelled is None:
            await self._answer(chat, body, responder, plan, None)
            return
        tokens = prompt_tokens(body)
        if no_generation_prompt:
            tokens.pop()  # as /tokenize: its <|assistant|> comes last
        model = body.get("model")
        lora = model if isinstance(model, str) and model in settings.lora_modules else None
        try:
            async with self._scheduled(self.modelled, tokens, plan.count, lora) as turn:
                await self._answer(chat, body, responder, plan, turn)
        except PromptTooLong as exc:
            await responder.error(400, str(exc))

    @contextlib.asynccontextmanager
    async def _scheduled(
        self, modelled: _Modelled, tokens: list[str], count: int, lora: str | None
    ) -> AsyncIterator[_Turn]:
        """Queue for the scheduler model, sleep through the prefill, then decode; on the
        way out (done, broken or gone), leave the scheduler and record the request."""
        scheduler = modelled.scheduler
        seq_id = modelled.next_id
        modelled.next_id += 1
        arrival = trio.current_time()
        arrival_wall = time.monotonic()  # one clock for every process on the machine
        wakeup = modelled.wakeups[seq_id] = trio.Event()
        try:
            admissions = scheduler.submit(seq_id, tokens, count, arrival, lora)
        except PromptTooLong:
            del modelled.wakeups[seq_id]
            raise
        self._publish_kv_events()  # blocks evicted to admit it
        turn: _Turn | None = None
        admission: Admission | None = None
        try:
            modelled.dispatch(admissions)
            await wakeup.wait()
            admission = modelled.admitted.pop(seq_id)
            await trio.sleep_until(admission.first_token_at)
            scheduler.prefilled(seq_id)
            self._publish_kv_events()  # its prompt's blocks stored
            now = trio.current_time()
            turn = _Turn(
                first_token_at=now,
                decode_tps=self.settings.decode_tps or self.settings.tokens_per_second,
                ttft_s=now - arrival,
                prompt_tokens=len(tokens),
                cached_tokens=admission.cached_tokens,
            )
            modelled.observe_ttft(turn.ttft_s)
            modelled.prompt_tokens += len(tokens)
            yield turn
        finally:
            del modelled.wakeups[seq_id]
            modelled.admitted.pop(seq_id, None)
            emitted = turn.emitted if turn else []
            modelled.generation_tokens += len(emitted)
            modelled.dispatch(scheduler.finish(seq_id, emitted, trio.current_time()))
            self._publish_kv_events()  # its answer's blocks stored, others' evictions
            modelled.records.append(
                {
                    "id": seq_id,
                    "arrival": arrival_wall,
                    "end": time.monotonic(),
                    "queued_s": admission.admitted_at - arrival if admission else None,
                    "ttft_s": turn.ttft_s if turn else None,
                    "prompt_tokens": len(tokens),
                    "cached_tokens": admission.cached_tokens if admission else 0,
                    "output_tokens": len(emitted),
                    "completed": turn.completed if turn else False,
                }
            )

    async def _answer(
        self,
        chat: bool,
        body: dict[str, Any],
        responder: Responder,
        plan: _Plan,
        turn: _Turn | None,
    ) -> None:
        settings = self.settings
        count = plan.count
        words = _words(plan.seed, plan.total, plan.done)
        prompt_tokens = turn.prompt_tokens if turn else plan.prompt_tokens
        self.counter += 1
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-mock-{self.counter}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": self.fingerprint,
        }
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "total_tokens": prompt_tokens + count,
        }
        headers = []
        if turn:
            # vLLM reports this with --enable-prompt-tokens-details.
            usage["prompt_tokens_details"] = {"cached_tokens": turn.cached_tokens}
            headers.append((b"x-mock-ttft-ms", f"{turn.ttft_s * 1000:.3f}".encode()))
        finish = plan.finish
        if not body.get("stream"):
            if turn:
                await trio.sleep_until(turn.token_at(count - 1))
                turn.emitted = list(words)
                words = iter(turn.emitted)
            else:
                await self._pace(count)
            text = "".join(" " + w for w in words)
            if not plan.done:
                text = text.lstrip()  # a continuation's text follows its first part's
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            answer = {
                **base,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [choice],
                "usage": usage,
            }
            await responder.whole(200, json.dumps(answer).encode(), [*_JSON, *headers])
            if turn:
                turn.completed = True
            return
        await responder.start(200, [*_SSE, *headers])
        if settings.sse_ping:
            await responder.send(b": ping\n\n")
        chunks = 0

        async def emit(choice: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
            nonlocal chunks
            if settings.break_after_chunks and chunks >= settings.break_after_chunks:
                await responder.abort()
                raise trio.ClosedResourceError("broken on purpose")
            event = {**base, "choices": [choice], **(extra or {})}
            await responder.send(b"data: " + json.dumps(event).encode() + b"\n\n")
            chunks += 1

        if chat:
            await emit(
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            )
        for i, word in enumerate(words):
            if turn:
                await trio.sleep_until(turn.token_at(i))
                turn.emitted.append(word)
            else:
                await self._pace(1)
            piece = word if i == 0 and not plan.done else " " + word
            if chat:
                await emit({"index": 0, "delta": {"content": piece}, "finish_reason": None})
            else:
                await emit({"index": 0, "text": piece, "finish_reason": None})
        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        await emit(last)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            event = {**base, "choices": [], "usage": usage}
            await responder.send(b"data: " + json.dumps(event).encode() + b"\n\n")
        await responder.send(b"data: [DONE]\n\n")
        await responder.end()
        if turn:
            turn.completed = True
        if settings.close_after_stream:
            await responder.abort()  # as llama-server: the connection ends with the stream

    async def _pace(self, tokens: int) -> None:
        tps = self.settings.tokens_per_second
        if tps > 0:
            await trio.sleep(tokens / tps)

    async def _embeddings(self, body: dict[str, Any], responder: Responder) -> None:
        raw = body.get("input", "")
        inputs = raw if isinstance(raw, list) else [raw]
        data = []
        for i, item in enumerate(inputs):
            seed = zlib.crc32(json.dumps(item).encode())
            dim = self.settings.embedding_dim
            vector = [((seed >> (j % 24)) % 1000) / 1000.0 - 0.5 for j in range(dim)]
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(len(json.dumps(item).split()) for item in inputs)
        answer = {
            "object": "list",
            "data": data,
            "model": body["model"],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        await responder.whole(200, json.dumps(answer).encode())

    def _models(self) -> bytes:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmgw-mock",
                "root": self.settings.model,
                # As vLLM's base models carry it (its adapters do not): clients size
                # prompts from it.
                "max_model_len": self.settings.max_model_len,
            }
            for name in self.settings.served_model_names
        ]
        # As vLLM lists its adapters (vllm/entrypoints/openai/models/serving.py:149-160).
        data += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmgw-mock",
                "root": path,
                "parent": self.settings.served_model_names[0],
            }
            for name, path in self.settings.lora_modules.items()
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    def _metrics(self) -> bytes:
        name = self.settings.served_model_names[0]
        label = f'{{model_name="{name}"}}'
        running, waiting, usage = self.running, 0, min(1.0, self.running / 256)
        if self.modelled:
            scheduler = self.modelled.scheduler
            running, waiting, usage = scheduler.running, scheduler.waiting, scheduler.kv_usage
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {usage:.4f}",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{label} {self.served}",
        ]
        if self.modelled:
            lines += self._model_metrics(self.modelled, name)
        return ("\n".join(lines) + "\n").encode()

    def _model_metrics(self, modelled: _Modelled, name: str) -> list[str]:
        """The rest of vLLM's metrics the model can give, under vLLM's names (counters in
        tokens, as PrometheusStatLogger in vllm/v1/metrics/loggers.py at
        005a810bc40faa25b8870fbc8559c3462581eee3 declares them; prometheus_client adds the
        `_total` of a counter)."""
        label = f'{{model_name="{name}"}}'
        model, scheduler = modelled.model, modelled.scheduler
        info = (
            f'{{block_size="{model.block_size}",num_gpu_blocks="{model.kv_blocks}",'
            f'enable_prefix_caching="True",model_name="{name}"}}'
        )
        lines = [
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{info} 1",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} {scheduler.queried_tokens}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} {scheduler.hit_tokens}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {modelled.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {modelled.generation_tokens}",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        for bound, count in zip(_TTFT_BUCKETS, modelled.ttft_buckets, strict=True):
            lines.append(
                f'vllm:time_to_first_token_seconds_bucket{{le="{bound}",model_name="{name}"}} '
                f"{count}"
            )
        lines += [
            f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{name}"}} '
            f"{modelled.ttft_count}",
            f"vllm:time_to_first_token_seconds_count{label} {modelled.ttft_count}",
            f"vllm:time_to_first_token_seconds_sum{label} {modelled.ttft_sum}",
        ]
        return lines


async def main(
    settings: MockSettings,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `task_status.started(port)` once listening."""
    if settings.headless:
        log.info("mock engine: headless rank for %s, serving nothing", settings.model)
        task_status.started(0)
        await trio.sleep_forever()
    engine = MockEngine(settings)
    server = HTTPServer(engine.handle, ServerLimits(keepalive_timeout_s=settings.keepalive_s))
    listeners = await trio.open_tcp_listeners(settings.port, host=settings.host)
    port = listeners[0].socket.getsockname()[1]
    engine.fingerprint = f"mock:{port}"
    async with trio.open_nursery() as nursery:
        if settings.kv_events is not None:
            # Imported here: pyzmq costs nothing to an engine that publishes no events.
            from llmgw_mock_engine.kv_publisher import KvEventPublisher

            encoder = BatchEncoder(
                block_size=settings.block_size,
                encoding=settings.kv_events_encoding,
                adapters=tuple(settings.lora_modules),
            )
            publisher = KvEventPublisher(settings.kv_events, encoder)
            await nursery.start(publisher.run)
            engine.kv_publisher = publisher
        await nursery.start(server.serve, listeners)
        if settings.exit_after_s > 0:
            nursery.start_soon(_exit_after, settings.exit_after_s)
        print(
            f"mock engine serving {settings.served_model_names} on http://{settings.host}:{port}",
            file=sys.stderr,
            flush=True,
        )
        task_status.started(port)


async def _exit_after(seconds: float) -> None:
    await trio.sleep(seconds)
    print(
        f"mock engine: exiting after {seconds} s as asked (--mock-exit-after)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(3)


def serve(argv: Sequence[str]) -> None:
    """Serve as the command line `argv` says (llmgw_mock_engine.cli), until a signal."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = parse_args(as_serve(argv), dict(os.environ))
    try:
        trio.run(main, settings)
    except* KeyboardInterrupt:  # trio raises it inside a group: suppress() missed it
        pass


async def _json_object(request: Request, responder: Responder) -> dict[str, Any] | None:
    """The request's JSON object; None once a 400 said why it is none."""
    try:
        body = json.loads(request.body)
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    except ValueError as exc:
        await responder.error(400, f"invalid JSON: {exc}")
        return None
    return body
