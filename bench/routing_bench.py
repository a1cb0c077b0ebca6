#!/usr/bin/env python3
"""Routing benchmark: round_robin, least_outstanding and cache_aware, side by side.

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/routing_bench.py            # about 4 minutes, no GPU
    .venv/bin/python bench/routing_bench.py --quick    # shorter runs, a rough look
    .venv/bin/python bench/routing_bench.py --help

It starts real processes on free loopback ports: 8 mock engines with their
scheduler model on (llmgw_mock_engine.scheduler: a paged prefix cache, a shared
prefill rate, a decode rate per sequence, a limit on running sequences with a FIFO
queue), and for every run a fresh router in front of them with
`[router] balancing` set to the policy measured. Before every run each engine's
cache and records are emptied (POST /mock/reset), so each policy starts cold, and
each policy gets the same seeded arrival schedule, the same requests at the same
moments. The engines sleep for their costs, so the benchmark needs little CPU.

Three workloads:

1. multi-turn sessions, in the shape of llm-d's prefix-routing benchmark scaled to
   this machine: many sessions, each with a private context of thousands of tokens
   (all of them together several times one engine's cache), and follow-up turns
   that carry the whole conversation so far; Poisson arrivals at several rates, up
   to beyond least_outstanding's saturation, each stage of a fixed length. As in
   llm-d's benchmark the stages run one after another, lowest rate first, on the same
   engines and router, so the caches (and the conversations) carry over; each
   stage's figures are its own requests';
2. one hot prefix: every request starts with the same long system prompt, one
   request at a time and at Poisson rates; no engine may take more than 1.5x the
   even share;
3. no reuse: random prompts, where the cache cannot help; cache_aware should stay
   within 5% of least_outstanding.

Every figure comes from the engines' own reports (GET /mock/stats): time to first
token (TTFT) as the engine measured it, from the request's arrival to its first
token, so the load generator sharing the CPUs does not blur it; prefix-cache hit
rate = cached prompt tokens / prompt tokens (vLLM's vllm:prefix_cache_hits /
vllm:prefix_cache_queries); output tokens/s = output tokens of all the run's
answers / (last answer's end - the run's start); each engine's share of the
requests. 503s (and any other failure) are counted by the client.

The results are printed as markdown tables and written to bench/results/routing.md
and routing.json (git-ignored), followed by the issue's done-when checks as PASS /
FAIL lines. Process logs go to bench/results/routing-logs/. The exit status is 0
when the benchmark ran, whatever the checks (--strict: 1 when a check FAILs), and
2 when it could not run. A policy the router does not know yet is reported as
unavailable, and the checks that need it FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from llmgw_mock_engine.engine import answer_text  # noqa: E402  (the engines' own answers)

RESULTS_DIR = ROOT / "bench" / "results"
LOG_DIR = RESULTS_DIR / "routing-logs"
MODEL = "bench"
POLICIES = ("round_robin", "least_outstanding", "cache_aware")
REPLICAS = 8


@dataclass(frozen=True)
class EngineParams:
    """Each mock engine's scheduler model (the --mock-* flags), fixed for the whole run."""

    kv_blocks: int = 2400  # 38,400 tokens of KV cache
    block_size: int = 16
    prefill_tps: float = 11_000.0  # prompt tokens per second, shared by the engine
    decode_tps: float = 50.0  # output tokens per second of each running sequence
    max_seqs: int = 16

    def argv(self) -> list[str]:
        return [
            "--mock-kv-blocks", str(self.kv_blocks),
            "--mock-block-size", str(self.block_size),
            "--mock-prefill-tps", str(self.prefill_tps),
            "--mock-decode-tps", str(self.decode_tps),
            "--mock-max-seqs", str(self.max_seqs),
            "--mock-tokens", "1000",  # every request sets max_tokens
        ]  # fmt: skip

    @property
    def cache_tokens(self) -> int:
        return self.kv_blocks * self.block_size


@dataclass(frozen=True)
class MultiTurn:
    sessions: int = 48
    context_words: tuple[int, int] = (2000, 4000)  # each session's private context
    question_words: int = 40
    answer_tokens: int = 48
    rates: tuple[float, ...] = (3.0, 12.0, 24.0, 48.0)  # requests per second
    duration_s: float = 8.0


