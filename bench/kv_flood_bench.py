#!/usr/bin/env python3
"""KV-flood benchmark: one engine floods a `precise` router; what do other models feel?

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/kv_flood_bench.py                       # about 2 minutes
    .venv/bin/python bench/kv_flood_bench.py --llmgw-src /tmp/base/src   # another checkout's
    .venv/bin/python bench/kv_flood_bench.py --quick               # a smoke test

What it starts, all on loopback ports of this machine:
- a flooding engine (this file, `engine` mode: the standard library's HTTP server, pyzmq):
  model `flood`, publishing vLLM's KV-cache events (ZMQ PUB, msgpack, vLLM 0.32.0's map
  encoding) with a replay socket (ROUTER, as vLLM's: all at once, dropped past zmq's
  high-water mark) that answers each request, during a flood, with `--replay-messages`
  3.8 MiB messages from the sequence number asked;
- a quiet engine (the same code, no events): model `other`, answering chat completions
  after `--engine-delay-ms` (the unrelated traffic's own latency);
- llmgw's router (this checkout's code, or `--llmgw-src`) with `balancing = "precise"`,
  both models, the flooding engine's `kv_events` and `kv_replay` named.

Load, open loop from this process: `--rate` chat requests a second for `other` (measured),
`--flood-requests` a second for `flood` (each a new prompt, so the router asks the flooding
engine's /tokenize every time). The run alternates phases of `--phase-s` seconds:
- quiet: the flooding engine publishes a small valid message twice a second and answers
  /tokenize with a few ids;
- flood: it publishes valid 3.8 MiB BlockStored messages (65,536 blocks of 16 tokens, the
  decoder's caps) at `--flood-rate` a second, skips a sequence number every `--gap-every`
  messages (a router in step then asks for a replay: 64 such messages, 243 MiB), and
  answers /tokenize with 4M ids (8 MB, under the router's answer cap).

Reported: p50/p99/max latency of `other`'s requests in each kind of phase (all rounds
together, and per round), their p99 ratio (flood / quiet; the target is at most 2), the
router's peak RSS and CPU, what the engines saw (events, replays, /tokenize answers) and
the router's own counters of what it dropped. JSON to bench/results/kv_flood.json.
Exit status 0 when the benchmark ran, 2 when it could not.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOG_DIR = RESULTS / "kv_flood-logs"
BLOCKS, BLOCK_SIZE = 65_536, 16  # the decoder's caps: MAX_BLOCKS_PER_EVENT, 1M tokens
TOKENIZE_IDS = 4_000_000  # "1," each: 8 MB, under the router's 8 MiB answer cap
COUNTERS = (  # the router's, read from its /metrics at the end
    "llmgw_kv_events_dropped_total",
    "llmgw_tokenize_refused_total",
    "llmgw_kv_event_batches_total",
)


# -- the engines (`engine` mode, a process of their own) ---------------------------------


def flood_payloads(count: int) -> list[bytes]:
    """Valid BlockStored batches of about 3.8 MiB, each with its own hashes and tokens."""
    import msgpack

    rng = random.Random(7)
    out = []
    for k in range(count):
        # A third of the ids past 65,535 (5 bytes each in msgpack), as a 128k vocabulary's.
        tokens = [rng.randrange(70_000, 128_000) if i % 3 == 0 else rng.randrange(1, 60_000)
                  for i in range(BLOCKS * BLOCK_SIZE)]  # fmt: skip
        event = {
            "type": "BlockStored",
            "block_hashes": list(range(k * BLOCKS + 1, (k + 1) * BLOCKS + 1)),
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": BLOCK_SIZE,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        out.append(msgpack.packb([time.time(), [event], 0]))
    return out


def small_payload(seq: int) -> bytes:
    import msgpack

    event = {
        "type": "BlockStored",
        "block_hashes": [10**9 + seq],
        "parent_block_hash": None,
        "token_ids": [seq % 50_000 + i for i in range(BLOCK_SIZE)],
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgpack.packb([time.time(), [event], 0])  # type: ignore[no-any-return]


class FakeEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.flood = False
        self.stats = {"published": 0, "published_bytes": 0, "gaps": 0, "replays": 0,
                      "replayed": 0, "tokenize": 0, "tokenize_big": 0, "chat": 0}  # fmt: skip
        self.lock = threading.Lock()
        self.payloads = flood_payloads(4) if args.events else []
        self.big_tokenize = (
            b'{"count":%d,"max_model_len":8192,"tokens":[' % TOKENIZE_IDS
            + b"1," * (TOKENIZE_IDS - 1)
            + b"1]}"
        )

    def serve_events(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{self.args.events}")
        replay = ctx.socket(zmq.ROUTER)  # vLLM's: not mandatory, drops past its HWM
        replay.setsockopt(zmq.LINGER, 0)
        replay.bind(f"tcp://127.0.0.1:{self.args.replay}")
        seq, sent, next_at = 0, 0, time.monotonic()
        while True:
            if replay.poll(0):
                frames = replay.recv_multipart()
                if len(frames) == 3:
                    start = int.from_bytes(frames[2], "big")
                    # Hostile: `--replay-messages` big messages from `start` on, whatever
                    # it sent (as many as vLLM's would when they were that big).
                    n = self.args.replay_messages if self.flood else 0
                    for i in range(n):
                        payload = self.payloads[i % len(self.payloads)]
                        with contextlib.suppress(zmq.Again):
                            replay.send_multipart(
                                [frames[0], b"", b"", (start + i).to_bytes(8, "big"), payload],
                                zmq.NOBLOCK,
                            )
                    with contextlib.suppress(zmq.Again):
                        replay.send_multipart(
                            [frames[0], b"", b"", (-1).to_bytes(8, "big", signed=True), b""],
                            zmq.NOBLOCK,
                        )
                    with self.lock:
                        self.stats["replays"] += 1
                        self.stats["replayed"] += n
            now = time.monotonic()
            if now < next_at:
                time.sleep(min(next_at - now, 0.005))
                continue
            if self.flood:
                next_at = now + 1.0 / self.args.flood_rate
                payload = self.payloads[sent % len(self.payloads)]
                sent += 1
                if self.args.gap_every and sent % self.args.gap_every == 0:
                    seq += 1  # never sent: a gap
                    with self.lock:
                        self.stats["gaps"] += 1
            else:
                next_at = now + 0.5
                payload = small_payload(seq)
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            with self.lock:
                self.stats["published"] += 1
                self.stats["published_bytes"] += len(payload)

    def handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                # Head and body go out as two writes: without it, Nagle's algorithm and the
                # peer's delayed ACK hold the body back 40 ms.
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, b"{}")
                elif self.path == "/v1/models":
                    card = {"id": engine.args.model, "object": "model", "owned_by": "bench"}
                    self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
                elif self.path == "/bench/stats":
                    with engine.lock:
                        self._send(200, json.dumps(engine.stats).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path == "/bench/flood":
                    engine.flood = json.loads(body)["on"]
                    self._send(200, b"{}")
                elif self.path == "/tokenize":
                    with engine.lock:
                        engine.stats["tokenize"] += 1
                        engine.stats["tokenize_big"] += engine.flood
                    if engine.flood:
                        self._send(200, engine.big_tokenize)
                    else:
                        ids = list(range(1, 40))
                        self._send(200, json.dumps({"count": len(ids), "tokens": ids}).encode())
                elif self.path == "/v1/chat/completions":
                    time.sleep(engine.args.delay_ms / 1000)
                    with engine.lock:
                        engine.stats["chat"] += 1
                    answer = {
                        "id": "cmpl-1", "object": "chat.completion", "model": engine.args.model,
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "ok"}}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                    }  # fmt: skip
                    self._send(200, json.dumps(answer).encode())
                else:
                    self._send(404, b"{}")

        return Handler


def engine_main(args: argparse.Namespace) -> int:
    engine = FakeEngine(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), engine.handler())
    server.daemon_threads = True
    if args.events:
        threading.Thread(target=engine.serve_events, daemon=True).start()
    print(f"engine {args.model} serving on http://127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()
    return 0


# -- the bench ---------------------------------------------------------------------------


class BenchError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, name: str, argv: list[str], ready: str, env: dict[str, str]) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log = LOG_DIR / f"{name}.log"
        self.proc = subprocess.Popen(
            argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        deadline = time.monotonic() + 60
        while True:
            found = re.search(ready, self.log.read_text())
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{name} never served: see {self.log}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss_peak_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request(url: str, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float = 60.0) -> tuple[int, bytes]:  # fmt: skip
    host = url.split("//", 1)[1]
    conn = http.client.HTTPConnection(host, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Load:
    """Open-loop requests at a fixed rate; each one's latency from when it was due."""

    def __init__(self, url: str, model: str, rate: float, fresh_prompts: bool) -> None:
        self.url, self.model, self.rate, self.fresh = url, model, rate, fresh_prompts
        self.samples: list[tuple[str, float, float, int]] = []  # phase, due, latency, status
        self.phase = "warmup"
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(64)
        self._local = threading.local()
        self._n = 0

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(
                self.url.split("//", 1)[1], timeout=60
            )
        return conn  # type: ignore[no-any-return]

    def _one(self, due: float, phase: str, n: int) -> None:
        words = " ".join(f"w{random.randrange(10**6)}" for _ in range(20)) if self.fresh else "hi"
        body = json.dumps({
            "model": self.model, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"request {n}: {words}"}],
        }).encode()  # fmt: skip
        status = 0
        try:
            conn = self._conn()
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            response = conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            self._local.conn = None
        self.samples.append((phase, due, time.perf_counter() - due, status))

    def run(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            due += 1.0 / self.rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            self._n += 1
            self._pool.submit(self._one, due, self.phase, self._n)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(samples: list[tuple[str, float, float, int]], phase: str) -> dict[str, Any]:
    mine = [s for s in samples if s[0] == phase]
    ok = [s[2] * 1000 for s in mine if s[3] == 200]
    return {
        "requests": len(mine),
        "errors": sum(s[3] != 200 for s in mine),
        "p50_ms": round(quantile(ok, 0.5), 1),
        "p99_ms": round(quantile(ok, 0.99), 1),
        "max_ms": round(max(ok, default=float("nan")), 1),
    }


def metric_lines(url: str, names: tuple[str, ...]) -> list[str]:
    status, body = request(url, "GET", "/metrics")
    if status != 200:
        return []
    return [line for line in body.decode().splitlines() if line.startswith(names)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(args.llmgw_src), env.get("PYTHONPATH")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    me = [sys.executable, str(Path(__file__).resolve()), "engine"]
    events, replay = free_port(), free_port()
    procs: list[Proc] = []
    try:
        flood = Proc("engine-flood", [*me, "--model", "flood", "--port", "0", "--events",
                     str(events), "--replay", str(replay), "--delay-ms", "5",
                     "--flood-rate", str(args.flood_rate), "--gap-every", str(args.gap_every),
                     "--replay-messages", str(args.replay_messages)],
                     r"serving on (http://\S+)", env)  # fmt: skip
        procs.append(flood)
        other = Proc("engine-other", [*me, "--model", "other", "--port", "0", "--delay-ms",
                     str(args.engine_delay_ms)], r"serving on (http://\S+)", env)  # fmt: skip
        procs.append(other)
        config = LOG_DIR / "router.toml"
        config.write_text(
            "# written by bench/kv_flood_bench.py\n"
            '[server]\nlisten = "127.0.0.1:0"\nshutdown_grace_s = 1\n'
            '\n[router]\nbalancing = "precise"\n'
            '\n[[models]]\nname = "flood"\n'
            f'endpoints = [{{ url = "{flood.url}", kv_events = "tcp://127.0.0.1:{events}", '
            f'kv_replay = "tcp://127.0.0.1:{replay}" }}]\n'
            f'\n[[models]]\nname = "other"\nendpoints = ["{other.url}"]\n'
        )
        router = Proc("router", [sys.executable, "-m", "llmgw_server", "--config", str(config)],
                      r"listening on (http://127\.0\.0\.1:\d+)", env)  # fmt: skip
        procs.append(router)
        deadline = time.monotonic() + 30
        while request(router.url, "GET", "/readyz")[0] != 200:
            if time.monotonic() > deadline:
                raise BenchError("the router never became ready")
            time.sleep(0.2)
        measured = Load(router.url, "other", args.rate, fresh_prompts=False)
        flooding = Load(router.url, "flood", args.flood_requests, fresh_prompts=True)
        measured.start()
        flooding.start()
        time.sleep(args.warmup_s)
        cpu0 = router.cpu_s()
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for phase in ("quiet", "flood"):
                request(flood.url, "POST", "/bench/flood", {"on": phase == "flood"})
                label = f"{phase}-{r}"
                measured.phase = flooding.phase = label
                time.sleep(args.phase_s)
                rounds.append({"phase": label, **summary(measured.samples, label)})
                print(f"  {label}: {rounds[-1]}", flush=True)
        request(flood.url, "POST", "/bench/flood", {"on": False})
        measured.phase = flooding.phase = "cooldown"
        measured.stop()
        flooding.stop()
        cpu = router.cpu_s() - cpu0
        samples = measured.samples
        kinds = {}
        for kind in ("quiet", "flood"):
            tagged = [(kind, *s[1:]) for s in samples if s[0].startswith(kind + "-")]
            kinds[kind] = summary(tagged, kind)
        flood_kinds = {}
        for kind in ("quiet", "flood"):
            tagged = [(kind, *s[1:]) for s in flooding.samples if s[0].startswith(kind + "-")]
            flood_kinds[kind] = summary(tagged, kind)
        ratio = kinds["flood"]["p99_ms"] / kinds["quiet"]["p99_ms"]
        return {
            "llmgw_src": str(args.llmgw_src),
            "other": kinds,
            "p99_ratio": round(ratio, 2),
            "flood_model": flood_kinds,
            "rounds": rounds,
            "router_rss_peak_mb": round(router.rss_peak_mb(), 1),
            "router_cpu_s": round(cpu, 1),
            "measured_s": args.rounds * 2 * args.phase_s,
            "engine": json.loads(request(flood.url, "GET", "/bench/stats")[1]),
            "router_counters": metric_lines(router.url, COUNTERS),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
    finally:
        for proc in reversed(procs):
            proc.stop()


def markdown(result: dict[str, Any]) -> str:
    o = result["other"]
    lines = [
        f"llmgw: {result['llmgw_src']}",
        "",
        "| `other` requests | n | errors | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("quiet", "flood"):
        k = o[kind]
        lines.append(f"| {kind} | {k['requests']} | {k['errors']} | {k['p50_ms']} | "
                     f"{k['p99_ms']} | {k['max_ms']} |")  # fmt: skip
    lines += [
        "",
        f"p99 flood / quiet: **{result['p99_ratio']}** (target: at most 2)",
        f"router: peak RSS {result['router_rss_peak_mb']} MB, CPU {result['router_cpu_s']} s "
        f"over {result['measured_s']} s measured",
        f"flooding engine: {result['engine']}",
        f"`flood` requests: {result['flood_model']}",
        *result["router_counters"],
    ]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    engine = sub.add_parser("engine", help="(internal) run one fake engine")
    engine.add_argument("--model", required=True)
    engine.add_argument("--port", type=int, default=0)
    engine.add_argument("--events", type=int, default=0)
    engine.add_argument("--replay", type=int, default=0)
    engine.add_argument("--delay-ms", type=float, default=0)
    engine.add_argument("--flood-rate", type=float, default=4)
    engine.add_argument("--gap-every", type=int, default=20)
    engine.add_argument("--replay-messages", type=int, default=64)
    parser.add_argument(
        "--llmgw-src",
        type=Path,
        default=ROOT / "src",
        help="the router's code (e.g. /tmp/base/src for a baseline)",
    )
    parser.add_argument("--rate", type=float, default=20, help="`other` requests a second")
    parser.add_argument(
        "--flood-requests",
        type=float,
        default=4,
        help="`flood` requests a second (each asks /tokenize)",
    )
    parser.add_argument(
        "--engine-delay-ms", type=float, default=50, help="the quiet engine's answer time"
    )
    parser.add_argument("--flood-rate", type=float, default=4, help="3.8 MiB messages a second")
    parser.add_argument(
        "--gap-every",
        type=int,
        default=20,
        help="skip a sequence number every N flood messages (forces a replay)",
    )
    parser.add_argument("--replay-messages", type=int, default=64)
    parser.add_argument("--phase-s", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=5)
    parser.add_argument("--quick", action="store_true", help="phases of 6 s, one round")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_flood.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.phase_s, args.rounds, args.warmup_s = 6, 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.mode == "engine":
        return engine_main(args)
    try:
        result = run(args)
    except BenchError as exc:
        print(f"kv_flood_bench: {exc}", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
