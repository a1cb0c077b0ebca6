#!/usr/bin/env python3
"""Autoscaling benchmark: llmgw's autoscaler against fixed replicas and llm-d's rule, on
one seeded trace of a compressed day.

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/autoscale_bench.py            # a few minutes of CPU, no GPU
    .venv/bin/python bench/autoscale_bench.py --quick    # a shorter day
    .venv/bin/python bench/autoscale_bench.py --help

What it is: a discrete-event simulation in virtual time, in one process, built from the
pieces llmgw runs. Each replica is the mock engine's scheduler model
(llmgw_mock_engine.scheduler: a paged KV cache, a shared prefill rate, a decode rate per
sequence, at most `max_seqs` running, FIFO admission), started `start_s` (30 s) after the
control plane asks for it and holding its GPUs from then on. The router model sends each
request to the ready replica with the fewest outstanding, holds requests while a model has
none (released in order when one is ready, failed after `hold_timeout_s`), and stops
sending to a replica that drains (stopped once its requests are done). The decision is
the control plane's own code: `control.scaling.Scaling` (the autoscaler of every
autoscaled model) fed every `autoscale_interval_s` (5 s) with what routers report (in
flight, held, the worst TTFT p90 since the last cycle, the engines' KV use, the last
arrival), and woken at once by a held request, as `control_shell.controlplane` does. The
same simulator runs fixed replicas (at the peak's need and at the mean's) and llm-d's
workload-variant autoscaler's saturation rule (a replica is saturated at KV use 0.80 or a
queue of 5; one more when the spare KV use is under 0.10 or the spare queue under 3; one
fewer when the load spread over one replica fewer would leave both spares; one step a
cycle; it does not scale to zero, so its minimum is 1). A simulation rather than real
processes, because the point is a day's decisions: a real day takes a day, and the wiring
of the same code is tested end to end (tests/test_autoscaling_e2e.py).

The trace (seeded): two models. "chat" follows a day of 24 hours compressed to
`hour_s` each (300 s: the day lasts 2 hours of virtual time): a quiet night at a tenth of
the peak, a morning ramp, a peak at midday, an evening lull, bursts of +60% for a minute
four times a day; Poisson arrivals. "sleepy" gets no request for hours, then a short
busy spell twice a day: it sleeps at zero replicas and wakes on its first request.

Reported, per policy and model: requests, the share of requests whose TTFT met the
objective (the requests held while a model woke from zero counted apart), failed
requests (held past the timeout), replica-minutes (each replica from the moment it was
asked for until it stopped), and the first request's wait after each scale from zero.
The done-when checks follow as PASS / FAIL lines; the exit status is 0 when it ran
(--strict: 1 when a check fails). Results also go to bench/results/autoscale.md and
autoscale.json (git-ignored).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from llmgw_core.autoscaling import Autoscale  # noqa: E402
from llmgw_core.catalog import Catalog, ModelEntry, Profile  # noqa: E402
from llmgw_mock_engine.scheduler import Admission, EngineModel, Scheduler  # noqa: E402
from llmgw_server.control.autoscale import ModelLoad  # noqa: E402
from llmgw_server.control.scaling import Scaling  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
ENGINE = EngineModel(kv_blocks=2048, block_size=16, prefill_tps=8000.0, decode_tps=50.0, max_seqs=16)
TTFT_OBJECTIVE_MS = 1000.0
HOLD_TIMEOUT_S = 300.0
CYCLE_S = 5.0
DRAIN_TIMEOUT_S = 60.0


@attrs.frozen
class Workload:
    hour_s: float = 300.0  # a day's hour, compressed
    start_s: float = 30.0  # an engine's start
    chat_peak_rps: float = 24.0
    sleepy_rps: float = 1.0
    prompt_tokens: tuple[int, int] = (200, 600)
    output_tokens: tuple[int, int] = (20, 100)
    seed: int = 7


# The autoscaled models' [models.autoscale], as an operator would write it.
SPECS = {
    "chat": Autoscale(max=16, min=1, target_in_flight=8.0, ttft_p90_ms=TTFT_OBJECTIVE_MS),
    "sleepy": Autoscale(
        max=4, min=0, target_in_flight=8.0, ttft_p90_ms=TTFT_OBJECTIVE_MS, idle_to_zero_s=600.0
    ),
}


def chat_rate(w: Workload, t: float) -> float:
    """Requests a second of "chat" at virtual time t: a day, compressed."""
    hour = (t / w.hour_s) % 24
    # Night at a tenth of the peak, the peak at 13:00, a lull around 19:00.
    day = 0.1 + 0.9 * max(0.0, math.sin(math.pi * (hour - 6) / 14)) ** 2 if 6 <= hour <= 20 else 0.1
    if 18 <= hour <= 20:
        day *= 0.7
    burst = 1.0
    for start in (9.5, 11.0, 14.5, 16.0):  # bursts of +60% for a minute
        if start * w.hour_s <= t % (24 * w.hour_s) < start * w.hour_s + 60:
            burst = 1.6
    return w.chat_peak_rps * day * burst


def sleepy_rate(w: Workload, t: float) -> float:
    hour = (t / w.hour_s) % 24
    busy = 8.0 <= hour < 9.0 or 16.0 <= hour < 16.5
    return w.sleepy_rps if busy else 0.0


RATES: dict[str, Callable[[Workload, float], float]] = {"chat": chat_rate, "sleepy": sleepy_rate}


@attrs.define
class Request:
    rid: int
    model: str
    arrival: float
    tokens: list[str]
    output: int
    woke: bool = False  # held while its model had no ready replica (waking from zero)
    first_after_zero: bool = False  # the request that woke its model
    first_token: float | None = None
    failed: bool = False


@attrs.define
class Replica:
    name: str
    asked_at: float
    ready_at: float
    engine: Scheduler
    ready: bool = False
    draining: bool = False
    stopped_at: float | None = None
    outstanding: int = 0
    requests: dict[int, Request] = attrs.field(factory=dict)


def trace(w: Workload, day_s: float) -> list[Request]:
    """Poisson arrivals by thinning, seeded: the same requests for every policy."""
    rng = random.Random(w.seed)
    requests: list[Request] = []
    ids = itertools.count()
    for model, rate in RATES.items():
        top = max(rate(w, t) for t in range(0, int(day_s), 10)) * 1.7 + 1e-9
        t = 0.0
        while True:
            t += rng.expovariate(top)
            if t >= day_s:
                break
            if rng.random() * top < rate(w, t):
                size = rng.randint(*w.prompt_tokens)
                tokens = [f"w{rng.randrange(50_000)}" for _ in range(size)]
                requests.append(Request(next(ids), model, t, tokens, rng.randint(*w.output_tokens)))
    requests.sort(key=lambda r: r.arrival)
    return requests


# The policy: (the simulation, now, woken by a held request rather than a cycle) -> counts.
Decide = Callable[["Sim", float, bool], dict[str, int]]


class Sim:
    def __init__(self, w: Workload, requests: list[Request], decide: Decide, wakes: bool) -> None:
        self.w = w
        self.decide = decide
        self.wakes = wakes  # whether a held request asks for a replica at once
        self.now = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.replicas: dict[str, list[Replica]] = {m: [] for m in RATES}
        self.held: dict[str, deque[Request]] = {m: deque() for m in RATES}
        self.names = itertools.count()
        self.requests = [attrs.evolve(r, tokens=r.tokens) for r in requests]
        self.last_arrival: dict[str, float | None] = dict.fromkeys(RATES)
        self.ttfts: dict[str, list[tuple[float, float]]] = {m: [] for m in RATES}  # (at, ms)
        self.cycle_at = 0.0
        for r in self.requests:
            self.at(r.arrival, "arrive", r)

    def at(self, when: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def run(self, end: float, initial: dict[str, int]) -> None:
        for model, count in initial.items():
            self.scale(model, count, start_s=0.0)  # the day starts with them serving
        self.at(CYCLE_S, "cycle", None)
        while self.events:
            when, _, kind, payload = heapq.heappop(self.events)
            if when > end:
                break
            self.now = when
            getattr(self, "on_" + kind)(payload)
        for replicas in self.replicas.values():
            for r in replicas:
                if r.stopped_at is None:
                    r.stopped_at = end

    # -- the router ----------------------------------------------------------

    def on_arrive(self, request: Request) -> None:
        self.last_arrival[request.model] = self.now
        ready = [r for r in self.replicas[request.model] if r.ready and not r.draining]
        if not ready:
            request.woke = True
            request.first_after_zero = not any(
                not r.draining and r.stopped_at is None for r in self.replicas[request.model]
            )
            self.held[request.model].append(request)
            self.at(self.now + HOLD_TIMEOUT_S, "hold_timeout", request)
            if self.wakes:
                self.apply(self.decide(self, self.now, True))
            return
        self.send(min(ready, key=lambda r: r.outstanding), request)

    def send(self, replica: Replica, request: Request) -> None:
        replica.outstanding += 1
        replica.requests[request.rid] = request
        admitted = replica.engine.submit(request.rid, request.tokens, request.output, self.now)
        self.admitted(replica, admitted)

    def admitted(self, replica: Replica, admitted: list[Admission]) -> None:
        for a in admitted:
            request = replica.requests[a.seq_id]
            self.at(a.first_token_at, "first_token", (replica, request))
            done = a.first_token_at + request.output / ENGINE.decode_tps
            self.at(done, "finish", (replica, request))

    def on_first_token(self, payload: tuple[Replica, Request]) -> None:
        replica, request = payload
        request.first_token = self.now
        replica.engine.prefilled(request.rid)
        self.ttfts[request.model].append((self.now, (self.now - request.arrival) * 1000))

    def on_finish(self, payload: tuple[Replica, Request]) -> None:
        replica, request = payload
        replica.outstanding -= 1
        del replica.requests[request.rid]
        output = [f"o{i}" for i in range(request.output)]
        self.admitted(replica, replica.engine.finish(request.rid, output, self.now))
        if replica.draining and replica.outstanding == 0 and replica.stopped_at is None:
            replica.stopped_at = self.now

    def on_hold_timeout(self, request: Request) -> None:
        held = self.held[request.model]
        if request in held:
            held.remove(request)
            request.failed = True

    def on_ready(self, replica: Replica) -> None:
        if replica.stopped_at is not None:
            return
        replica.ready = True
        held = self.held[self.model_of(replica)]
        while held:
            self.send(replica, held.popleft())

    def model_of(self, replica: Replica) -> str:
        return replica.name.split("/")[0]

    # -- the control plane ---------------------------------------------------

    def on_cycle(self, _: object) -> None:
        self.apply(self.decide(self, self.now, False))
        self.cycle_at = self.now
        self.at(self.now + CYCLE_S, "cycle", None)

    def on_drain_timeout(self, replica: Replica) -> None:
        if replica.stopped_at is None:
            replica.stopped_at = self.now

    def active(self, model: str) -> list[Replica]:
        return [r for r in self.replicas[model] if not r.draining and r.stopped_at is None]

    def apply(self, counts: dict[str, int]) -> None:
        for model, count in counts.items():
            self.scale(model, count)

    def scale(self, model: str, count: int, start_s: float | None = None) -> None:
        active = self.active(model)
        start = self.w.start_s if start_s is None else start_s
        for _ in range(count - len(active)):
            name = f"{model}/{next(self.names)}"
            replica = Replica(name, self.now, self.now + start, Scheduler(ENGINE))
            self.replicas[model].append(replica)
            self.at(replica.ready_at, "ready", replica)
        # Fewer: a starting one first (it serves nobody), then the least busy.
        surplus = len(active) - count
        for replica in sorted(active, key=lambda r: (r.ready, r.outstanding))[: max(surplus, 0)]:
            replica.draining = True
            if not replica.ready or replica.outstanding == 0:
                replica.stopped_at = self.now
            else:
                self.at(self.now + DRAIN_TIMEOUT_S, "drain_timeout", replica)

    # -- what routers would report -------------------------------------------

    def load(self, model: str) -> ModelLoad:
        ready = [r for r in self.replicas[model] if r.ready and r.stopped_at is None]
        in_flight = sum(r.outstanding for r in ready)
        recent = [ms for at, ms in self.ttfts[model][-2000:] if at >= self.cycle_at]
        p90 = sorted(recent)[math.ceil(0.9 * len(recent)) - 1] if recent else None
        serving = [r for r in ready if not r.draining]
        kv = sum(r.engine.kv_usage for r in serving) / len(serving) if serving else None
        return ModelLoad(in_flight, len(self.held[model]), p90, kv, self.last_arrival[model])


# -- the policies ---------------------------------------------------------------


def llmgw(specs: dict[str, Autoscale]) -> tuple[Decide, dict[str, int]]:
    entries = tuple(
        ModelEntry(name=m, profile=Profile(engine="vllm", model=m), autoscale=s)
        for m, s in specs.items()
    )
    scaling = Scaling()
    scaling.follow(Catalog(models=entries))
    initial = {m: max(s.min, 1) for m, s in specs.items()}

    def decide(sim: Sim, now: float, woken: bool) -> dict[str, int]:
        if woken:  # as control_shell.controlplane._wake_held
            for model in specs:
                if sim.held[model]:
                    scaling.wake(model, now, len(sim.held[model]))
            return scaling.counts()
        kept = {m: len(sim.active(m)) for m in specs}
        scaling.decide({m: sim.load(m) for m in specs}, kept, now)
        return scaling.counts()

    return decide, initial


def fixed(counts: dict[str, int]) -> tuple[Decide, dict[str, int]]:
    return (lambda sim, now, woken: dict(counts)), dict(counts)


def llmd(specs: dict[str, Autoscale]) -> tuple[Decide, dict[str, int]]:
    """llm-d's workload-variant autoscaler's saturation rule, one step a cycle."""
    kv_sat, queue_sat, kv_spare, queue_spare = 0.80, 5.0, 0.10, 3.0

    def decide(sim: Sim, now: float, woken: bool) -> dict[str, int]:
        out = {}
        for model, spec in specs.items():
            active = sim.active(model)
            ready = [r for r in active if r.ready]
            n = len(active)
            if not ready:
                out[model] = max(n, 1)
                continue
            kv = sum(r.engine.kv_usage for r in ready)
            queue = sum(r.engine.waiting for r in ready) + len(sim.held[model])
            spare_kv = kv_sat - kv / len(ready)
            spare_queue = queue_sat - queue / len(ready)
            if spare_kv < kv_spare or spare_queue < queue_spare:
                out[model] = min(n + 1, spec.max)
            elif n > 1 and len(ready) == n:
                # Simulate one fewer: the same load over n - 1.
                fewer_kv = kv_sat - kv / (n - 1)
                fewer_queue = queue_sat - queue / (n - 1)
                down = fewer_kv >= kv_spare and fewer_queue >= queue_spare
                out[model] = n - 1 if down else n
            else:
                out[model] = n
        return out

    return decide, {m: max(s.min, 1) for m, s in specs.items()}


# -- running and reporting ---------------------------------------------------------


def need(w: Workload, rate: Callable[[Workload, float], float], day_s: float, how: str) -> int:
    """Replicas a rate needs at the autoscaler's target (Little's law: in flight = rate x
    the time a request takes), at the peak's minute or the day's mean."""
    service_s = sum(w.output_tokens) / 2 / ENGINE.decode_tps + sum(w.prompt_tokens) / 2 / ENGINE.prefill_tps
    samples = [rate(w, t) for t in range(0, int(day_s), 10)]
    if how == "peak":
        minutes = [sum(samples[i : i + 6]) / 6 for i in range(0, len(samples), 6)]
        value = max(minutes)
    else:
        value = sum(samples) / len(samples)
    return max(1, math.ceil(value * service_s / SPECS["chat"].target_in_flight))


def summarize(sim: Sim, end: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in RATES:
        asked = [r for r in sim.requests if r.model == model]
        woke = [r for r in asked if r.woke]
        plain = [r for r in asked if not r.woke]
        done = [r for r in plain if r.first_token is not None]
        within = sum(1 for r in done if (r.first_token - r.arrival) * 1000 <= TTFT_OBJECTIVE_MS)  # type: ignore[operator]
        ttfts = sorted((r.first_token - r.arrival) * 1000 for r in done)  # type: ignore[operator]
        minutes = sum(((r.stopped_at or end) - r.asked_at) for r in sim.replicas[model]) / 60
        waits = sorted(
            r.first_token - r.arrival  # type: ignore[operator]
            for r in woke
            if r.first_after_zero and r.first_token is not None
        )
        out[model] = {
            "requests": len(asked),
            "within_objective": within / len(plain) if plain else 1.0,
            "ttft_p90_ms": ttfts[math.ceil(0.9 * len(ttfts)) - 1] if ttfts else None,
            "failed": sum(r.failed for r in asked),
            "unanswered": sum(1 for r in asked if r.first_token is None and not r.failed),
            "held_while_waking": len(woke),
            "wakes": len(waits),
            "first_wait_after_zero_s": waits[0] if waits else None,
            "max_wait_after_zero_s": waits[-1] if waits else None,
            "replica_minutes": minutes,
            "replicas_started": len(sim.replicas[model]),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a day of 24 one-minute hours")
    parser.add_argument("--hour-s", type=float, help="a compressed hour's length (default 300)")
    parser.add_argument("--start-s", type=float, default=30.0, help="an engine's start (s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    args = parser.parse_args()
    hour_s = args.hour_s or (60.0 if args.quick else 300.0)
    w = Workload(hour_s=hour_s, start_s=args.start_s, seed=args.seed)
    day_s = 24 * w.hour_s
    requests = trace(w, day_s)
    peak = {"chat": need(w, chat_rate, day_s, "peak"), "sleepy": 1}
    mean = {"chat": need(w, chat_rate, day_s, "mean"), "sleepy": 1}
    policies: dict[str, tuple[tuple[Decide, dict[str, int]], bool]] = {
        "llmgw autoscale": (llmgw(SPECS), True),
        f"fixed at peak ({peak['chat']}+{peak['sleepy']})": (fixed(peak), False),
        f"fixed at mean ({mean['chat']}+{mean['sleepy']})": (fixed(mean), False),
        "llm-d saturation rule": (llmd(SPECS), False),
    }
    results: dict[str, Any] = {}
    print(f"autoscale bench: {len(requests)} requests over {day_s / 3600:.2f} h of virtual time, "
          f"engine start {w.start_s:g} s, TTFT objective {TTFT_OBJECTIVE_MS:g} ms")
    for name, ((decide, initial), wakes) in policies.items():
        started = time.process_time()
        sim = Sim(w, requests, decide, wakes)
        sim.run(day_s, initial)
        results[name] = summarize(sim, day_s)
        results[name]["cpu_s"] = time.process_time() - started
    lines = ["| policy | model | requests | within objective | TTFT p90 ms | failed | "
             "replica-minutes | held while waking | first wait after zero |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for name, per_model in results.items():
        for model in RATES:
            r = per_model[model]
            wait = "-" if r["first_wait_after_zero_s"] is None else (
                f"{r['first_wait_after_zero_s']:.1f}-{r['max_wait_after_zero_s']:.1f} s "
                f"({r['wakes']} wakes)")
            p90 = "-" if r["ttft_p90_ms"] is None else f"{r['ttft_p90_ms']:.0f}"
            lines.append(
                f"| {name} | {model} | {r['requests']} | {100 * r['within_objective']:.3f}% | "
                f"{p90} | {r['failed']} | {r['replica_minutes']:.0f} | "
                f"{r['held_while_waking']} | {wait} |"
            )
    table = "\n".join(lines)
    print(table)
    auto = results["llmgw autoscale"]
    peak_name = next(n for n in results if n.startswith("fixed at peak"))
    mean_name = next(n for n in results if n.startswith("fixed at mean"))
    total = lambda res: sum(res[m]["replica_minutes"] for m in RATES)  # noqa: E731
    share = lambda res: min(res[m]["within_objective"] for m in RATES)  # noqa: E731
    ratio = total(auto) / total(results[peak_name])
    wake = auto["sleepy"]["max_wait_after_zero_s"]
    checks = [
        (share(auto) >= 0.99, f"autoscaling within the TTFT objective for >= 99% of requests: {100 * share(auto):.2f}%"),
        (ratio <= 0.70, f"autoscaling uses <= 70% of fixed peak's replica-minutes: {100 * ratio:.1f}%"),
        (share(results[mean_name]) < 0.99, f"fixed mean misses the objective: {100 * share(results[mean_name]):.2f}%"),
        (sum(auto[m]["failed"] for m in RATES) == 0, "no held request failed"),
        (wake is not None and wake <= w.start_s + 1.0,
         f"the first request's wait after zero is the start + at most 1 s: {wake} s (start {w.start_s:g} s)"),
    ]
    for ok, text in checks:
        print(("PASS " if ok else "FAIL ") + text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "autoscale.md").write_text(table + "\n\n" + "\n".join(("PASS " if ok else "FAIL ") + t for ok, t in checks) + "\n")
    (RESULTS_DIR / "autoscale.json").write_text(json.dumps(results, indent=2))
    return 1 if args.strict and not all(ok for ok, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