@dataclass(frozen=True)
class HotPrefix:
    system_words: int = 2000  # the one system prompt every request starts with
    question_words: int = 30
    answer_tokens: int = 8
    serial_requests: int = 48  # one at a time
    rates: tuple[float, ...] = (8.0, 24.0)
    duration_s: float = 5.0


@dataclass(frozen=True)
class NoReuse:
    prompt_words: tuple[int, int] = (1000, 3000)
    answer_tokens: int = 16
    rates: tuple[float, ...] = (12.0, 24.0)
    duration_s: float = 6.0


class BenchError(Exception):
    """The benchmark could not run (a process died, a port never opened, ...)."""


# --------------------------------------------------------------------------- processes


STARTED: list[Proc] = []


class Proc:
    """A started process whose output goes to a log file."""

    def __init__(self, name: str, argv: list[str], url_pattern: str) -> None:
        self.name = name
        self.url_pattern = re.compile(url_pattern)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Benchmark this checkout's code, whatever the virtualenv's editable install points at.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
        self.popen = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        self.url = ""
        STARTED.append(self)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_url(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = self.url_pattern.search(self.log_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self.url
            if self.popen.poll() is not None:
                raise BenchError(f"{self.name} exited with status {self.popen.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise BenchError(f"{self.name} printed no URL within {timeout} s:\n{self.log_tail()}")

    def cpu_s(self) -> float:
        try:
            text = Path(f"/proc/{self.popen.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = text[text.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        if not self._log.closed:
            self._log.close()


def start_engines(params: EngineParams) -> list[Proc]:
    engines = [
        Proc(
            f"engine-{i}",
            [sys.executable, "-m", "llmgw_mock_engine", "serve", MODEL, "--host", "127.0.0.1",
             "--port", "0", *params.argv()],
            r"mock engine serving .* on (http://127\.0\.0\.1:\d+)",
        )
        for i in range(REPLICAS)
    ]  # fmt: skip
    for engine in engines:
        engine.wait_url()
    return engines


def start_router(policy: str | None, engines: list[Proc], run: str) -> Proc:
    """A router in front of the engines; `policy` None: the router's own default, with
    no `balancing` key (a router from before the key balances by least outstanding)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    config = LOG_DIR / f"router-{run}.toml"
    endpoints = ", ".join(f'"{e.url}"' for e in engines)
    router = "" if policy is None else f'\n[router]\nbalancing = "{policy}"\n'
    config.write_text(
        "# written by bench/routing_bench.py\n"
        '[server]\nlisten = "127.0.0.1:0"\nshutdown_grace_s = 1\n'
        f'{router}\n[[models]]\nname = "{MODEL}"\nendpoints = [{endpoints}]\n'
    )
    proc = Proc(
        f"router-{run}",
        [sys.executable, "-m", "llmgw_server", "--config", str(config)],
        r"listening on (http://127\.0\.0\.1:\d+)",
    )
    proc.wait_url()
    deadline = time.monotonic() + 15
    while True:  # ready once the first health round found every engine
        try:
            ready = httpx.get(proc.url + "/readyz", timeout=2)
            if ready.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.popen.poll() is not None:
            proc.stop()
            raise BenchError(f"the router ({policy}) never became ready:\n{proc.log_tail()}")
        time.sleep(0.05)


def router_setting(policy: str, engines: list[Proc]) -> tuple[str | None, str]:
    """How to ask the router for `policy`: (the `balancing` value or None for the router's
    default, ""), or (None, why it cannot run)."""
    try:
        start_router(policy, engines, f"probe-{policy}").stop()
        return policy, ""
    except BenchError as exc:
        why = (str(exc).splitlines() or ["the router refused it"])[-1][:200]
    if policy == "least_outstanding":
        try:  # a router from before `balancing`: least outstanding is all it does
            start_router(None, engines, "probe-default").stop()
            return None, ""
        except BenchError:
            pass
    return None, why


def reset_engines(engines: list[Proc]) -> None:
    """Empty every engine's cache and records; they must be idle (wait until they are)."""
    deadline = time.monotonic() + 60
    for engine in engines:
        while True:
            answer = httpx.post(engine.url + "/mock/reset", timeout=5)
            if answer.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{engine.name} never became idle for a reset: {answer.text}")
            time.sleep(0.1)


# --------------------------------------------------------------------------- workloads


@dataclass
class Arrival:
    at_s: float  # from the run's start; ignored when the run is serial
    body: dict[str, Any]
    session: str = ""  # sent as x-session-id with --session-header


VOCABULARY = tuple(
    "".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 7))
    for i in range(5000)
)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=words))


