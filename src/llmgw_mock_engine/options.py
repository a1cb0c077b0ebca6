"""The mock engine's command line, in a module that loads nothing heavy: the agent asks
each engine program for `serve --help=all` before its first launch, and argparse answers
it (the mock's usage and status 2: it lists no flags, so the agent checks none) from
here without the engine's imports (trio, the HTTP server: 0.2 s of CPU, 75 times in a
make test). The engine (llmgw_mock_engine.engine) reads its settings with this parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Final

from llmgw_core.engines import LORA_RANKS

# What the engine is, as its help says.
DESCRIPTION: Final = """\
A real OpenAI-compatible engine process that needs no GPU.

It takes the `vllm serve` command line, so the agent's vLLM adapter can launch
it through its real argument construction, and answers deterministically.
Flags (or LLMGW_MOCK_* environment variables) set its pace and failure modes;
`POST /mock/control` changes them while it runs, for tests.

With `--mock-kv-blocks N` (N > 0) it also models an engine's scheduler
(llmgw_mock_engine.scheduler): a paged prefix cache, a shared prefill rate, a decode
rate per sequence and a limit on running sequences with a FIFO queue. It sleeps for
those costs, reports each request's time to first token (the `x-mock-ttft-ms`
response header, `GET /mock/stats`, and vLLM's TTFT histogram on /metrics) and
publishes vLLM's scheduler and prefix-cache metrics. `POST /mock/reset` empties the
cache and the records while nothing runs. Off (the default), none of it costs anything.

With vLLM's `--kv-events-config` (and the scheduler model on) it publishes vLLM's
KV-cache events over ZMQ as the model stores and evicts blocks
(llmgw_mock_engine.kv_publisher), and `POST /tokenize` gives a prompt's token ids as those
events carry them (llmgw_mock_engine.kv_events.token_id).

