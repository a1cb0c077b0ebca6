#!/usr/bin/env python3
"""Tenancy benchmark: per-tenant limits and fair queues on a saturated fleet, against plain
first-come-first-served and against fair queues that count every prompt token alike.

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/tenancy_bench.py                 # 10 minutes a variant (~50 min)
    .venv/bin/python bench/tenancy_bench.py --minutes 2     # shortened (~17 min)
    .venv/bin/python bench/tenancy_bench.py --quick         # smoke run (~3 min)
    .venv/bin/python bench/tenancy_bench.py --help

What it starts, all real processes on 127.0.0.1 (free ports), logs in a temporary folder:
- 4 mock engines (`python -m llmgw_mock_engine serve m`) with the scheduler model
  (llmgw_mock_engine.scheduler: a paged prefix cache, a shared prefill rate, a decode rate
  per sequence, at most --max-seqs running, FIFO admission). Their rates are fixed here,
  before anything was tuned (ENGINE below; the flags change them for experiments only);
- one control plane (`python -m llmgw_server`, no store, no agents: a model with a profile
  no node holds makes it run one) whose route feed hands out the shares of the tenants'
  limits between the routers;
- 2 routers apart (`python -m llmgw_server router --control URL --ca CA`), each with
  `[server] workers = 2` (its parent shares its own share between its workers), each
  declaring the static model `m` on the 4 engines, the tenants' keys and `[[tenants]]`,
  and a JSON access log of its own. They are started afresh for each variant, and the
  engines' caches are emptied (POST /mock/reset) between variants.

The load (one trio process, httpx): open-loop Poisson arrivals per tenant, streamed chat
completions with `stream_options.include_usage`, alternating between the two routers,
each request recorded (send time, first content event, end, status, usage with
`prompt_tokens_details.cached_tokens`). A client gives up on a request without a first
token after --ttft-timeout-s (60 s), as real clients time out; the engine then drops it.
- A: long unique prompts (--a-words, uncached), at 10x B's rate;
- B: short prompts, at --b-rps: the neighbour whose TTFT is watched;
- C: a long prefix shared by all its requests (a system prompt, cached by the engines),
  then a short unique tail;
- D: medium unique prompts at 2x a `tokens_per_minute` limit (the limit check).
Prompts are 3-letter words (4 bytes a token: the router's estimate of a prompt from its
body is then about right, as with English text); every answer is --max-tokens long.
The fleet's capacity is measured first (a closed loop of A, B and C at their mix, on a
fcfs fleet); A, B and C are then offered at least --overload (1.5) x that capacity.

Variants, each --warmup-s (30 s, left out) then --minutes (10) measured:
- fcfs: `replica_max_in_flight = 0` (today: every request goes to the engines' FIFO);
- fair: `replica_max_in_flight = max_seqs / 4 router processes` (2), `queue_cost =
  "uncached"` (llmgw's default): per-tenant fair queues charged by uncached prompt
  tokens plus output;
- fair-prompt: the same with `queue_cost = "prompt"`: every prompt token charged alike;
- alone: B alone at its rate, on the fair fleet (B's TTFT baseline).
Then a client phase with the official `openai` client (threads, not streamed): tenants
with `requests_per_minute = --client-rpm` (30) driven at 1.0x and 1.25x with the default
`max_retries` (2) and at 2x with `max_retries=10`, evenly spaced over --client-s (90 s),
each request's attempts counted from the access logs (its own x-request-id).

Measured and reported (a markdown table to stdout, bench/results/tenancy.md and
tenancy.json, git-ignored): per variant and tenant, requests sent, answered, refused
(429, by reason), timed out; served requests, output tokens and charged tokens a second
(uncached prompt + output, and prompt + output); TTFT p50/p99 of the answered and p99 of
all sent (one never answered counts as infinite); the router queue's wait (access log
`queued_ms`); the engines' own figures (/mock/stats: requests, those dropped unfinished,
their FIFO wait, prefix-cache hits); CPU of each component and the machine's. For the
diagnosis: while a request of B waited in a router process's queue, what that process
sent on (by tenant; the process from the answer's x-llmgw-worker); in the client phase,
the 429s that came while the whole fleet had answered fewer requests than the limit in
the 61 s before (one process's share refused while the limit had room), and the longest
wait between two attempts of one request. Each request's record is kept beside the
logs (records-VARIANT.jsonl). The done-when checks print as PASS / FAIL lines:
1. noisy neighbour (fair): B's TTFT p99 <= 1.2x its p99 alone; Jain's index on charged
   tokens a second of the backlogged tenants of equal weight (A and C) >= 0.95; total
   output tokens a second >= 95% of fcfs's;
2. D's `tokens_per_minute`, enforced across 2 routers x 2 workers: no 60 s window (every
   one, sliding, over each whole variant, warm-up included) of D's 200-answered requests
   by arrival time (the access logs of every router process) holds prompt + completion
   tokens past the limit by more than max(5% of it, one request's reservation per
   router process);
3. the openai client completes every request at 1.0x and 1.25x with its default
   max_retries, and at 2x with max_retries=10.
Exit status: 0 when it ran, 2 when it could not run, with --strict 1 when a check fails.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import re
import resource
import secrets
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from llmgw_core.certs import init_ca  # noqa: E402
from llmgw_core.config import digest_of  # noqa: E402
from llmgw_server.router.tenancy import reservation  # noqa: E402

RESULTS_DIR = HERE / "results"
MODEL = "m"
CHAT_PATH = b"/v1/chat/completions"
ROUTERS = 2
WORKERS = 2
ROUTER_PROCESSES = ROUTERS * WORKERS  # the processes that admit requests
ENGINES = 4
RESERVE_OUTPUT_TOKENS = 512  # [router] reserve_output_tokens (default; every body names max_tokens)
WORDS = ["".join(w) for w in itertools.product(string.ascii_lowercase, repeat=3)]
LOAD_TENANTS = ("A", "B", "C", "D")
CLIENT_LEGS = (("E1", 1.0, None), ("E2", 1.25, None), ("E3", 2.0, 10))  # tenant, x limit, retries
FIRST_CONTENT = re.compile(rb'"content": ?"[^"]')
TAIL_S = 10.0  # arrivals go on this long after the measured interval, then all is cancelled


@attrs.frozen
class EngineRates:
    """The mock engines' scheduler model, fixed before anything was tuned."""

    kv_blocks: int = 2048
    block_size: int = 16
    prefill_tps: float = 8000.0
    decode_tps: float = 20.0
    max_seqs: int = 8

    def flags(self) -> list[str]:
        return [
            "--mock-kv-blocks", str(self.kv_blocks),
            "--mock-block-size", str(self.block_size),
            "--mock-prefill-tps", f"{self.prefill_tps:g}",
            "--mock-decode-tps", f"{self.decode_tps:g}",
            "--mock-max-seqs", str(self.max_seqs),
            "--mock-tokens", "100000",  # each request's max_tokens decides its length
        ]  # fmt: skip


