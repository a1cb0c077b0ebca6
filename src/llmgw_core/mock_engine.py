"""A real OpenAI-compatible engine process that needs no GPU.

It takes the `vllm serve` command line, so the agent's vLLM adapter can launch
it through its real argument construction, and answers deterministically.
Flags (or LLMGW_MOCK_* environment variables) set its pace and failure modes;
`POST /mock/control` changes them while it runs, for tests.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import trio

from llmgw_core.http_server import HTTPServer, Request, Responder, ServerLimits
from llmgw_core.openai_errors import error_body

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
    parser = argparse.ArgumentParser(prog="llmgw-mock-engine", description=__doc__)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--headless", action="store_true")
    e = env.get
    parser.add_argument("--api-key", default=e("VLLM_API_KEY", ""))
    parser.add_argument(
        "--mock-keepalive", type=float, default=float(e("LLMGW_MOCK_KEEPALIVE", "5"))
    )
    parser.add_argument(
        "--mock-close-after-stream",
        action="store_true",
        default=e("LLMGW_MOCK_CLOSE_AFTER_STREAM", "") == "1",
    )
    parser.add_argument(
        "--mock-unsupported",
        action="append",
        default=[p for p in e("LLMGW_MOCK_UNSUPPORTED", "").split(",") if p],
        help="an endpoint such as /v1/embeddings to answer 501 (repeatable)",
    )
    parser.add_argument("--mock-tokens", type=int, default=int(e("LLMGW_MOCK_TOKENS", "16")))
    parser.add_argument(
        "--mock-tokens-per-second", type=float, default=float(e("LLMGW_MOCK_TPS", "0"))
    )
    parser.add_argument(
        "--mock-startup-delay", type=float, default=float(e("LLMGW_MOCK_STARTUP_DELAY", "0"))
    )
    parser.add_argument(
        "--mock-exit-after", type=float, default=float(e("LLMGW_MOCK_EXIT_AFTER", "0"))
    )
    parser.add_argument(
        "--mock-fail-status", type=int, default=int(e("LLMGW_MOCK_FAIL_STATUS", "0"))
    )
    parser.add_argument(
        "--mock-garbage", action="store_true", default=e("LLMGW_MOCK_GARBAGE", "") == "1"
    )
    parser.add_argument(
        "--mock-break-after-chunks", type=int, default=int(e("LLMGW_MOCK_BREAK_AFTER", "0"))
    )
    parser.add_argument(
        "--mock-sse-ping", action="store_true", default=e("LLMGW_MOCK_SSE_PING", "") == "1"
    )
    args, unknown = parser.parse_known_args(list(argv))
    for flag in unknown:
        if flag.startswith("-"):
            log.info("mock engine: accepting and ignoring %s", flag)
    return MockSettings(
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
    )


def _words(seed_text: str, count: int) -> Iterator[str]:
    """Generated one at a time: a long stream must not hold its whole answer in memory."""
    seed = zlib.crc32(seed_text.encode())
    return (_WORDS[(seed + i * 7) % len(_WORDS)] for i in range(count))


def _prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts = []
        for message in body["messages"] or []:
            content = message.get("content") if isinstance(message, dict) else None
            parts.append(content if isinstance(content, str) else json.dumps(content))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class MockEngine:
    def __init__(self, settings: MockSettings) -> None:
        self.settings = settings
        self.ready_at = time.monotonic() + settings.startup_delay_s
        self.running = 0
        self.served = 0
        self.counter = 0
        self.fingerprint = f"mock:{settings.port}"

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
        if path not in (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"):
            await responder.error(404, f"no route {path.decode(errors='replace')}")
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
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            await responder.error(400, f"invalid JSON: {exc}")
            return
        model = body.get("model")
        if model not in settings.served_model_names:
            await responder.error(404, f"the model {model!r} does not exist")
            return
        self.running += 1
        try:
            if path == b"/v1/embeddings":
                await self._embeddings(body, responder)
            else:
                await self._generate(path == b"/v1/chat/completions", body, responder)
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

    async def _generate(self, chat: bool, body: dict[str, Any], responder: Responder) -> None:
        settings = self.settings
        count = settings.tokens
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, int) and 0 < limit < count:
            count = limit
        prompt = _prompt_of(body)
        words = _words(prompt, count)
        prompt_tokens = len(prompt.split())
        self.counter += 1
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-mock-{self.counter}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": self.fingerprint,
        }
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "total_tokens": prompt_tokens + count,
        }
        finish = "length" if count == settings.tokens or count == limit else "stop"
        if not body.get("stream"):
            await self._pace(count)
            text = "".join(" " + w for w in words).lstrip()
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
            await responder.whole(200, json.dumps(answer).encode())
            return
        await responder.start(200, _SSE)
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
            await self._pace(1)
            piece = word if i == 0 else " " + word
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
            }
            for name in self.settings.served_model_names
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    def _metrics(self) -> bytes:
        name = self.settings.served_model_names[0]
        label = f'{{model_name="{name}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {min(1.0, self.running / 256):.4f}",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{label} {self.served}",
        ]
        return ("\n".join(lines) + "\n").encode()


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


def cli(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if list(argv) == ["--version"]:
        from llmgw_core import __version__

        print(f"llmgw-mock-engine {__version__}")
        return
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    settings = parse_args(argv, dict(os.environ))
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main, settings)


if __name__ == "__main__":
    cli()