def poisson_times(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


@dataclass
class Stage:
    rate: float | None  # requests per second; None: one request at a time
    arrivals: list[Arrival]

    @property
    def label(self) -> str:
        return "serial" if self.rate is None else f"{self.rate:g}"


@dataclass
class Plan:
    workload: str
    stages: list[Stage]
    # Warm: the stages run one after another on the same engines and router, whose caches
    # carry over, as in llm-d's benchmark; cold: each stage starts from empty caches.
    warm: bool


def multi_turn_stages(w: MultiTurn, seed: int) -> list[Stage]:
    """Poisson arrivals at each rate in turn, each the next turn of a session drawn at
    random; a turn carries the conversation so far (across stages too), with the answers
    the engines give (they are deterministic), so the schedule is the same whatever the
    routing."""
    contexts = []
    for s in range(w.sessions):
        rng = random.Random(f"{seed}-context-{s}")
        contexts.append(f"Session {s} documents: " + _text(rng, rng.randint(*w.context_words)))
    history: list[list[dict[str, str]]] = [[{"role": "system", "content": c}] for c in contexts]
    stages = []
    for rate in w.rates:
        rng = random.Random(f"{seed}-multi-turn-{rate}")
        arrivals = []
        for at in poisson_times(rate, w.duration_s, rng):
            s = rng.randrange(w.sessions)
            messages = [*history[s], {"role": "user", "content": _text(rng, w.question_words)}]
            body = {"model": MODEL, "messages": messages, "max_tokens": w.answer_tokens}
            answer = answer_text(body, w.answer_tokens)
            history[s] = [*messages, {"role": "assistant", "content": answer}]
            arrivals.append(Arrival(at, body, f"session-{s}"))
        stages.append(Stage(rate, arrivals))
    return stages


def hot_prefix_schedule(w: HotPrefix, rate: float | None, seed: int) -> list[Arrival]:
    system = _text(random.Random(f"{seed}-system"), w.system_words)
    rng = random.Random(f"{seed}-hot-{rate}")
    times = [0.0] * w.serial_requests if rate is None else poisson_times(rate, w.duration_s, rng)
    return [
        Arrival(
            at,
            {"model": MODEL, "max_tokens": w.answer_tokens, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": _text(rng, w.question_words)},
            ]},
        )
        for at in times
    ]  # fmt: skip


def no_reuse_schedule(w: NoReuse, rate: float, seed: int) -> list[Arrival]:
    rng = random.Random(f"{seed}-random-{rate}")
    return [
        Arrival(at, {"model": MODEL, "max_tokens": w.answer_tokens, "messages": [
            {"role": "user", "content": _text(rng, rng.randint(*w.prompt_words))},
        ]})
        for at in poisson_times(rate, w.duration_s, rng)
    ]  # fmt: skip


# --------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    workload: str
    rate: str  # "serial" or requests per second
    policy: str
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)  # client-side, by status or error
    ttft_p50_s: float = math.nan
    ttft_p90_s: float = math.nan
    output_tps: float = math.nan
    hit_rate: float = math.nan
    shares: list[float] = field(default_factory=list)  # each engine's share of requests
    wall_s: float = 0.0
    cpu_s: float = 0.0  # router + engines during the run
    client_cpu_s: float = 0.0  # this process, sending the requests
    unavailable: str = ""

    @property
    def status_503(self) -> int:
        return self.statuses.get("503", 0)

    @property
    def failures(self) -> int:
        return sum(n for k, n in self.statuses.items() if k != "200")

    @property
    def max_share(self) -> float:
        return max(self.shares) if self.shares else math.nan