@attrs.frozen
class Shape:
    """What one tenant's requests look like: unique words, after a shared prefix."""

    words: int
    prefix_words: int = 0


def key_of(tenant: str) -> str:
    return f"sk-bench-{tenant.lower()}"


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def progress(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


# -- arithmetic (pure; tests/test_tenancy_bench.py) ---------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); math.inf counts as a value; nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when all equal."""
    if not values:
        return math.nan
    squares = sum(v * v for v in values)
    if squares == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * squares)


def max_window(
    events: Iterable[tuple[float, float]], window_s: float = 60.0
) -> tuple[float, float]:
    """(the largest sum of amounts in any half-open window [t, t + window_s), its start)
    over (time, amount) events. The maximum is reached by a window starting at an event."""
    ordered = sorted(events)
    best, start = 0.0, math.nan
    total = 0.0
    j = 0
    for i, (t, _) in enumerate(ordered):
        while j < len(ordered) and ordered[j][0] < t + window_s:
            total += ordered[j][1]
            j += 1
        if total > best:
            best, start = total, t
        total -= ordered[i][1]
    return best, start


def log_time(text: str) -> float:
    """The access log's `time` (RFC 3339 UTC with milliseconds) as epoch seconds."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    return seconds + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def read_access_logs(paths: Iterable[Path]) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in paths:
        if not path.exists():
            continue
        for raw in path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("time"):
                line["t"] = log_time(str(line["time"]))
                lines.append(line)
    return lines


def limit_check(
    lines: Sequence[dict[str, Any]], tenant: str, limit: float, reserved_one: int
) -> dict[str, Any]:
    """The tokens_per_minute check over the access logs' lines: D's answered requests'
    prompt + completion tokens by arrival, in every 60 s window."""
    events = [
        (float(x["t"]), float((x.get("prompt_tokens") or 0) + (x.get("completion_tokens") or 0)))
        for x in lines
        if x.get("tenant") == tenant and x.get("status") == 200
    ]
    worst, at = max_window(events)
    allowance = max(0.05 * limit, reserved_one * ROUTER_PROCESSES)
    return {
        "answered": len(events),
        "limit": limit,
        "worst_window_tokens": worst,
        "worst_window_start": at,
        "excess": worst - limit,
        "allowance": allowance,
        "reserved_one": reserved_one,
        "ok": worst - limit <= allowance,
    }


# -- processes ----------------------------------------------------------------------------


def tree_cpu(root: int) -> float:
    """CPU seconds of a live process and its live descendants."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