It serves OpenAI's Responses API and Anthropic's Messages API too, as vLLM 0.32.0 answers
them (llmgw_mock_engine.text_apis), with the answers of its chat completions.
"""

ENCODINGS: Final = ("map", "array")  # of KV-cache events (llmgw_mock_engine.kv_events)


def as_serve(argv: Sequence[str]) -> list[str]:
    """The command line with its command, `serve` (the mock takes it without)."""
    return list(argv) if list(argv[:1]) == ["serve"] else ["serve", *argv]


def is_help(argv: Sequence[str]) -> bool:
    """Whether argparse answers this command line with help (or its usage) alone."""
    return any(a == "-h" or a == "--help" or a.startswith("--help=") for a in argv)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw-mock-engine", description=DESCRIPTION)
    parser.add_argument("command", choices=["serve"], help="serve (as `vllm serve`)")
    parser.add_argument("model", help="the model name it answers for")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="names it answers to (default: MODEL)"
    )
    parser.add_argument(
        "--headless", action="store_true", help="accepted, as vLLM's worker ranks take it"
    )
    # vLLM's LoRA flags (vllm/engine/arg_utils.py, vllm/entrypoints/launchers/cli_args.py):
    # adapters without --enable-lora are refused, as vLLM fails to load them.
    parser.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve the --lora-modules adapters (as vLLM, which needs it to load them)",
    )
    parser.add_argument(
        "--lora-modules", nargs="+", default=[], help="name=path of each adapter it serves"
    )
    parser.add_argument(
        "--max-lora-rank", type=int, choices=LORA_RANKS, help="accepted, within vLLM's choices"
    )
    e = env.get
    parser.add_argument(
        "--api-key",
        default=e("VLLM_API_KEY", ""),
        help="the key every request must carry (default: $VLLM_API_KEY; none)",
    )
    parser.add_argument(
        "--mock-keepalive",
        type=float,
        default=float(e("LLMGW_MOCK_KEEPALIVE", "5")),
        help="seconds an idle connection is kept open (default 5; $LLMGW_MOCK_KEEPALIVE)",
    )
    parser.add_argument(
        "--mock-close-after-stream",
        action="store_true",
        default=e("LLMGW_MOCK_CLOSE_AFTER_STREAM", "") == "1",
        help="close the connection after each stream, as llama-server does",
    )
    parser.add_argument(
        "--mock-unsupported",
        action="append",
        default=[p for p in e("LLMGW_MOCK_UNSUPPORTED", "").split(",") if p],
        help="an endpoint such as /v1/embeddings to answer 501 (repeatable)",
    )
    parser.add_argument(
        "--mock-tokens",
        type=int,
        default=int(e("LLMGW_MOCK_TOKENS", "16")),
        help="tokens in each answer (default 16; $LLMGW_MOCK_TOKENS)",
    )
    parser.add_argument(
        "--mock-tokens-per-second",
        type=float,
        default=float(e("LLMGW_MOCK_TPS", "0")),
        help="pace of a streamed answer (default 0: as fast as it can; $LLMGW_MOCK_TPS)",
    )
    parser.add_argument(
        "--mock-startup-delay",
        type=float,
        default=float(e("LLMGW_MOCK_STARTUP_DELAY", "0")),
        help="seconds /health answers 503 after the start, as an engine loading weights",
    )
    parser.add_argument(
        "--mock-exit-after",
        type=float,
        default=float(e("LLMGW_MOCK_EXIT_AFTER", "0")),
        help="exit with status 3 after this many seconds (default 0: never), a crash",
    )
    parser.add_argument(
        "--mock-fail-status",
        type=int,
        default=int(e("LLMGW_MOCK_FAIL_STATUS", "0")),
        help="answer every inference request with this HTTP status (default 0: no)",
    )
    parser.add_argument(
        "--mock-garbage",
        action="store_true",
        default=e("LLMGW_MOCK_GARBAGE", "") == "1",
        help="answer inference requests with bytes that are not HTTP",
    )
    parser.add_argument(
        "--mock-break-after-chunks",
        type=int,
        default=int(e("LLMGW_MOCK_BREAK_AFTER", "0")),
        help="cut a stream abruptly after this many chunks (default 0: never)",
    )
    parser.add_argument(
        "--mock-sse-ping",
        action="store_true",
        default=e("LLMGW_MOCK_SSE_PING", "") == "1",
        help="send an SSE `: ping` comment before the first chunk",
    )
    model = parser.add_argument_group(
        "scheduler model",
        "an engine's scheduler in miniature, on when --mock-kv-blocks is above 0",
    )
    model.add_argument(
        "--mock-kv-blocks",
        type=int,
        default=int(e("LLMGW_MOCK_KV_BLOCKS", "0")),
        help="KV-cache capacity in blocks; 0 (the default) turns the model off",
    )
    model.add_argument(
        "--mock-block-size",
        type=int,
        default=int(e("LLMGW_MOCK_BLOCK_SIZE", "16")),
        help="tokens per KV block, the prefix cache's unit (default 16, as vLLM)",
    )
    model.add_argument(
        "--mock-prefill-tps",
        type=float,
        default=float(e("LLMGW_MOCK_PREFILL_TPS", "8000")),
        help="uncached prompt tokens per second, shared by the engine (default 8000)",
    )
    model.add_argument(
        "--mock-decode-tps",
        type=float,
        default=float(e("LLMGW_MOCK_DECODE_TPS", "0")),
        help="output tokens per second of each running sequence "
        "(default: --mock-tokens-per-second; 0 there too: unpaced)",
    )
    model.add_argument(
        "--mock-max-seqs",
        type=int,
        default=int(e("LLMGW_MOCK_MAX_SEQS", "16")),
        help="sequences running at once; the rest wait in arrival order (default 16)",
    )
    model.add_argument(
        "--kv-events-config",
        default=e("LLMGW_MOCK_KV_EVENTS_CONFIG"),
        help="vLLM's JSON: with enable_kv_cache_events and publisher zmq, publish vLLM's "
        "KV-cache events from the scheduler model (needs --mock-kv-blocks)",
    )
    model.add_argument(
        "--mock-kv-events-encoding",
        choices=ENCODINGS,
        default=e("LLMGW_MOCK_KV_EVENTS_ENCODING", "map"),
        help="events as maps tagged by type (map: vLLM 0.32.0, the default) or as the "
        "older positional arrays (array)",
    )
    return parser