async def send_all(
    url: str, arrivals: list[Arrival], serial: bool, session_header: bool
) -> tuple[float, Counter[str]]:
    """Send the schedule; returns the run's start (time.monotonic) and the outcomes."""
    outcomes: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(arrival: Arrival) -> None:
            try:
                headers = {"x-session-id": arrival.session} if session_header and arrival.session else {}
                answer = await client.post("/v1/chat/completions", json=arrival.body, headers=headers)
                outcomes[str(answer.status_code)] += 1
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1

        start_wall = time.monotonic()
        start = trio.current_time()
        if serial:
            for arrival in arrivals:
                await one(arrival)
        else:
            async with trio.open_nursery() as nursery:
                for arrival in arrivals:
                    await trio.sleep_until(start + arrival.at_s)
                    nursery.start_soon(one, arrival)
    return start_wall, outcomes


def engine_stats(engines: list[Proc]) -> list[dict[str, Any]]:
    return [httpx.get(e.url + "/mock/stats", timeout=10).json() for e in engines]


def engine_figures(
    result: RunResult, engines: list[Proc], start_wall: float, before: list[dict[str, Any]]
) -> None:
    """The stage's figures from the engines' reports: the requests that arrived since
    `start_wall`, and the counters' growth since `before`."""
    stats = engine_stats(engines)
    mine = [[r for r in s["requests"] if r["arrival"] >= start_wall] for s in stats]
    records = [r for rs in mine for r in rs]
    counts = [len(rs) for rs in mine]
    total = sum(counts)
    result.shares = [c / total for c in counts] if total else []
    ttfts = sorted(r["ttft_s"] for r in records if r["ttft_s"] is not None)
    if ttfts:
        result.ttft_p50_s = percentile(ttfts, 0.50)
        result.ttft_p90_s = percentile(ttfts, 0.90)
    done = [r for r in records if r["completed"]]
    if done:
        span = max(r["end"] for r in done) - start_wall
        result.output_tps = sum(r["output_tokens"] for r in done) / span
    queries = sum(s["prefix_cache_queries"] for s in stats) - sum(
        s["prefix_cache_queries"] for s in before
    )
    hits = sum(s["prefix_cache_hits"] for s in stats) - sum(s["prefix_cache_hits"] for s in before)
    if queries:
        result.hit_rate = hits / queries


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def run_stage(
    workload: str, policy: str, stage: Stage, router: Proc, engines: list[Proc], session_header: bool
) -> RunResult:
    result = RunResult(workload, stage.label, policy, requests=len(stage.arrivals))
    before = engine_stats(engines)
    cpu_before = router.cpu_s() + sum(e.cpu_s() for e in engines)
    client_before = time.process_time()
    began = time.monotonic()
    start_wall, outcomes = trio.run(
        send_all, router.url, stage.arrivals, stage.rate is None, session_header
    )
    result.wall_s = time.monotonic() - began
    result.cpu_s = router.cpu_s() + sum(e.cpu_s() for e in engines) - cpu_before
    result.client_cpu_s = time.process_time() - client_before
    result.statuses = dict(outcomes)
    engine_figures(result, engines, start_wall, before)
    print("  " + row_text(result), flush=True)
    return result


def run_plan(
    plan: Plan, policy: str, setting: str | None, engines: list[Proc], session_header: bool
) -> list[RunResult]:
    """Every stage of the plan under one policy: on one router and warm caches, or each
    stage on empty caches and a fresh router."""
    groups = [plan.stages] if plan.warm else [[stage] for stage in plan.stages]
    results = []
    for group in groups:
        reset_engines(engines)
        name = f"{plan.workload}-{'warm' if plan.warm else group[0].label}-{policy}"
        router = start_router(setting, engines, name)
        try:
            for stage in group:
                results.append(
                    run_stage(plan.workload, policy, stage, router, engines, session_header)
                )
        finally:
            router.stop()
    return results


# --------------------------------------------------------------------------- report


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f}"