class Fleet:
    """The engines, the control plane and the routers of one run."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rates: EngineRates = args.engine
        self.certs = work / "certs"
        self.router_token = "router-" + secrets.token_hex(8)
        self.engines: list[subprocess.Popen[bytes]] = []
        self.engine_urls: list[str] = []
        self.control: subprocess.Popen[bytes] | None = None
        self.control_url = ""
        self.routers: list[subprocess.Popen[bytes]] = []
        self.router_urls: list[str] = []
        self.router_logs: list[Path] = []

    def _spawn(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=raise_nofile,
                start_new_session=True,
            )

    async def start(self) -> None:
        init_ca(self.certs)
        for k in range(ENGINES):
            port = free_port()
            self.engines.append(self._spawn(
                [sys.executable, "-m", "llmgw_mock_engine", "serve", MODEL,
                 "--host", "127.0.0.1", "--port", str(port), *self.rates.flags()],
                self.work / f"engine-{k}.log",
            ))  # fmt: skip
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        control_port = free_port()
        config = self.work / "control.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{free_port()}"\n'
            f'control_listen = "127.0.0.1:{control_port}"\n'
            f'[agents]\nca = "{self.certs}/ca.crt"\ncert = "{self.certs}/server.crt"\n'
            f'key = "{self.certs}/server.key"\n'
            f'[admin]\nrouter_token_digest = "sha256:{digest_of(self.router_token)}"\n'
            "open_status = true\n"
            # One model no node can hold: the control plane runs (and feeds its routers)
            # without agents, and no engine is started.
            '[[models]]\nname = "unplaceable"\n[models.profile]\nengine = "vllm"\nmodel = "x"\n'
            'tensor_parallel = 4\ngpu_model = "B300"\n'
        )
        self.control = self._spawn(
            [sys.executable, "-m", "llmgw_server", "--config", str(config)],
            self.work / "control.log",
        )
        self.control_url = f"https://127.0.0.1:{control_port}"
        async with httpx.AsyncClient(timeout=2, verify=str(self.certs / "ca.crt")) as client:
            with trio.fail_after(60):
                for url in self.engine_urls:
                    while not await _answers(client, url + "/health"):
                        await trio.sleep(0.1)
                while not await _answers(client, self.control_url + "/metrics"):
                    if self.control.poll() is not None:
                        raise RuntimeError(f"the control plane exited: see {self.work}/control.log")
                    await trio.sleep(0.2)

    def router_config(self, variant: str, port: int, log: Path) -> str:
        args = self.args
        fair = variant in ("fair", "fair-prompt", "alone", "client")
        bound = max(1, self.rates.max_seqs // ROUTER_PROCESSES) if fair else 0
        cost = "prompt" if variant == "fair-prompt" else "uncached"
        endpoints = json.dumps(self.engine_urls)
        keys = "".join(
            f'[[auth.keys]]\ndigest = "{sha(key_of(t))}"\ntenant = "{t}"\n'
            for t in (*LOAD_TENANTS, *(leg[0] for leg in CLIENT_LEGS))
        )
        tenants = "".join(f'[[tenants]]\nname = "{t}"\n' for t in ("A", "B", "C"))
        tenants += f'[[tenants]]\nname = "D"\ntokens_per_minute = {args.d_tpm}\n'
        tenants += "".join(
            f'[[tenants]]\nname = "{leg[0]}"\nrequests_per_minute = {args.client_rpm}\n'
            for leg in CLIENT_LEGS
        )
        return (
            f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = {WORKERS}\n'
            f'access_log = true\naccess_log_format = "json"\naccess_log_file = "{log}"\n'
            f'[router]\nreplica_max_in_flight = {bound}\nqueue_cost = "{cost}"\n'
            f'[[models]]\nname = "{MODEL}"\nendpoints = {endpoints}\n' + keys + tenants
        )

    async def start_routers(self, variant: str) -> None:
        self.routers, self.router_urls, self.router_logs = [], [], []
        for k in range(ROUTERS):
            port = free_port()
            log = self.work / f"access-{variant}-{k}.jsonl"
            path = self.work / f"router-{variant}-{k}.toml"
            path.write_text(self.router_config(variant, port, log))
            self.routers.append(self._spawn(
                [sys.executable, "-m", "llmgw_server", "router", "--config", str(path),
                 "--control", self.control_url, "--ca", str(self.certs / "ca.crt")],
                self.work / f"router-{variant}-{k}.log",
                env={"LLMGW_ROUTER_TOKEN": self.router_token},
            ))  # fmt: skip
            self.router_urls.append(f"http://127.0.0.1:{port}")
            self.router_logs.append(log)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with httpx.AsyncClient(timeout=5) as client:
            with trio.fail_after(90):
                for proc, url in zip(self.routers, self.router_urls, strict=True):
                    while True:
                        if proc.poll() is not None:
                            raise RuntimeError(
                                f"a router exited: see {self.work}/router-{variant}-*.log"
                            )
                        if await _answers(client, url + "/readyz"):
                            try:
                                answer = await client.post(
                                    url + "/v1/chat/completions",
                                    json=body,
                                    headers={"authorization": f"Bearer {key_of('B')}"},
                                )
                                if answer.status_code == 200:
                                    break
                            except httpx.HTTPError:
                                pass
                        await trio.sleep(0.2)

    async def stop_routers(self) -> None:
        for proc in self.routers:
            _signal(proc, signal.SIGTERM)
        with trio.move_on_after(40):
            while any(p.poll() is None for p in self.routers):
                await trio.sleep(0.2)
        for proc in self.routers:
            _signal(proc, signal.SIGKILL)
            proc.wait()

    async def engine_stats(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=30) as client:
            return [(await client.get(u + "/mock/stats")).json() for u in self.engine_urls]

    async def reset_engines(self) -> None:
        """Empty the engines' caches and records, once nothing runs."""
        async with httpx.AsyncClient(timeout=10) as client:
            with trio.fail_after(120):
                for url in self.engine_urls:
                    while (await client.post(url + "/mock/reset")).status_code == 409:
                        await trio.sleep(0.5)

    def cpu(self) -> dict[str, float]:
        out = {
            "engines": sum(tree_cpu(p.pid) for p in self.engines),
            "routers": sum(tree_cpu(p.pid) for p in self.routers),
            "control": tree_cpu(self.control.pid) if self.control else 0.0,
        }
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out["load"] = usage.ru_utime + usage.ru_stime
        return out

    def stop(self) -> None:
        for proc in [*self.routers, *self.engines, *([self.control] if self.control else [])]:
            _signal(proc, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


# -- the load -------------------------------------------------------------------------------


@attrs.define
class Rec:
    """One request, as its client saw it (times: trio's clock, from the run's origin)."""

    tenant: str
    request_id: str
    sent: float
    reserved: int
    outcome: str = ""  # ok, 429, timeout, error, http-N; "" if cut off at the end
    reason: str = ""
    status: int = 0
    ttft: float | None = None
    end: float | None = None
    prompt: int | None = None
    cached: int | None = None
    completion: int | None = None
    worker: str = ""  # the router (0, 1) and its worker (x-llmgw-worker) that answered

    @property
    def uncached(self) -> int:
        return (self.prompt or 0) - (self.cached or 0)


REFUSAL_REASONS = (
    ("tokens per minute", "tokens"),
    ("requests per minute", "requests"),
    ("requests in flight", "in_flight"),
    ("requests waiting for this model", "queue_full"),
    ("wait for this model's engines", "queue_timeout"),
)


def refusal_reason(text: str) -> str:
    for phrase, reason in REFUSAL_REASONS:
        if phrase in text:
            return reason
    return "other"


def usage_of(buffer: bytes) -> dict[str, Any] | None:
    at = buffer.rfind(b'"usage": {')
    if at < 0:
        at = buffer.rfind(b'"usage":{')
    if at < 0:
        return None
    start = buffer.rfind(b"data: ", 0, at)
    end = buffer.find(b"\n", at)
    try:
        event = json.loads(buffer[start + 6 : end if end >= 0 else None])
    except ValueError:
        return None
    usage = event.get("usage") if isinstance(event, dict) else None
    return usage if isinstance(usage, dict) else None


class Load:
    """Bodies, requests and the arrival processes."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args = args
        self.rng = random.Random(seed)
        self.shapes = {
            "A": Shape(args.a_words),
            "B": Shape(args.b_words),
            "C": Shape(args.c_tail_words, args.c_prefix_words),
            "D": Shape(args.d_words),
        }
        self.prefix = " ".join(self.rng.choices(WORDS, k=args.c_prefix_words))
        self.counter = itertools.count()
        self.turn = itertools.count()

    def body(self, tenant: str) -> tuple[bytes, int]:
        """A request body of `tenant`, and the tokens the router reserves for it."""
        shape = self.shapes[tenant]
        messages = []
        if shape.prefix_words:
            messages.append({"role": "system", "content": self.prefix})
        text = " ".join(self.rng.choices(WORDS, k=shape.words))
        messages.append({"role": "user", "content": text})
        body: dict[str, object] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": self.args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = json.dumps(body).encode()
        prompt, output = reservation(CHAT_PATH, body, len(raw), None, RESERVE_OUTPUT_TOKENS, None)
        return raw, prompt + output

    def tokens_per_request(self, tenant: str) -> int:
        """A request's prompt + output tokens as the mock counts them."""
        shape = self.shapes[tenant]
        roles = 3 if shape.prefix_words else 2
        return shape.words + shape.prefix_words + roles + int(self.args.max_tokens)

    async def send(
        self, client: httpx.AsyncClient, url: str, rec: Rec, body: bytes, ttft_timeout: float
    ) -> None:
        headers = {
            "authorization": f"Bearer {key_of(rec.tenant)}",
            "content-type": "application/json",
            "x-request-id": rec.request_id,
        }
        with trio.CancelScope(deadline=trio.current_time() + ttft_timeout) as scope:
            try:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", content=body, headers=headers
                ) as answer:
                    rec.status = answer.status_code
                    rec.worker = f"{url}/{answer.headers.get('x-llmgw-worker', '')}"
                    if answer.status_code != 200:
                        text = (await answer.aread()).decode(errors="replace")
                        rec.end = trio.current_time()
                        if answer.status_code == 429:
                            rec.outcome, rec.reason = "429", refusal_reason(text)
                        else:
                            rec.outcome, rec.reason = f"http-{answer.status_code}", text[:200]
                        return
                    buffer = bytearray()
                    async for chunk in answer.aiter_raw():
                        scan = max(0, len(buffer) - 16)
                        buffer += chunk
                        if rec.ttft is None and FIRST_CONTENT.search(buffer, scan):
                            rec.ttft = trio.current_time() - rec.sent
                            scope.deadline = math.inf
                    rec.end = trio.current_time()
                    usage = usage_of(bytes(buffer))
                    if usage is None:
                        rec.outcome = "no-usage"
                        return
                    rec.prompt = usage.get("prompt_tokens")
                    rec.completion = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached = details.get("cached_tokens") if isinstance(details, dict) else None
                    rec.outcome = "ok"
            except httpx.HTTPError as exc:
                rec.outcome, rec.reason = "error", type(exc).__name__
                rec.end = trio.current_time()
        if scope.cancelled_caught:
            rec.outcome = "timeout"

    async def open_loop(
        self,
        client: httpx.AsyncClient,
        urls: Sequence[str],
        rates: dict[str, float],
        until: float,
        recs: list[Rec],
        label: str,
    ) -> None:
        """Poisson arrivals of each tenant at its rate until `until`; then every request
        still running is cut off."""
        async with trio.open_nursery() as requests:
            async with trio.open_nursery() as arrivals:
                for tenant, rate in rates.items():
                    if rate > 0:
                        arrivals.start_soon(
                            self._arrivals, requests, client, urls, tenant, rate, until, recs, label
                        )
            requests.cancel_scope.cancel()

    async def _arrivals(
        self,
        requests: trio.Nursery,
        client: httpx.AsyncClient,
        urls: Sequence[str],
        tenant: str,
        rate: float,
        until: float,
        recs: list[Rec],
        label: str,
    ) -> None:
        rng = random.Random(self.rng.random())
        at = trio.current_time()
        while True:
            at += rng.expovariate(rate)
            if at >= until:
                return
            await trio.sleep_until(at)
            body, reserved = self.body(tenant)
            rec = Rec(
                tenant, f"{label}-{tenant}-{next(self.counter)}", trio.current_time(), reserved
            )
            recs.append(rec)
            url = urls[next(self.turn) % len(urls)]
            requests.start_soon(self.send, client, url, rec, body, self.args.ttft_timeout_s)

    async def closed_loop(
        self,
        client: httpx.AsyncClient,
        urls: Sequence[str],
        mix: dict[str, float],
        clients: int,
        until: float,
        recs: list[Rec],
    ) -> None:
        tenants = list(mix)
        weights = [mix[t] for t in tenants]

        async def loop(k: int) -> None:
            rng = random.Random(k)
            while trio.current_time() < until:
                tenant = rng.choices(tenants, weights)[0]
                body, reserved = self.body(tenant)
                rec = Rec(
                    tenant, f"cap-{tenant}-{next(self.counter)}", trio.current_time(), reserved
                )
                recs.append(rec)
                await self.send(client, urls[k % len(urls)], rec, body, self.args.ttft_timeout_s)

        with trio.move_on_at(until + TAIL_S):
            async with trio.open_nursery() as nursery:
                for k in range(clients):
                    nursery.start_soon(loop, k)


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=2000),
    )


