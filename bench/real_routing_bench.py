#!/usr/bin/env python3
"""Routing on real engines: cache_aware against least_outstanding and round_robin.

Run it from the repository root with the project's virtualenv (needs `make real-engine`):

    .venv/bin/python bench/real_routing_bench.py            # about 4 minutes, 2 CPU cores
    .venv/bin/python bench/real_routing_bench.py --help

Two llama-server replicas (llama.cpp on CPU, gemma-3-270m, from tests/real_engine.py's
cache), each with a fixed number of slots (-np), context (-c), host prompt cache
(--cache-ram, MiB: llama.cpp saves an idle slot's prompt state there and restores it
when a later prompt continues it, evicting the oldest state beyond N MiB) and threads
(-t). Together their slots hold fewer sessions than the workload has (by default 4
slots, 8 sessions); each replica's slots and prompt cache together hold somewhat more
than half of the sessions (160 MiB holds about 5 prompt states of ~30 MiB; the report
prints the sizes llama.cpp logged). So a replica can keep its own share of the
sessions cached, but not every session: the gain is in sending each session back to
the replica that holds it.

For each policy, in turn: fresh engines (so no policy inherits another's cache) and a
fresh router in front of them with `[router] balancing` set to the policy. Then the
same seeded workload: every session has a long private context (a system message of
several hundred tokens, so that uncached prefill takes seconds on this CPU); a first
turn for each session, then rounds of follow-up turns, each appending the previous
answer and a short question; sessions interleaved in a seeded random order each
round; requests strictly one at a time (no x-session-id header: affinity is left to
the policy).

For every follow-up turn: the client's time to first token (TTFT, from sending to the
first streamed chunk with content) and the engine's own figures from llama-server's
final stream chunk (`timings.prompt_ms`: prefill time; `timings.cache_n`: prompt
tokens served from the cache; `prompt_n`: tokens prefilled). The engine's prompt_ms
does not depend on the client and router sharing the cores, so the check uses it:
PASS when cache_aware's median follow-up prompt_ms is at most half of
least_outstanding's (the client-side TTFT is reported beside it, and checked too).

Results go to stdout and bench/results/real_routing.md (git-ignored); engine and router
logs to bench/results/real-routing-logs/. Exit status 0 when it ran (--strict: 1 when
a check FAILs), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import real_engine  # noqa: E402  (the llama-server build and model the tests use)

RESULTS = ROOT / "bench" / "results"
LOG_DIR = RESULTS / "real-routing-logs"
MODEL = "gemma"
POLICIES = ("cache_aware", "least_outstanding", "round_robin")

WORDS = (
    "the river stone cloud garden window paper engine silver forest market harbor winter "
    "summer letter bridge candle mirror orchard lantern valley meadow station village "
    "number record signal weather machine picture problem history country question "
    "morning evening kitchen teacher student doctor captain farmer painter writer"
).split()
QUESTIONS = (
    "What is the main point so far?",
    "Which detail matters most, and why?",
    "Give one more example from the notes.",
    "What would you check next?",
    "Summarise that in five words.",
    "Which word appears most often?",
)


class BenchError(Exception):
    pass


@dataclass(frozen=True)
class Params:
    sessions: int
    turns: int  # per session, the first included
    context_words: int
    max_tokens: int
    slots: int  # -np per engine
    ctx: int  # -c per engine (split among its slots)
    cache_ram_mib: int
    threads: int
    seed: int

    def engine_argv(self, port: int) -> list[str]:
        return [
            str(real_engine.server_binary()), "-m", str(real_engine.model_path()),
            "--host", "127.0.0.1", "--port", str(port),
            "-np", str(self.slots), "-c", str(self.ctx), "--cache-ram", str(self.cache_ram_mib),
            "-t", str(self.threads), "--metrics", "--no-webui",
        ]  # fmt: skip


# --------------------------------------------------------------------------- processes


class Proc:
    """A process in its own session (process group), output to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = LOG_DIR / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        self.url = ""

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, url: str, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + path, timeout=2).status_code == 200:
                    self.url = url
                    return
            if self.popen.poll() is not None:
                raise BenchError(
                    f"{self.name} exited ({self.popen.returncode}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} not ready within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, grace: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        if not self._log.closed:
            self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_engines(p: Params, policy: str) -> list[Proc]:
    engines = []
    for i in range(2):
        port = free_port()
        engines.append(Proc(f"{policy}-engine-{i}", p.engine_argv(port)))
        engines[-1].url = f"http://127.0.0.1:{port}"
    for e in engines:
        e.wait_ready(e.url, "/health", timeout=60)
    return engines


def start_router(policy: str, engines: list[Proc]) -> Proc:
    config = LOG_DIR / f"router-{policy}.toml"
    endpoints = ", ".join(f'"{e.url}"' for e in engines)
    config.write_text(
        "# written by bench/real_routing_bench.py\n"
        '[server]\nlisten = "127.0.0.1:0"\nshutdown_grace_s = 1\n'
        f'\n[router]\nbalancing = "{policy}"\n'
        f'\n[[models]]\nname = "{MODEL}"\nendpoints = [{endpoints}]\n'
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Benchmark this checkout's code, whatever the virtualenv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT / "src"), env.get("PYTHONPATH")) if x)
    router = Proc(
        f"router-{policy}", [sys.executable, "-m", "llmgw_server", "--config", str(config)], env
    )
    deadline = time.monotonic() + 30
    pattern = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
    while not (match := pattern.search(router.log_path.read_text(errors="replace"))):
        if router.popen.poll() is not None or time.monotonic() > deadline:
            router.stop()
            raise BenchError(f"the router ({policy}) did not start:\n{router.log_tail()}")
        time.sleep(0.05)
    try:  # ready once its first health round found both engines
        router.wait_ready(match.group(1), "/readyz", timeout=20)
    except BenchError:
        router.stop()
        raise
    return router


# --------------------------------------------------------------------------- workload


@dataclass
class Session:
    sid: int
    messages: list[dict[str, str]]


def sessions_for(p: Params) -> list[Session]:
    out = []
    for sid in range(p.sessions):
        rng = random.Random(f"{p.seed}-context-{sid}")
        notes = " ".join(rng.choice(WORDS) for _ in range(p.context_words))
        system = f"You are assistant {sid}. Answer from these private notes only. Notes: {notes}"
        out.append(Session(sid, [{"role": "system", "content": system}]))
    return out


def schedule(p: Params) -> list[list[int]]:
    """Each round's order of sessions: the same for every policy."""
    rng = random.Random(f"{p.seed}-order")
    rounds = []
    for _ in range(p.turns):
        order = list(range(p.sessions))
        rng.shuffle(order)
        rounds.append(order)
    return rounds


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float | None  # client-side, to the first chunk with content
    prompt_ms: float
    cache_n: int
    prompt_n: int
    answer: str
    engine: int = -1  # which engine served it (its counters moved)


def ask(client: httpx.Client, url: str, messages: list[dict[str, str]], p: Params) -> Turn:
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": p.max_tokens,
            "temperature": 0, "seed": p.seed}  # fmt: skip
    start = time.monotonic()
    first: float | None = None
    answer = ""
    timings: dict[str, Any] | None = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"status {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.monotonic() - start
                    answer += content
            if "timings" in chunk:
                timings = chunk["timings"]
    if timings is None:
        raise BenchError("llama-server's stream ended without its timings")
    return Turn(-1, -1, first, float(timings["prompt_ms"]), int(timings["cache_n"]),
                int(timings["prompt_n"]), answer)  # fmt: skip


@dataclass
class PolicyResult:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    state_mib: list[float] = field(default_factory=list)  # prompt states llama.cpp cached
    decisions: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def follow_ups(self) -> list[Turn]:
        return [t for t in self.turns if t.turn > 0]


def engine_work(client: httpx.Client, engines: list[Proc]) -> list[float]:
    """Each engine's prompt + predicted token counters."""
    out = []
    for e in engines:
        text = client.get(e.url + "/metrics").text
        out.append(metric_sum(text, "llamacpp:prompt_tokens_total")
                   + metric_sum(text, "llamacpp:tokens_predicted_total"))  # fmt: skip
    return out


def serving_engine(client: httpx.Client, engines: list[Proc], before: list[float]) -> int:
    """The engine whose counters moved since `before` (they may lag the stream's end)."""
    deadline = time.monotonic() + 3
    while True:
        after = engine_work(client, engines)
        moved = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a != b]
        if len(moved) == 1:
            before[:] = after
            return moved[0]
        if time.monotonic() > deadline:
            raise BenchError(f"cannot tell which engine served a request: {before} -> {after}")
        time.sleep(0.02)