def row_text(r: RunResult) -> str:
    if r.unavailable:
        return f"{r.workload:10} {r.rate:>6} {r.policy:17} unavailable: {r.unavailable}"
    return (
        f"{r.workload:10} {r.rate:>6} {r.policy:17} n={r.requests:<4} "
        f"TTFT p50 {ms(r.ttft_p50_s):>7} ms p90 {ms(r.ttft_p90_s):>7} ms  "
        f"{r.output_tps:7.0f} tok/s  hits {r.hit_rate:6.1%}  max share {r.max_share:5.1%}  "
        f"503s {r.status_503}  other failures {r.failures - r.status_503}  "
        f"({r.wall_s:.1f} s; CPU s: servers {r.cpu_s:.1f}, client {r.client_cpu_s:.1f})"
    )


def table(results: list[RunResult], workload: str) -> list[str]:
    lines = [
        "| rate (req/s) | policy | requests | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s "
        "| prefix hit rate | max share (even 12.5%) | shares per engine | 503s | other failures |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in results if r.workload == workload]
    rates = list(dict.fromkeys(r.rate for r in rows))
    for r in sorted(rows, key=lambda r: (rates.index(r.rate), POLICIES.index(r.policy))):
        if r.unavailable:
            lines.append(f"| {r.rate} | {r.policy} | unavailable: {r.unavailable} |||||||||")
            continue
        shares = " ".join(f"{s:.0%}" for s in r.shares)
        lines.append(
            f"| {r.rate} | {r.policy} | {r.requests} | {ms(r.ttft_p50_s)} | {ms(r.ttft_p90_s)} "
            f"| {r.output_tps:,.0f} | {r.hit_rate:.1%} | {r.max_share:.1%} | {shares} "
            f"| {r.status_503} | {r.failures - r.status_503} |"
        )
    return lines


def find(results: list[RunResult], workload: str, rate: str, policy: str) -> RunResult | None:
    for r in results:
        if (r.workload, r.rate, r.policy) == (workload, rate, policy) and not r.unavailable:
            return r
    return None


def checks(
    results: list[RunResult], mt: MultiTurn, hp: HotPrefix, nr: NoReuse, workloads: list[str]
) -> list[str]:
    """The issue's done-when checks, as PASS/FAIL lines (SKIP: the workload did not run)."""
    out = [f"SKIP  {w}: not run" for w in ("multi-turn", "hot-prefix", "no-reuse") if w not in workloads]

    def line(ok: bool, text: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    # Multi-turn: the first rate where least_outstanding's p90 passes 5x its lowest-rate p90.
    rates = [f"{r:g}" for r in mt.rates]
    base = find(results, "multi-turn", rates[0], "least_outstanding")
    trigger = None
    if base is not None:
        for rate in rates[1:]:
            lo = find(results, "multi-turn", rate, "least_outstanding")
            if lo is not None and lo.ttft_p90_s > 5 * base.ttft_p90_s:
                trigger = rate
                break
    if "multi-turn" not in workloads:
        pass
    elif base is None:
        line(False, "multi-turn: least_outstanding did not run")
    elif trigger is None:
        line(False, f"multi-turn: least_outstanding's TTFT p90 never exceeded 5x its p90 at "
                    f"{rates[0]} req/s ({ms(base.ttft_p90_s)} ms): raise the top rate")  # fmt: skip
    else:
        lo = find(results, "multi-turn", trigger, "least_outstanding")
        ca = find(results, "multi-turn", trigger, "cache_aware")
        assert lo is not None
        head = (f"multi-turn at {trigger} req/s (least_outstanding's p90 {ms(lo.ttft_p90_s)} ms "
                f"> 5x {ms(base.ttft_p90_s)} ms at {rates[0]} req/s):")  # fmt: skip
        if ca is None:
            line(False, f"{head} cache_aware unavailable")
        else:
            line(ca.ttft_p90_s * 5 <= lo.ttft_p90_s,
                 f"{head} cache_aware TTFT p90 {ms(ca.ttft_p90_s)} ms, at least 5x lower "
                 f"(ratio {lo.ttft_p90_s / ca.ttft_p90_s:.2f}x)")  # fmt: skip
            line(ca.output_tps >= 1.25 * lo.output_tps,
                 f"{head} cache_aware {ca.output_tps:,.0f} output tok/s, at least 1.25x "
                 f"least_outstanding's {lo.output_tps:,.0f} ({ca.output_tps / lo.output_tps:.2f}x)")  # fmt: skip
    ca_runs = [r for r in results if r.policy == "cache_aware" and not r.unavailable]
    if not ca_runs:
        line(False, "no 503s: cache_aware unavailable")
    else:
        line(all(r.status_503 == 0 for r in ca_runs),
             f"no 503s with cache_aware in any run ({sum(r.status_503 for r in ca_runs)}); "
             f"other failures {sum(r.failures - r.status_503 for r in ca_runs)}")  # fmt: skip
    even = 1 / REPLICAS
    for rate in ["serial", *(f"{r:g}" for r in hp.rates)] if "hot-prefix" in workloads else []:
        ca = find(results, "hot-prefix", rate, "cache_aware")
        if ca is None:
            line(False, f"hot prefix at {rate}: cache_aware unavailable")
            continue
        line(ca.max_share <= 1.5 * even,
             f"hot prefix at {rate}{'' if rate == 'serial' else ' req/s'}: cache_aware's busiest "
             f"engine took {ca.max_share:.1%} of the requests, within 1.5x the even share "
             f"({1.5 * even:.2%})")  # fmt: skip
    for rate in [f"{r:g}" for r in nr.rates] if "no-reuse" in workloads else []:
        ca = find(results, "no-reuse", rate, "cache_aware")
        lo = find(results, "no-reuse", rate, "least_outstanding")
        if ca is None or lo is None:
            line(False, f"no reuse at {rate} req/s: cache_aware or least_outstanding unavailable")
            continue
        line(ca.ttft_p90_s <= 1.05 * lo.ttft_p90_s and ca.output_tps >= 0.95 * lo.output_tps,
             f"no reuse at {rate} req/s: cache_aware TTFT p90 {ms(ca.ttft_p90_s)} ms vs "
             f"{ms(lo.ttft_p90_s)} ms, {ca.output_tps:,.0f} vs {lo.output_tps:,.0f} output tok/s "
             f"(within 5%)")  # fmt: skip
    return out


def parameters_text(params: EngineParams, mt: MultiTurn, hp: HotPrefix, nr: NoReuse) -> list[str]:
    sessions_tokens = mt.sessions * sum(mt.context_words) / 2
    return [
        f"- engines: {REPLICAS} mock engines, each: KV cache {params.kv_blocks} blocks of "
        f"{params.block_size} tokens ({params.cache_tokens:,} tokens), prefill "
        f"{params.prefill_tps:,.0f} tokens/s shared, decode {params.decode_tps:g} tokens/s per "
        f"sequence, at most {params.max_seqs} sequences running (the rest queue, FIFO)",
        f"- multi-turn: {mt.sessions} sessions, each with a private context of "
        f"{mt.context_words[0]}-{mt.context_words[1]} words (about {sessions_tokens:,.0f} tokens "
        f"in all, {sessions_tokens / params.cache_tokens:.1f}x one engine's cache), turns of "
        f"{mt.question_words} words carrying the conversation so far, answers of "
        f"{mt.answer_tokens} tokens; Poisson arrivals at {', '.join(f'{r:g}' for r in mt.rates)} "
        f"req/s in turn, {mt.duration_s:g} s of arrivals each, on the same engines and router "
        "(caches and conversations carry over from stage to stage); each turn from a session "
        "drawn at random",
        f"- hot prefix: a {hp.system_words}-word system prompt in every request, then "
        f"{hp.question_words} random words; answers of {hp.answer_tokens} tokens; "
        f"{hp.serial_requests} requests one at a time, then Poisson at "
        f"{', '.join(f'{r:g}' for r in hp.rates)} req/s for {hp.duration_s:g} s",
        f"- no reuse: random prompts of {nr.prompt_words[0]}-{nr.prompt_words[1]} words, "
        f"answers of {nr.answer_tokens} tokens; Poisson at {', '.join(f'{r:g}' for r in nr.rates)} "
        f"req/s for {nr.duration_s:g} s",
        "- a token is a word of the chat rendering; TTFT is the engine's own measure "
        "(arrival to first token); output tok/s = output tokens / (last answer's end - run "
        "start); hit rate = cached prompt tokens / prompt tokens",
    ]


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=9, help="the arrival schedules' seed (default 9)")
    p.add_argument("--quick", action="store_true", help="shorter runs at fewer rates: a rough look")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument(
        "--workloads", default="multi-turn,hot-prefix,no-reuse", help="comma-separated workloads"
    )
    p.add_argument(
        "--session-header",
        action="store_true",
        help="send each multi-turn request's session as x-session-id (the router's session\n"
        "affinity, which every policy honours): a reference, not the benchmark",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a check FAILs")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "routing.md", help="results file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    params, mt, hp, nr = EngineParams(), MultiTurn(), HotPrefix(), NoReuse()
    if args.quick:
        mt = MultiTurn(rates=(3.0, 48.0), duration_s=6.0)
        hp = HotPrefix(serial_requests=24, rates=(24.0,), duration_s=4.0)
        nr = NoReuse(rates=(24.0,), duration_s=4.0)
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = (set(policies) - set(POLICIES)) | (set(workloads) - {"multi-turn", "hot-prefix", "no-reuse"})
    if unknown:
        print(f"unknown policy or workload: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    began = time.monotonic()
    results: list[RunResult] = []
    print("routing benchmark; parameters:\n" + "\n".join(parameters_text(params, mt, hp, nr)), flush=True)
    try:
        engines = start_engines(params)
        settings = {p: router_setting(p, engines) for p in policies}
        missing = {p: why for p, (_, why) in settings.items() if why}
        for policy, why in missing.items():
            print(f"  the router does not run balancing = {policy!r} yet: {why}", flush=True)
        for policy, (value, why) in settings.items():
            if value is None and not why:
                print(f"  {policy}: the router's default (it has no `balancing` key yet)", flush=True)
        plans: list[Plan] = []
        if "multi-turn" in workloads:
            plans.append(Plan("multi-turn", multi_turn_stages(mt, args.seed), warm=True))
        if "hot-prefix" in workloads:
            stages = [Stage(r, hot_prefix_schedule(hp, r, args.seed)) for r in (None, *hp.rates)]
            plans.append(Plan("hot-prefix", stages, warm=False))
        if "no-reuse" in workloads:
            stages = [Stage(r, no_reuse_schedule(nr, r, args.seed)) for r in nr.rates]
            plans.append(Plan("no-reuse", stages, warm=False))
        for plan in plans:
            for policy in policies:
                if policy in missing:
                    results += [
                        RunResult(plan.workload, stage.label, policy, unavailable=missing[policy])
                        for stage in plan.stages
                    ]
                    continue
                setting = settings[policy][0]
                results += run_plan(plan, policy, setting, engines, args.session_header)
    except BenchError as exc:
        print(f"the benchmark could not run: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in STARTED:
            proc.stop()
    verdicts = checks(results, mt, hp, nr, workloads)
    report = [
        "# Routing benchmark",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, seed {args.seed}, {time.monotonic() - began:.0f} s",
        "",
        *parameters_text(params, mt, hp, nr),
    ]
    for workload in ("multi-turn", "hot-prefix", "no-reuse"):
        if workload in workloads:
            report += ["", f"## {workload}", "", *table(results, workload)]
    report += ["", "## Checks", "", "```", *verdicts, "```", ""]
    text = "\n".join(report)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    parameters = {
        "engine": asdict(params),
        "multi_turn": asdict(mt),
        "hot_prefix": asdict(hp),
        "no_reuse": asdict(nr),
    }
    runs = [asdict(r) for r in results]
    everything = {"parameters": parameters, "runs": runs, "checks": verdicts}
    args.out.with_suffix(".json").write_text(json.dumps(everything, indent=1))
    print(f"written to {args.out} and {args.out.with_suffix('.json')}")
    failed = any(v.startswith("FAIL") for v in verdicts)
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