# -- a variant's figures --------------------------------------------------------------------


def summarize(
    recs: Sequence[Rec], t0: float, t1: float, queued: dict[str, float]
) -> dict[str, Any]:
    """Per tenant: what was sent in [t0, t1) and what happened to it; what was served
    (answers that ended) in [t0, t1), a second."""
    span = t1 - t0
    out: dict[str, Any] = {}
    for tenant in sorted({r.tenant for r in recs}):
        mine = [r for r in recs if r.tenant == tenant]
        sent = [r for r in mine if t0 <= r.sent < t1]
        done = [r for r in mine if r.outcome == "ok" and r.end is not None and t0 <= r.end < t1]
        refused: dict[str, int] = {}
        for r in sent:
            if r.outcome == "429":
                refused[r.reason] = refused.get(r.reason, 0) + 1
        answered = [r.ttft for r in sent if r.outcome == "ok" and r.ttft is not None]
        every = [r.ttft if r.ttft is not None else math.inf for r in sent]
        waits = [queued[r.request_id] for r in sent if r.request_id in queued]
        out[tenant] = {
            "sent": len(sent),
            "offered_rps": len(sent) / span,
            "ok": sum(1 for r in sent if r.outcome == "ok"),
            "refused": refused,
            "timeout": sum(1 for r in sent if r.outcome == "timeout"),
            "errors": sum(1 for r in sent if r.outcome not in ("ok", "429", "timeout", "")),
            "cut_off": sum(1 for r in sent if r.outcome == ""),
            "served_rps": len(done) / span,
            "output_tps": sum(r.completion or 0 for r in done) / span,
            "charged_uncached_tps": sum(r.uncached + (r.completion or 0) for r in done) / span,
            "charged_prompt_tps": sum((r.prompt or 0) + (r.completion or 0) for r in done) / span,
            "cached_share": (
                sum(r.cached or 0 for r in done) / max(1, sum(r.prompt or 0 for r in done))
            ),
            "ttft_p50": percentile(answered, 50),
            "ttft_p99": percentile(answered, 99),
            "ttft_p99_all": percentile(every, 99),
            "queued_p50_ms": percentile(waits, 50),
            "queued_p99_ms": percentile(waits, 99),
        }
    out["total"] = {
        "output_tps": sum(v["output_tps"] for v in out.values()),
        "served_rps": sum(v["served_rps"] for v in out.values()),
    }
    return out