def metric_sum(text: str, name: str, kind: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.split("{")[0].split(" ")[0] == name and (kind is None or f'kind="{kind}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_policy(p: Params, policy: str, rounds: list[list[int]]) -> PolicyResult:
    result = PolicyResult(policy)
    procs: list[Proc] = []
    try:
        engines = start_engines(p, policy)
        procs += engines
        router = start_router(policy, engines)
        procs.append(router)
        sessions = sessions_for(p)
        start = time.monotonic()
        with httpx.Client(timeout=httpx.Timeout(300, connect=5)) as client:
            work = engine_work(client, engines)
            for turn, order in enumerate(rounds):
                for sid in order:
                    s = sessions[sid]
                    s.messages.append(
                        {"role": "user", "content": QUESTIONS[(sid + turn) % len(QUESTIONS)]}
                    )
                    t = ask(client, router.url, s.messages, p)
                    t.session, t.turn = sid, turn
                    t.engine = serving_engine(client, engines, work)
                    s.messages.append({"role": "assistant", "content": t.answer})
                    result.turns.append(t)
                    print(f"  {policy:17} turn {turn} session {sid:2}: prompt {t.prompt_ms:7.0f} ms, "
                          f"cache_n {t.cache_n:4}, prompt_n {t.prompt_n:4}, engine {t.engine}, "
                          f"ttft {ms(t.ttft_s)}", flush=True)  # fmt: skip
            result.wall_s = time.monotonic() - start
            text = client.get(router.url + "/metrics").text
            for kind in (
                "cache_hit",
                "load_override",
                "fallback",
                "least_outstanding",
                "round_robin",
            ):
                n = metric_sum(text, "llmgw_balancing_decisions_total", kind)
                if n:
                    result.decisions[kind] = int(n)
        for e in engines:
            result.state_mib += state_sizes(e)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return result


def state_sizes(engine: Proc) -> list[float]:
    """The sizes of the prompt states the engine's host cache held, from its log (printed
    when one is evicted to make room, or refused for exceeding --cache-ram)."""
    text = engine.log_path.read_text(errors="replace")
    return [float(x) for x in re.findall(r"(?:size = |prompt state size )([\d.]+) MiB", text)]


# --------------------------------------------------------------------------- report


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def figures(r: PolicyResult) -> dict[str, Any]:
    fu = r.follow_ups()
    previous = {(t.session, t.turn): t.engine for t in r.turns}
    ttfts = [t.ttft_s for t in fu if t.ttft_s is not None]
    cached = sum(t.cache_n for t in fu)
    prompt = sum(t.cache_n + t.prompt_n for t in fu)
    return {
        "ttft_s": median(ttfts),
        "prompt_ms": median([t.prompt_ms for t in fu]),
        "cache_n": median([float(t.cache_n) for t in fu]),
        "hit": cached / prompt if prompt else 0.0,
        "full_hits": sum(1 for t in fu if t.prompt_n < t.cache_n),  # mostly cached
        "n": len(fu),
        "same": sum(1 for t in fu if t.engine == previous[(t.session, t.turn - 1)]),
        "first_prompt_ms": median([t.prompt_ms for t in r.turns if t.turn == 0]),
    }


def report(p: Params, results: list[PolicyResult]) -> tuple[list[str], bool]:
    commit = real_engine.cache_dir() / "LLAMA_CPP_COMMIT"
    llama = commit.read_text().strip() if commit.is_file() else "unknown"
    lines = [
        "# Real-engine routing bench (bench/real_routing_bench.py)",
        "",
        f"Two llama-server replicas (llama.cpp {llama[:12]}, CPU, {real_engine.MODEL_FILE}), each "
        f"`-np {p.slots} -c {p.ctx} --cache-ram {p.cache_ram_mib} -t {p.threads} --metrics`; "
        f"{p.sessions} sessions of ~{p.context_words}-word private context, {p.turns} turns each "
        f"({p.turns - 1} follow-up{'s' if p.turns != 2 else ''} appending the previous answer and a short question), "
        f"max_tokens {p.max_tokens}, temperature 0, seed {p.seed}; requests one at a time, "
        "sessions in a seeded random order each round; fresh engines and router per policy. "
        f"Slots in all: {2 * p.slots} < {p.sessions} sessions. Machine: {os.cpu_count()} cores.",
        "",
        "Follow-up turns (medians): prompt_ms and cache_n from llama-server's own timings; "
        "TTFT measured by the client through the router.",
        "",
        "| policy | follow-ups | TTFT p50 | prompt_ms p50 | cache_n p50 | cached share of prompt "
        "tokens | turns mostly cached | same engine as the previous turn | requests per engine | "
        "router decisions | wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    figs = {r.policy: figures(r) for r in results}
    for r in results:
        f = figs[r.policy]
        decisions = ", ".join(f"{k} {v}" for k, v in r.decisions.items()) or "-"
        per_engine = " / ".join(str(sum(1 for t in r.turns if t.engine == i)) for i in (0, 1))
        homes = [len({t.session for t in r.turns if t.turn == 0 and t.engine == i}) for i in (0, 1)]
        per_engine += f" (first turns {homes[0]} / {homes[1]})"
        lines.append(
            f"| {r.policy} | {f['n']} | {ms(f['ttft_s'])} | {f['prompt_ms']:.0f} ms | "
            f"{f['cache_n']:.0f} | {f['hit']:.0%} | {f['full_hits']}/{f['n']} | "
            f"{f['same']}/{f['n']} | {per_engine} | "
            f"{decisions} | {r.wall_s:.0f} s |"
        )
    first = [figs[r.policy]["first_prompt_ms"] for r in results]
    states = sorted(x for r in results for x in r.state_mib)
    lines += [
        "",
        f"First turns (uncached, every policy): prompt_ms p50 {statistics.median(first):.0f} ms. "
        + (f"Prompt states in llama.cpp's host cache: {states[0]:.0f}-{states[-1]:.0f} MiB, "
           f"median {statistics.median(states):.0f} MiB (from the engines' logs), so --cache-ram "
           f"{p.cache_ram_mib} holds about {p.cache_ram_mib / statistics.median(states):.1f} of "
           "them per engine, besides its slots."
           if states else ""),
        "",
    ]  # fmt: skip
    ok = True
    ca, lo = figs.get("cache_aware"), figs.get("least_outstanding")
    if ca and lo:
        for label, key in (("engine prompt_ms", "prompt_ms"), ("client TTFT", "ttft_s")):
            a, b = ca[key], lo[key]
            if a is None or b is None:
                lines.append(f"FAIL: no {label} figures")
                ok = False
                continue
            passed = a <= b / 2
            ok = ok and passed
            lines.append(
                f"{'PASS' if passed else 'FAIL'}: cache_aware's median follow-up {label} is "
                f"{b / a:.2f}x lower than least_outstanding's ({a * (1 if key == 'prompt_ms' else 1000):.0f}"
                f" vs {b * (1 if key == 'prompt_ms' else 1000):.0f} ms; needed: at most half)"
            )
    else:
        lines.append("FAIL: cache_aware and least_outstanding were not both run")
        ok = False
    return lines, ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="per session, the first included")
    ap.add_argument("--context-words", type=int, default=550)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--slots", type=int, default=2, help="llama-server -np, per engine")
    ap.add_argument("--ctx", type=int, default=4096, help="llama-server -c, per engine")
    ap.add_argument("--cache-ram", type=int, default=160, help="llama-server --cache-ram, MiB")
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t, per engine")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    p = Params(a.sessions, a.turns, a.context_words, a.max_tokens, a.slots, a.ctx, a.cache_ram,
               a.threads, a.seed)  # fmt: skip
    if not real_engine.is_built():
        print("llama-server and the model are not built: run `make real-engine`", file=sys.stderr)
        return 2
    policies = [x.strip() for x in a.policies.split(",") if x.strip()]
    rounds = schedule(p)
    results = []
    try:
        for policy in policies:
            print(f"{policy}: fresh engines and router", flush=True)
            results.append(run_policy(p, policy, rounds))
    except (BenchError, httpx.HTTPError) as exc:
        print(f"the benchmark could not run: {exc}", file=sys.stderr)
        return 2
    lines, ok = report(p, results)
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "real_routing.md").write_text(text)
    return 1 if a.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