def queued_by_request(lines: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {
        str(x["request_id"]): float(x.get("queued_ms") or 0.0)
        for x in lines
        if x.get("status") == 200
    }


def dispatched_ahead(
    lines: Sequence[dict[str, Any]], recs: Sequence[Rec], tenant: str = "B"
) -> dict[str, Any]:
    """While each answered request of `tenant` waited in its router process's queue, the
    requests that process sent on (a request leaves the queue at its arrival plus its
    `queued_ms`), by tenant, on average a request of `tenant`; and of those, the ones
    that arrived after it. Which process answered is the client's record
    (x-llmgw-worker); the access log says when."""
    worker = {r.request_id: r.worker for r in recs if r.worker}
    by_worker: dict[str, list[tuple[float, float, str]]] = {}
    for line in lines:
        name = worker.get(str(line.get("request_id")))
        if name is None or line.get("status") != 200:
            continue
        arrived = float(line["t"])
        left = arrived + float(line.get("queued_ms") or 0.0) / 1000.0
        by_worker.setdefault(name, []).append((left, arrived, str(line.get("tenant"))))
    ahead: dict[str, int] = {}
    later: dict[str, int] = {}
    count = 0
    for sent in by_worker.values():
        sent.sort()
        for left, arrived, who in sent:
            if who != tenant:
                continue
            count += 1
            for other_left, other_arrived, other in sent:
                if arrived <= other_left < left:
                    ahead[other] = ahead.get(other, 0) + 1
                    if other_arrived > arrived:
                        later[other] = later.get(other, 0) + 1
    per = max(1, count)
    return {
        "requests": count,
        "ahead": {k: v / per for k, v in sorted(ahead.items())},
        "arrived_later": {k: v / per for k, v in sorted(later.items())},
    }


def client_refusals(lines: Sequence[dict[str, Any]], tenant: str, limit: int) -> dict[str, Any]:
    """A requests_per_minute tenant's refusals: how many came while its whole fleet had
    answered fewer than `limit` of its requests in the 61 s before (the window's 61
    slots): refused by one process's share while the limit had room. And the longest
    wait between two attempts of one request (its Retry-After, and the time it took)."""
    mine = sorted((x for x in lines if x.get("tenant") == tenant), key=lambda x: float(x["t"]))
    answered = [float(x["t"]) for x in mine if x.get("status") == 200]
    below = 0
    refused = 0
    for line in mine:
        if line.get("status") != 429:
            continue
        refused += 1
        t = float(line["t"])
        if sum(1 for a in answered if t - 61.0 < a <= t) < limit:
            below += 1
    attempts: dict[str, list[float]] = {}
    for line in mine:
        attempts.setdefault(str(line.get("request_id")), []).append(float(line["t"]))
    gaps = [b - a for times in attempts.values() for a, b in itertools.pairwise(times)]
    return {"refused": refused, "below_limit": below, "longest_gap_s": max(gaps, default=0.0)}


def engine_summary(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    records = [r for s in stats for r in s.get("requests", ())]
    queries = sum(int(s.get("prefix_cache_queries", 0)) for s in stats)
    hits = sum(int(s.get("prefix_cache_hits", 0)) for s in stats)
    waits = [float(r["queued_s"]) for r in records if r.get("queued_s") is not None]
    return {
        "requests": len(records),
        "abandoned": sum(1 for r in records if not r.get("completed")),
        "generation_tokens": sum(int(s.get("generation_tokens", 0)) for s in stats),
        "prefix_hit_share": hits / queries if queries else 0.0,
        "engine_queue_p50_s": percentile(waits, 50),
        "engine_queue_p99_s": percentile(waits, 99),
    }


# -- the run --------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.fleet = Fleet(args, work)
        self.load = Load(args, args.seed)
        self.out: dict[str, Any] = {"variants": {}}

    async def run(self) -> dict[str, Any]:
        args = self.args
        started = time.monotonic()
        progress(f"starting {ENGINES} engines and a control plane in {self.work}")
        await self.fleet.start()
        self.out["capacity"] = await self.capacity()
        capacity = self.out["capacity"]["rps"]
        nominal = {"A": 10 * args.b_rps, "B": args.b_rps, "C": args.c_rps}
        scale = max(1.0, args.overload * capacity / sum(nominal.values()))
        rates = {t: r * scale for t, r in nominal.items()}
        rates["D"] = 2.0 * args.d_tpm / 60.0 / self.load.tokens_per_request("D")
        self.out["rates"] = rates
        self.out["overload"] = sum(rates[t] for t in "ABC") / capacity
        progress(
            "offered (rps): "
            + ", ".join(f"{t} {r:.2f}" for t, r in rates.items())
            + f"; A+B+C = {self.out['overload']:.2f}x the capacity"
        )
        for variant in args.variants:
            if variant == "alone":
                await self.variant("alone", {"B": rates["B"]})
            else:
                await self.variant(variant, rates)
        if args.client_s > 0:
            self.out["client"] = await self.client_phase()
        self.out["duration_s"] = time.monotonic() - started
        return self.out

    async def capacity(self) -> dict[str, Any]:
        """Requests a second the fleet completes for the A:B:C mix, closed loop, fcfs."""
        args = self.args
        await self.fleet.start_routers("capacity")
        clients = 2 * ENGINES * args.engine.max_seqs
        mix = {"A": 10 * args.b_rps, "B": args.b_rps, "C": args.c_rps}
        recs: list[Rec] = []
        warm, span = args.capacity_s / 4, args.capacity_s
        progress(f"capacity: closed loop, {clients} clients, {warm + span:.0f} s")
        origin = trio.current_time()
        async with new_client() as client:
            await self.load.closed_loop(
                client, self.fleet.router_urls, mix, clients, origin + warm + span, recs
            )
        await self.fleet.stop_routers()
        await self.fleet.reset_engines()
        t0, t1 = origin + warm, origin + warm + span
        done = [r for r in recs if r.outcome == "ok" and r.end is not None and t0 <= r.end < t1]
        result = {
            "clients": clients,
            "seconds": span,
            "rps": len(done) / span,
            "output_tps": sum(r.completion or 0 for r in done) / span,
            "failed": sum(1 for r in recs if r.outcome not in ("ok", "")),
        }
        progress(
            f"capacity: {result['rps']:.2f} requests/s, {result['output_tps']:.0f} output tokens/s"
        )
        return result

    async def variant(self, name: str, rates: dict[str, float]) -> None:
        args = self.args
        fleet = self.fleet
        await fleet.start_routers(name)
        recs: list[Rec] = []
        warm, span = args.warmup_s, args.minutes * 60.0
        progress(f"{name}: {warm:.0f} s warm-up, {span:.0f} s measured")
        cpu_before, busy_before = fleet.cpu(), machine_busy()
        origin = trio.current_time()
        t0, t1 = origin + warm, origin + warm + span
        async with new_client() as client:
            await self.load.open_loop(client, fleet.router_urls, rates, t1 + TAIL_S, recs, name)
        cpu_after, busy_after = fleet.cpu(), machine_busy()
        elapsed = trio.current_time() - origin
        stats = await fleet.engine_stats()
        await fleet.stop_routers()
        lines = read_access_logs(fleet.router_logs)
        await fleet.reset_engines()
        figures = summarize(recs, t0, t1, queued_by_request(lines))
        reserved_d = max((r.reserved for r in recs if r.tenant == "D"), default=0)
        result: dict[str, Any] = {
            "rates": rates,
            "tenants": figures,
            "engines": engine_summary(stats),
            "cpu_cores": {k: (cpu_after[k] - cpu_before.get(k, 0.0)) / elapsed for k in cpu_after},
            "machine_busy": (busy_after[0] - busy_before[0])
            / max(1.0, busy_after[1] - busy_before[1]),
            "log_lines": len(lines),
        }
        if "D" in rates:
            result["limit"] = limit_check(lines, "D", float(args.d_tpm), reserved_d)
        if "B" in rates:
            result["ahead_of_B"] = dispatched_ahead(lines, recs)
        self.out["variants"][name] = result
        with (self.work / f"records-{name}.jsonl").open("w") as kept:
            kept.writelines(json.dumps(attrs.asdict(r)) + "\n" for r in recs)
        total = figures["total"]
        progress(
            f"{name}: {total['served_rps']:.2f} requests/s, {total['output_tps']:.0f} output tokens/s; "
            f"machine {100 * result['machine_busy']:.0f}% busy"
        )

    async def client_phase(self) -> dict[str, Any]:
        """The openai client's retries against requests_per_minute, on a fair fleet."""
        args = self.args
        fleet = self.fleet
        await fleet.start_routers("client")
        progress(
            f"client phase: requests_per_minute {args.client_rpm}, "
            + ", ".join(f"{t} at {x:g}x" for t, x, _ in CLIENT_LEGS)
            + f", over {args.client_s:.0f} s"
        )
        results = await trio.to_thread.run_sync(
            run_client_legs, fleet.router_urls, args.client_rpm, args.client_s, args.client_cap_s
        )
        await fleet.stop_routers()
        lines = read_access_logs(fleet.router_logs)
        out: dict[str, Any] = {}
        for tenant, factor, retries in CLIENT_LEGS:
            mine = results[tenant]
            attempts: dict[str, int] = {}
            for line in lines:
                if line.get("tenant") == tenant:
                    rid = str(line.get("request_id"))
                    attempts[rid] = attempts.get(rid, 0) + 1
            counts = [attempts.get(rid, 0) for rid in mine["ids"]]
            answered = [
                (float(x["t"]), 1.0)
                for x in lines
                if x.get("tenant") == tenant and x.get("status") == 200
            ]
            worst, _ = max_window(answered)
            out[tenant] = {
                "load": factor,
                "max_retries": retries if retries is not None else "default (2)",
                "requests": len(mine["ids"]),
                "completed": mine["ok"],
                "failed": len(mine["ids"]) - mine["ok"],
                "failures": mine["failures"],
                "retried": sum(1 for c in counts if c > 1),
                "max_retries_used": max((c - 1 for c in counts), default=0),
                "mean_attempts": statistics.fmean(counts) if counts else 0.0,
                "seconds": mine["seconds"],
                "worst_60s_answered": worst,
                **client_refusals(lines, tenant, args.client_rpm),
            }
        await fleet.reset_engines()
        return out


def run_client_legs(
    urls: Sequence[str], rpm: int, seconds: float, cap_s: float
) -> dict[str, dict[str, Any]]:
    """Each leg: its requests evenly spaced at its load, one thread each, through the
    official client (alternately to each router)."""
    import openai

    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    start = time.monotonic()

    def one(client: openai.OpenAI, tenant: str, rid: str) -> None:
        try:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "a short question"}],
                max_tokens=8,
                extra_headers={"x-request-id": rid},
            )
            with lock:
                results[tenant]["ok"] += 1
        except openai.APIStatusError as exc:
            why = f"{exc.status_code}"
            with lock:
                results[tenant]["failures"][why] = results[tenant]["failures"].get(why, 0) + 1
        except openai.APIError as exc:
            why = type(exc).__name__
            with lock:
                results[tenant]["failures"][why] = results[tenant]["failures"].get(why, 0) + 1

    schedule: list[tuple[float, str, openai.OpenAI, str]] = []
    for tenant, factor, retries in CLIENT_LEGS:
        kwargs: dict[str, Any] = {} if retries is None else {"max_retries": retries}
        clients = [
            openai.OpenAI(base_url=u + "/v1", api_key=key_of(tenant), timeout=120, **kwargs)
            for u in urls
        ]
        n = round(rpm * factor * seconds / 60.0)
        spacing = 60.0 / (rpm * factor)
        ids = [f"client-{tenant}-{i}" for i in range(n)]
        results[tenant] = {"ids": ids, "ok": 0, "failures": {}, "seconds": 0.0}
        for i, rid in enumerate(ids):
            schedule.append((i * spacing, tenant, clients[i % len(clients)], rid))
    schedule.sort(key=lambda x: x[0])
    for at, tenant, client, rid in schedule:
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(client, tenant, rid), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = start + seconds + cap_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    elapsed = time.monotonic() - start
    for tenant in results:
        results[tenant]["seconds"] = elapsed
        unfinished = (
            len(results[tenant]["ids"])
            - results[tenant]["ok"]
            - sum(results[tenant]["failures"].values())
        )
        if unfinished:
            results[tenant]["failures"]["unfinished"] = unfinished
    return results


# -- the report -----------------------------------------------------------------------------


def fmt(value: float, digits: int = 0) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if value == math.inf:
        return "inf"
    return f"{value:,.{digits}f}"


def ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if seconds == math.inf:
        return "inf"
    return f"{seconds * 1000:,.0f}"


def checks(out: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(name, passed (None: could not be judged), figures) for each done-when line."""
    variants = out["variants"]
    found: list[tuple[str, bool | None, str]] = []
    fair, fcfs, alone = variants.get("fair"), variants.get("fcfs"), variants.get("alone")
    if fair and alone:
        p99, base = fair["tenants"]["B"]["ttft_p99_all"], alone["tenants"]["B"]["ttft_p99_all"]
        ratio = p99 / base if base > 0 else math.inf
        found.append((
            "1a noisy neighbour: B's TTFT p99 (fair) <= 1.2x its p99 alone",
            ratio <= 1.2,
            f"{ms(p99)} ms vs {ms(base)} ms alone: {fmt(ratio, 2)}x",
        ))  # fmt: skip
    if fair:
        tenants = fair["tenants"]
        values = [tenants[t]["charged_uncached_tps"] for t in ("A", "C") if t in tenants]
        index = jain(values)
        found.append((
            "1b fairness: Jain's index of A and C (backlogged, weight 1) on charged tokens/s (fair) >= 0.95",
            index >= 0.95,
            f"{fmt(index, 3)} (A {fmt(values[0])}, C {fmt(values[1])} tokens/s)",
        ))  # fmt: skip
    if fair and fcfs:
        a, b = fair["tenants"]["total"]["output_tps"], fcfs["tenants"]["total"]["output_tps"]
        found.append((
            "1c work-conserving: output tokens/s (fair) >= 95% of fcfs's",
            a >= 0.95 * b,
            f"{fmt(a)} vs {fmt(b)}: {fmt(100 * a / b if b else math.nan, 1)}%",
        ))  # fmt: skip
    limited = {name: v["limit"] for name, v in variants.items() if "limit" in v}
    if limited:
        worst = max(limited.items(), key=lambda kv: kv[1]["excess"] - kv[1]["allowance"])
        found.append((
            "2 tokens_per_minute across 2 routers x 2 workers: no 60 s window past the limit by "
            "more than max(5%, one reservation per router process)",
            all(v["ok"] for v in limited.values()),
            "; ".join(
                f"{name}: worst {fmt(v['worst_window_tokens'])} of {fmt(v['limit'])} "
                f"({v['excess']:+,.0f}, allowed +{fmt(v['allowance'])})"
                for name, v in limited.items()
            ) + f"; worst: {worst[0]}",
        ))  # fmt: skip
    client = out.get("client")
    if client:
        default = [client[t] for t, _, retries in CLIENT_LEGS if retries is None]
        heavy = [client[t] for t, _, retries in CLIENT_LEGS if retries is not None]
        found.append((
            "3a openai client, default max_retries, at 1.0x and 1.25x the requests_per_minute: every request completes",
            all(leg["failed"] == 0 for leg in default),
            "; ".join(f"{leg['load']:g}x: {leg['completed']}/{leg['requests']} completed, "
                      f"most retries {leg['max_retries_used']}" for leg in default),
        ))  # fmt: skip
        found.append((
            "3b openai client, max_retries=10, at 2x the requests_per_minute: every request completes",
            all(leg["failed"] == 0 for leg in heavy),
            "; ".join(f"{leg['load']:g}x: {leg['completed']}/{leg['requests']} completed, "
                      f"most retries {leg['max_retries_used']}" for leg in heavy),
        ))  # fmt: skip
    return found


def report(args: argparse.Namespace, out: dict[str, Any]) -> str:
    e: EngineRates = args.engine
    lines = [
        "# Tenancy benchmark (bench/tenancy_bench.py)",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores, "
        f"{fmt(out.get('duration_s', 0) / 60, 1)} min in all. "
        f"{ENGINES} mock engines (fixed before tuning): kv_blocks {e.kv_blocks}, block_size "
        f"{e.block_size}, prefill {e.prefill_tps:g} tokens/s shared, decode {e.decode_tps:g} "
        f"tokens/s a sequence, max_seqs {e.max_seqs}. {ROUTERS} routers apart x {WORKERS} "
        f"workers, one control plane. Fair variants: replica_max_in_flight "
        f"{max(1, e.max_seqs // ROUTER_PROCESSES)}.",
        "",
        f"Requests: A {args.a_words} unique words; B {args.b_words}; C a {args.c_prefix_words}-word "
        f"shared prefix + {args.c_tail_words} unique; D {args.d_words} unique, tokens_per_minute "
        f"{args.d_tpm}; every answer {args.max_tokens} tokens; clients give up without a first "
        f"token after {args.ttft_timeout_s:g} s. Per variant {args.warmup_s:g} s warm-up (left "
        f"out), {args.minutes:g} min measured.",
        "",
    ]
    cap = out.get("capacity")
    if cap:
        rates = out["rates"]
        lines += [
            f"Capacity (closed loop of {cap['clients']} clients, A:B:C mix, fcfs): "
            f"{fmt(cap['rps'], 2)} requests/s, {fmt(cap['output_tps'])} output tokens/s. "
            "Offered (requests/s): "
            + ", ".join(f"{t} {fmt(r, 2)}" for t, r in rates.items())
            + f"; A+B+C = {fmt(out['overload'], 2)}x the capacity.",
            "",
        ]
    lines += [
        "| variant | tenant | offered/s | sent | ok | 429 (reason) | timeout | served/s | "
        "output tok/s | charged tok/s (uncached) | charged tok/s (prompt) | cached | "
        "TTFT p50 ms | TTFT p99 ms | p99 all sent ms | queued p50/p99 ms |",
        "|" + "---|" * 16,
    ]
    for name, v in out["variants"].items():
        for tenant, t in v["tenants"].items():
            if tenant == "total":
                continue
            refused = ", ".join(f"{n} {k}" for k, n in sorted(t["refused"].items())) or "0"
            lines.append(
                f"| {name} | {tenant} | {fmt(t['offered_rps'], 2)} | {t['sent']} | {t['ok']} | "
                f"{refused} | {t['timeout']} | {fmt(t['served_rps'], 2)} | {fmt(t['output_tps'])} | "
                f"{fmt(t['charged_uncached_tps'])} | {fmt(t['charged_prompt_tps'])} | "
                f"{fmt(100 * t['cached_share'])}% | {ms(t['ttft_p50'])} | {ms(t['ttft_p99'])} | "
                f"{ms(t['ttft_p99_all'])} | {fmt(t['queued_p50_ms'])}/{fmt(t['queued_p99_ms'])} |"
            )
        total = v["tenants"]["total"]
        lines.append(
            f"| {name} | all | | | | | | {fmt(total['served_rps'], 2)} | {fmt(total['output_tps'])} "
            "| | | | | | | |"
        )
    lines += [
        "",
        "| variant | Jain A,C (uncached) | Jain A,C (prompt) | engine requests | abandoned "
        "in engine | engine queue p50/p99 s | prefix hits | CPU cores: engines / routers / "
        "control / load | machine busy |",
        "|" + "---|" * 9,
    ]
    for name, v in out["variants"].items():
        t = v["tenants"]
        uncached = jain([t[x]["charged_uncached_tps"] for x in ("A", "C") if x in t])
        prompt = jain([t[x]["charged_prompt_tps"] for x in ("A", "C") if x in t])
        en, cpu = v["engines"], v["cpu_cores"]
        lines.append(
            f"| {name} | {fmt(uncached, 3)} | {fmt(prompt, 3)} | {en['requests']} | "
            f"{en['abandoned']} | {fmt(en['engine_queue_p50_s'], 2)}/{fmt(en['engine_queue_p99_s'], 2)} | "
            f"{fmt(100 * en['prefix_hit_share'])}% | {cpu['engines']:.2f} / {cpu['routers']:.2f} / "
            f"{cpu['control']:.2f} / {cpu['load']:.2f} | {fmt(100 * v['machine_busy'])}% |"
        )
    waited = [
        (name, v["ahead_of_B"])
        for name, v in out["variants"].items()
        if name != "fcfs" and v.get("ahead_of_B", {}).get("requests")
    ]
    if waited:
        lines += [
            "",
            "While a request of B waited in its router process's queue, that process sent on:",
            "",
        ]
        for name, ahead in waited:
            lines.append(
                f"- {name} ({ahead['requests']} requests of B): "
                + (", ".join(f"{t} {n:.2f}" for t, n in ahead["ahead"].items()) or "nothing")
                + " a request of B; of which arrived after it: "
                + (", ".join(f"{t} {n:.2f}" for t, n in ahead["arrived_later"].items()) or "none")
            )
    client = out.get("client")
    if client:
        lines += [
            "",
            f"Client phase (openai client, requests_per_minute {args.client_rpm}, arrivals "
            f"evenly spaced over {args.client_s:g} s):",
            "",
            "| tenant | load | max_retries | requests | completed | failed (why) | retried | "
            "most retries | mean attempts | 429s | 429s below the limit | longest wait between "
            "attempts s | most answered in 60 s | seconds |",
            "|" + "---|" * 14,
        ]
        for tenant, c in client.items():
            why = ", ".join(f"{n} {k}" for k, n in c["failures"].items()) or "-"
            lines.append(
                f"| {tenant} | {c['load']:g}x | {c['max_retries']} | {c['requests']} | "
                f"{c['completed']} | {c['failed']} ({why}) | {c['retried']} | "
                f"{c['max_retries_used']} | {c['mean_attempts']:.2f} | {c['refused']} | "
                f"{c['below_limit']} | {fmt(c['longest_gap_s'], 1)} | "
                f"{fmt(c['worst_60s_answered'])} | {fmt(c['seconds'])} |"
            )
    lines += ["", "Done-when checks:", ""]
    for name, passed, figures in checks(out):
        verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        lines.append(f"- {verdict} {name}: {figures}")
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf"
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


async def main_async(args: argparse.Namespace) -> int:
    raise_nofile()
    work = Path(tempfile.mkdtemp(prefix="llmgw-tenancy-bench-"))
    bench = Bench(args, work)
    try:
        out = await bench.run()
    except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
        progress(f"could not run: {exc!r}; logs in {work}")
        bench.fleet.stop()
        return 2
    finally:
        bench.fleet.stop()
        shutil.rmtree(work / "certs", ignore_errors=True)
    text = report(args, out)
    print(text)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "tenancy.md").write_text(text + "\n")
    out["parameters"] = {k: v for k, v in vars(args).items() if k != "engine"}
    out["parameters"]["engine"] = attrs.asdict(args.engine)
    out["checks"] = [{"check": n, "passed": p, "figures": f} for n, p, f in checks(out)]
    (RESULTS_DIR / "tenancy.json").write_text(json.dumps(jsonable(out), indent=1) + "\n")
    progress(f"logs kept in {work}; results in {RESULTS_DIR}/tenancy.md and tenancy.json")
    if args.strict and any(p is False for _, p, _ in checks(out)):
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="measured, per variant")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="left out, per variant")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few minutes")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    parser.add_argument(
        "--variants",
        default="fcfs,fair,fair-prompt,alone",
        help="comma-separated, of fcfs, fair, fair-prompt, alone",
    )
    parser.add_argument("--capacity-s", type=float, default=40.0, help="closed loop, measured")
    parser.add_argument(
        "--overload", type=float, default=1.5, help="A+B+C offered / capacity, at least"
    )
    parser.add_argument("--b-rps", type=float, default=0.5, help="B's rate (A's is 10x)")
    parser.add_argument("--c-rps", type=float, default=10.0, help="C's rate (before scaling)")
    parser.add_argument("--a-words", type=int, default=2000)
    parser.add_argument("--b-words", type=int, default=100)
    parser.add_argument("--c-prefix-words", type=int, default=2000)
    parser.add_argument("--c-tail-words", type=int, default=200)
    parser.add_argument("--d-words", type=int, default=400)
    parser.add_argument("--d-tpm", type=int, default=24000, help="D's tokens_per_minute")
    parser.add_argument("--max-tokens", type=int, default=64, help="every answer's length")
    parser.add_argument("--ttft-timeout-s", type=float, default=60.0)
    parser.add_argument("--client-rpm", type=int, default=30, help="the client phase's limit")
    parser.add_argument(
        "--client-s", type=float, default=90.0, help="client phase arrivals; 0: none"
    )
    parser.add_argument("--client-cap-s", type=float, default=240.0, help="then wait at most")
    parser.add_argument("--seed", type=int, default=7)
    defaults = EngineRates()
    parser.add_argument("--kv-blocks", type=int, default=defaults.kv_blocks)
    parser.add_argument("--prefill-tps", type=float, default=defaults.prefill_tps)
    parser.add_argument("--decode-tps", type=float, default=defaults.decode_tps)
    parser.add_argument("--max-seqs", type=int, default=defaults.max_seqs)
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.warmup_s, args.capacity_s = 0.25, 5.0, 10.0
        args.client_s, args.client_cap_s = 20.0, 30.0
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - {"fcfs", "fair", "fair-prompt", "alone"}
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    args.engine = EngineRates(
        kv_blocks=args.kv_blocks,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        max_seqs=args.max_seqs,
    )
    sys.exit(trio.run(main_async, args))


if __name__ == "__main__":
    main()
