#!/usr/bin/env python3
"""Routing benchmark: round_robin, least_outstanding, cache_aware and precise, side by side.

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/routing_bench.py            # about 24 minutes, no GPU
    .venv/bin/python bench/routing_bench.py --quick    # shorter runs, a rough look
    .venv/bin/python bench/routing_bench.py --help

It starts real processes on free loopback ports: 8 mock engines with their
scheduler model on (llmgw_mock_engine.scheduler: a paged prefix cache, a shared
prefill rate, a decode rate per sequence, a limit on running sequences with a FIFO
queue), each publishing vLLM's KV-cache events over ZMQ (`--kv-events-config`, an
events and a replay port of its own), and for every run a fresh router in front of
them with `[router] balancing` set to the policy measured; a `precise` router's
endpoints name each engine's `kv_events` and `kv_replay`. Before every run each
engine's cache and records are emptied (POST /mock/reset), so each policy starts
cold; before a `precise` run the engines are started afresh instead, so that the
router's replay from 0 finds only that run's history, as the reset leaves the
engine's replay buffer (its last 10,000 steps) as it was. Each policy gets the same
seeded arrival schedule, the same requests at the same moments. The engines sleep for
their costs, so the benchmark needs little CPU.

Seven workloads:

1. multi-turn sessions, in the shape of llm-d's prefix-routing benchmark scaled to
   this machine: many sessions, each with a private context of thousands of tokens
   (all of them together several times one engine's cache, though half of all the
   engines' caches together), and follow-up turns that carry the whole conversation
   so far; Poisson arrivals at several rates, up to beyond least_outstanding's
   saturation, each stage of a fixed length. As in llm-d's benchmark the stages run
   one after another, lowest rate first, on the same engines and router, so the
   caches (and the conversations) carry over; each stage's figures are its own
   requests';
2. one hot prefix: every request starts with the same long system prompt, one
   request at a time and at Poisson rates; no engine may take more than 1.5x the
   even share;
3. no reuse: random prompts, where the cache cannot help; cache_aware should stay
   within 5% of least_outstanding;
4. private contexts: multi-turn conversations whose contexts together are several
   times all the engines' caches: a fixed number of conversations is open at any time
   (more than all the caches hold), a turn goes to an open one drawn at random, and a
   conversation closes after a few turns and a new one opens, so every engine evicts
   all along; no two conversations share a block, so a hit needs the conversation's
   own context still cached where it went, and no policy can raise that much: reported,
   no verdict;
5. evicting: llm-d's precise-routing workload ("KV-cache wins"), scaled at its own
   ratio: many teams, each with a long system prompt of its own, whose users hold short
   conversations on top; the teams' prompts are 0.73x all the engines' caches and
   several times one engine's, so a policy that spreads each team over the replicas
   asks each cache to hold several times what it can, and with the conversations on
   top every policy's engines evict (their own eviction counts are reported); the
   issue's checks read this one;
6. two-routers: the evicting workload's stages with two router processes of the same
   policy and config, the requests sent to them alternately (request i to router
   i mod 2), so each sees every other turn of every user; run up to the rate of the
   evicting workload's first check (below), or all its rates;
7. restart: the evicting workload's stages on one router listening on a fixed port,
   stopped (SIGTERM, 1 s grace) a quarter into the stage at that rate and a new one
   started on the same port; the load generator keeps sending meanwhile: requests
   sent while no router listened, and those cut in flight, are counted apart.

Every figure comes from the engines' own reports (GET /mock/stats): time to first
token (TTFT) as the engine measured it, from the request's arrival to its first
token, so the load generator sharing the CPUs does not blur it (the time a router
spends before the engine sees the request, a `precise` router's /tokenize call
included, is reported apart as "router-added": the client's mean latency less the
engines' mean time per request); prefix-cache hit rate = cached prompt tokens /
prompt tokens (vLLM's vllm:prefix_cache_hits / vllm:prefix_cache_queries); output
tokens/s = output tokens of all the run's answers / (last answer's end - the run's
start); each engine's share of the requests; its evictions. The router's CPU per
routed request is its process's CPU time (user + system, /proc) over the stage
divided by the requests the engines saw, background work (health checks, /metrics
reads, the KV-event threads) included: for `precise` it includes decoding and
indexing the events and the router's side of the /tokenize calls, but not the
engines' side (the engine tokenizes). `precise`'s predictions (the access log's
`cached_predicted`) are compared with the cached tokens each engine reported in the
answer's usage, by request id. 503s (and any other failure) are counted by the
client.

The results are printed as markdown tables and written to bench/results/routing.md
and routing.json (git-ignored), followed by the issue's done-when checks as PASS /
FAIL lines. Process logs go to bench/results/routing-logs/ (with --profile, each
router's cProfile output too). The exit status is 0 when the benchmark ran, whatever
the checks (--strict: 1 when a check FAILs), and 2 when it could not run. A policy
the router does not know yet is reported as unavailable, and the checks that need it
FAIL.
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
import socket
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
POLICIES = ("round_robin", "least_outstanding", "cache_aware", "precise")
WORKLOADS = (
    "multi-turn", "hot-prefix", "no-reuse", "private-contexts", "evicting", "two-routers", "restart",
)  # fmt: skip
REPLICAS = 8
SHUTDOWN_GRACE_S = 1


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


@dataclass(frozen=True)
class PrivateContexts:
    """Conversations each with a long context of its own, together several times all the
    engines' caches: no request shares a block with another conversation's."""

    open_conversations: int = 192  # open at any time: about 1.9x all the caches
    turns: int = 4  # a conversation closes after this many turns; a new one opens
    context_words: tuple[int, int] = (2000, 4000)
    question_words: int = 40
    answer_tokens: int = 48
    rates: tuple[float, ...] = (4.0, 16.0, 32.0, 48.0)
    duration_s: float = 6.0


@dataclass(frozen=True)
class Teams:
    """The evicting workload (and the two-routers and restart ones): llm-d's
    precise-routing workload (its "KV-cache wins" benchmark: customers, each with a long
    system prompt of its own, whose users hold short conversations on top), scaled to
    these engines at llm-d's own ratio: the teams' prompts are 0.73x all the caches
    together and 5.9x one engine's, so a policy that spreads each team over the replicas
    asks each cache to hold several times what it can, and the users' conversations on
    top make every policy's engines evict. `--teams` sets another count (48: 0.47x all
    the caches; 120: 1.17x, where precise needs 58% of prompt tokens cached at 64 req/s
    to keep up)."""

    teams: int = 75  # 225,000 tokens of prompts: 0.73x all the caches, 5.9x one engine's
    system_words: int = 3000  # each team's own system prompt
    users_per_team: int = 5
    turns: int = 4  # a user's conversation starts afresh after this many turns
    # Drawn for each question: fixed-size questions made every request's uncached part
    # one of a few sizes, so TTFT a staircase of 8 ms steps and any percentile jumped a
    # whole step when a share moved a point (precise's p90: 14, 22 or 30 ms by run).
    question_words: tuple[int, int] = (10, 70)
    answer_tokens: int = 48
    rates: tuple[float, ...] = (8.0, 24.0, 48.0, 64.0)
    duration_s: float = 6.0
    # The top rate's stage, where the checks read precise's TTFT p90: longer, because
    # about a tenth of precise's requests there had their conversation's blocks evicted
    # (TTFT 20-30 ms against 6-14 for the rest), so its p90 sits near that step.
    top_duration_s: float = 18.0
    # Before it, this long at the same rate, unreported: the caches reach that rate's
    # steady state. Without it the share of requests whose conversation was evicted
    # rose from 1-5% in the stage's first 3 s to 11-15% from its ninth on, so the whole
    # stage's share, 8-12%, put the p90 on either side of the step from run to run.
    top_lead_s: float = 6.0


class BenchError(Exception):
    """The benchmark could not run (a process died, a port never opened, ...)."""


# --------------------------------------------------------------------------- processes


STARTED: list[Proc] = []
_control: httpx.Client | None = None


def control() -> httpx.Client:
    """One client for the bench's own calls (stats, resets, metrics): httpx.get builds a
    client and reads the CA bundle each time, about 0.2 s of CPU on this machine."""
    global _control
    if _control is None:
        _control = httpx.Client(timeout=10)
    return _control


def _ports() -> range:
    """Ports above the kernel's ephemeral range, which no outgoing connection takes
    between the check here and the engine's own bind (the bench makes thousands: a port
    the kernel handed out was seen taken by then); the kernel's range where none is left."""
    try:
        top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        top = 60999
    return range(top + 1, 65536) if top < 65000 else range(0)


PORTS = _ports()
_next_port = os.getpid()


def free_port() -> int:
    """A loopback port nothing listens on now."""
    global _next_port
    for _ in range(len(PORTS)):
        port = PORTS[_next_port % len(PORTS)]
        _next_port += 1
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        self.started = time.monotonic()
        self.popen = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        self.url = ""
        self.kv_events = ""  # an engine's KV-event addresses, as a router connects to them
        self.ports = (0, 0, 0)  # an engine's HTTP, events and replay ports
        self.kv_replay = ""
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
        """User + system CPU of the process (its threads included), 0 once it is gone."""
        try:
            text = Path(f"/proc/{self.popen.pid}/stat").read_text()
        except OSError:
            return 0.0
        fields = text[text.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run_ns(self) -> int:
        """The run time of the process's live threads (ns, /proc/PID/task/*/schedstat)."""
        total = 0
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.popen.pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[0])
        return total

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


def start_engines(params: EngineParams, ports: list[tuple[int, int, int]] | None = None) -> list[Proc]:
    """The engines, each on its (HTTP, events, replay) ports: `ports`, or fresh ones. A
    restarted engine keeps its ports, so its URL, and with it its rendezvous rank in
    cache_aware's placement of new conversations (`Replica.rid` hashes the URL), stays."""
    ports = ports or [(free_port(), free_port(), free_port()) for _ in range(REPLICAS)]
    engines = [start_engine(params, i, p) for i, p in enumerate(ports)]
    for i, engine in enumerate(engines):
        for attempt in range(3):
            try:
                engine.wait_url()
                break
            except BenchError:
                if attempt == 2 or "Address already in use" not in engine.log_tail(50):
                    raise
            engine.stop()  # a port taken since it was chosen: others
            engine = engines[i] = start_engine(params, i, (free_port(), free_port(), free_port()))
    return engines


def start_engine(params: EngineParams, i: int, ports: tuple[int, int, int]) -> Proc:
    """Engine i, publishing its KV-cache events on two ports of its own."""
    http, events, replay = ports
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",  # a wildcard: the engine binds
        "replay_endpoint": f"tcp://*:{replay}",
    }
    engine = Proc(
        f"engine-{i}",
        [sys.executable, "-m", "llmgw_mock_engine", "serve", MODEL, "--host", "127.0.0.1",
         "--port", str(http), *params.argv(), "--kv-events-config", json.dumps(config)],
        r"mock engine serving .* on (http://127\.0\.0\.1:\d+)",
    )  # fmt: skip
    engine.ports = ports
    engine.kv_events = f"tcp://127.0.0.1:{events}"
    engine.kv_replay = f"tcp://127.0.0.1:{replay}"
    return engine


class Fleet:
    """The engines, emptied before each run: reset, or started afresh for `precise`."""

    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.engines = start_engines(params)

    def prepare(self, policy: str) -> None:
        if policy != "precise":
            reset_engines(self.engines)
            return
        # A reset leaves the replay buffer as it was (the engine's last 10,000 steps, every
        # earlier run's): a precise router's replay from 0 would read all of it.
        for engine in self.engines:
            engine.stop()
        self.engines = start_engines(self.params, [e.ports for e in self.engines])


def router_config(policy: str | None, engines: list[Proc], run: str, listen: str) -> Path:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    config = LOG_DIR / f"router-{run}.toml"
    if policy == "precise":
        endpoints = ", ".join(
            f'{{ url = "{e.url}", kv_events = "{e.kv_events}", kv_replay = "{e.kv_replay}" }}'
            for e in engines
        )
    else:
        endpoints = ", ".join(f'"{e.url}"' for e in engines)
    router = "" if policy is None else f'\n[router]\nbalancing = "{policy}"\n'
    config.write_text(
        "# written by bench/routing_bench.py\n"
        f'[server]\nlisten = "{listen}"\nshutdown_grace_s = {SHUTDOWN_GRACE_S}\n'
        f'{router}\n[[models]]\nname = "{MODEL}"\nendpoints = [{endpoints}]\n'
    )
    return config


PROFILE = False  # --profile: each router runs under cProfile


def start_router(
    policy: str | None, engines: list[Proc], run: str, listen: str = "127.0.0.1:0",
    name: str | None = None,
) -> Proc:  # fmt: skip
    """A router in front of the engines; `policy` None: the router's own default, with
    no `balancing` key (a router from before the key balances by least outstanding)."""
    config = router_config(policy, engines, run, listen)
    name = name or f"router-{run}"
    python = [sys.executable]
    if PROFILE:
        python += ["-m", "cProfile", "-o", str(LOG_DIR / f"{name}.prof")]
    proc = Proc(
        name,
        [*python, "-m", "llmgw_server", "--config", str(config)],
        r"listening on (http://127\.0\.0\.1:\d+)",
    )
    proc.wait_url()
    deadline = time.monotonic() + 15
    while True:  # ready once the first health round found every engine
        try:
            ready = control().get(proc.url + "/readyz", timeout=2)
            if ready.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.popen.poll() is not None:
            proc.stop()
            raise BenchError(f"the router ({policy}) never became ready:\n{proc.log_tail()}")
        time.sleep(0.05)


def settle(procs: list[Proc], window_s: float = 0.5, timeout_s: float = 60.0) -> float:
    """Wait until the processes' CPU stops rising (imports, the first health round, a
    precise router's replay); returns their idle CPU rate (CPU s per s) over the next
    second, read from the threads' run times (ns; /proc's ticks are 10 ms)."""
    deadline = time.monotonic() + timeout_s
    last, at = sum(p.cpu_s() for p in procs), time.monotonic()
    while True:
        time.sleep(window_s)
        cpu, now = sum(p.cpu_s() for p in procs), time.monotonic()
        if (cpu - last) / (now - at) < 0.05 * len(procs) or now > deadline:
            break
        last, at = cpu, now
    last, at = sum(p.run_ns() for p in procs), time.monotonic()
    time.sleep(1.0)
    return (sum(p.run_ns() for p in procs) - last) / 1e9 / (time.monotonic() - at)


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
            answer = control().post(engine.url + "/mock/reset", timeout=5)
            if answer.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{engine.name} never became idle for a reset: {answer.text}")
            time.sleep(0.1)


_METRIC = re.compile(r"^(llmgw_balancing_decisions_total|llmgw_prefix_index_entries)\{([^}]*)\} (\S+)$", re.M)


def router_metrics(router: Proc) -> tuple[Counter[str], dict[str, float]]:
    """The router's balancing decisions so far, by kind, and its index entries by endpoint
    (empty when it cannot be read)."""
    decisions: Counter[str] = Counter()
    entries: dict[str, float] = {}
    try:
        text = control().get(router.url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return decisions, entries
    for name, labels, value in _METRIC.findall(text):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if named.get("model") != MODEL:
            continue
        if name == "llmgw_balancing_decisions_total":
            decisions[named.get("kind", "?")] += int(float(value))
        else:
            entries[named.get("endpoint", "?")] = float(value)
    return decisions, entries


_ACCESS = re.compile(r"request_id=(\S+) .*? cached_predicted=(\S+)")


def predictions(routers: list[Proc]) -> dict[str, int]:
    """cached_predicted by request id, from the routers' access logs (stderr)."""
    out: dict[str, int] = {}
    for router in routers:
        try:
            text = router.log_path.read_text(errors="replace")
        except OSError:
            continue
        for rid, predicted in _ACCESS.findall(text):
            if predicted != "-":
                out[rid] = int(predicted)
    return out


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
    lead: bool = False  # a lead-in to the next stage at its rate: run, not reported

    @property
    def label(self) -> str:
        rate = "serial" if self.rate is None else f"{self.rate:g}"
        return f"{rate} lead" if self.lead else rate


@dataclass
class Plan:
    workload: str
    stages: list[Stage]
    # Warm: the stages run one after another on the same engines and router, whose caches
    # carry over, as in llm-d's benchmark; cold: each stage starts from empty caches.
    warm: bool
    routers: int = 1  # router processes, the requests alternating between them
    restart_at: str | None = None  # the stage during which the router is restarted


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


def private_context_stages(w: PrivateContexts, seed: int) -> tuple[list[Stage], int]:
    """Poisson arrivals at each rate in turn, each the next turn of one of the open
    conversations drawn at random; a conversation closes after `w.turns` turns and a new
    one takes its place. Returns the stages and how many conversations they opened."""
    opened = 0

    def fresh() -> tuple[int, int, list[dict[str, str]]]:
        nonlocal opened
        c, opened = opened, opened + 1
        rng = random.Random(f"{seed}-evicting-context-{c}")
        context = f"Conversation {c} documents: " + _text(rng, rng.randint(*w.context_words))
        return c, 0, [{"role": "system", "content": context}]

    open_ = [fresh() for _ in range(w.open_conversations)]
    stages = []
    for rate in w.rates:
        rng = random.Random(f"{seed}-evicting-{rate}")
        arrivals = []
        for at in poisson_times(rate, w.duration_s, rng):
            slot = rng.randrange(len(open_))
            c, turns, history = open_[slot]
            messages = [*history, {"role": "user", "content": _text(rng, w.question_words)}]
            body = {"model": MODEL, "messages": messages, "max_tokens": w.answer_tokens}
            answer = answer_text(body, w.answer_tokens)
            if turns + 1 >= w.turns:
                open_[slot] = fresh()
            else:
                open_[slot] = (c, turns + 1, [*messages, {"role": "assistant", "content": answer}])
            arrivals.append(Arrival(at, body, f"conversation-{c}"))
        stages.append(Stage(rate, arrivals))
    return stages, opened


def teams_stages(w: Teams, seed: int) -> list[Stage]:
    """Poisson arrivals at each rate in turn, each the next turn of a user drawn at random
    (a team, then one of its users): the team's system prompt, then the user's conversation
    so far; after `w.turns` turns the user starts a new conversation."""
    systems = [
        {"role": "system", "content": f"Team {t} handbook: "
         + _text(random.Random(f"{seed}-team-{t}"), w.system_words)}
        for t in range(w.teams)
    ]  # fmt: skip
    users: dict[tuple[int, int], tuple[int, list[dict[str, str]]]] = {}
    stages = []
    plan = [(rate, False, w.duration_s) for rate in w.rates[:-1]]
    if w.top_lead_s > 0:
        plan.append((w.rates[-1], True, w.top_lead_s))
    plan.append((w.rates[-1], False, w.top_duration_s))
    for rate, lead, duration in plan:
        rng = random.Random(f"{seed}-teams-{rate}{'-lead' if lead else ''}")
        arrivals = []
        for at in poisson_times(rate, duration, rng):
            user = rng.randrange(w.teams), rng.randrange(w.users_per_team)
            turns, history = users.get(user, (0, [systems[user[0]]]))
            question = _text(rng, rng.randint(*w.question_words))
            messages = [*history, {"role": "user", "content": question}]
            body = {"model": MODEL, "messages": messages, "max_tokens": w.answer_tokens}
            answer = answer_text(body, w.answer_tokens)
            if turns + 1 >= w.turns:
                users[user] = (0, [systems[user[0]]])
            else:
                users[user] = (turns + 1, [*messages, {"role": "assistant", "content": answer}])
            arrivals.append(Arrival(at, body, f"team-{user[0]}-user-{user[1]}"))
        stages.append(Stage(rate, arrivals, lead))
    return stages


# --------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    workload: str
    rate: str  # "serial" or requests per second
    policy: str
    requests: int = 0
    routers: int = 1
    statuses: dict[str, int] = field(default_factory=dict)  # client-side, by status or error
    ttft_p50_s: float = math.nan
    ttft_p90_s: float = math.nan
    output_tps: float = math.nan
    hit_rate: float = math.nan
    shares: list[float] = field(default_factory=list)  # each engine's share of requests
    routed: int = 0  # requests the engines saw
    evictions: int = 0  # blocks the engines evicted during the stage
    wall_s: float = 0.0
    cpu_s: float = 0.0  # router(s) + engines during the run
    router_cpu_s: float = 0.0  # the router process(es) alone
    router_idle_cpu: float = math.nan  # CPU s per s of the router(s), idle, before the run
    engine_cpu_s: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0  # this process, sending the requests
    router_added_s: float = math.nan  # the client's mean latency - the engines' mean time
    decisions: dict[str, int] = field(default_factory=dict)  # the routers' balancing decisions
    predicted: int = 0  # requests with a cached_predicted and a cached_tokens to compare
    predicted_exact: int = 0  # ... where they are equal
    predicted_over: int = 0  # ... where the router predicted more than the engine found
    gap_failures: int = 0  # restart: sent while no router listened
    cut_failures: int = 0  # restart: in flight when the router was stopped
    restart: dict[str, Any] = field(default_factory=dict)
    # Each engine record: [arrival - run start (s), TTFT (s, -1 if none), prompt, cached].
    records: list[list[float]] = field(default_factory=list)
    unavailable: str = ""

    @property
    def status_503(self) -> int:
        return self.statuses.get("503", 0)

    @property
    def failures(self) -> int:
        return sum(n for k, n in self.statuses.items() if k != "200")

    @property
    def other_failures(self) -> int:
        return self.failures - self.status_503 - self.gap_failures - self.cut_failures

    @property
    def max_share(self) -> float:
        return max(self.shares) if self.shares else math.nan

    @property
    def router_cpu_ms(self) -> float:
        """The router's CPU per routed request, background included (ms)."""
        return self.router_cpu_s / self.routed * 1000 if self.routed else math.nan


@dataclass
class Sent:
    at: float  # time.monotonic() when sent
    outcome: str = ""  # the status, or the httpx error's name
    took_s: float = 0.0
    request_id: str = ""
    cached: int | None = None  # usage.prompt_tokens_details.cached_tokens


async def send_all(
    urls: list[str],
    arrivals: list[Arrival],
    serial: bool,
    session_header: bool,
    tag: str,
    restart: tuple[float, Any] | None = None,
) -> tuple[float, list[Sent]]:
    """Send the schedule, request i to urls[i mod len(urls)], each with its own
    x-request-id; `restart`: (seconds from the start, a blocking call run in a thread
    then). Returns the run's start (time.monotonic) and what each request got."""
    sent: list[Sent] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(i: int, arrival: Arrival) -> None:
            record = Sent(time.monotonic(), request_id=f"{tag}-{i}")
            headers = {"x-request-id": record.request_id}
            if session_header and arrival.session:
                headers["x-session-id"] = arrival.session
            try:
                url = urls[i % len(urls)] + "/v1/chat/completions"
                answer = await client.post(url, json=arrival.body, headers=headers)
                record.outcome = str(answer.status_code)
                if answer.status_code == 200:
                    details = (answer.json().get("usage") or {}).get("prompt_tokens_details")
                    record.cached = (details or {}).get("cached_tokens")
            except httpx.HTTPError as exc:
                record.outcome = type(exc).__name__
            record.took_s = time.monotonic() - record.at
            sent.append(record)

        start_wall = time.monotonic()
        start = trio.current_time()

        async def restarting(at_s: float, call: Any) -> None:
            await trio.sleep_until(start + at_s)
            await trio.to_thread.run_sync(call)

        async with trio.open_nursery() as nursery:
            if restart is not None:
                nursery.start_soon(restarting, *restart)
            if serial:
                for i, arrival in enumerate(arrivals):
                    await one(i, arrival)
            else:
                for i, arrival in enumerate(arrivals):
                    await trio.sleep_until(start + arrival.at_s)
                    nursery.start_soon(one, i, arrival)
    return start_wall, sent


def engine_stats(engines: list[Proc]) -> list[dict[str, Any]]:
    return [control().get(e.url + "/mock/stats", timeout=10).json() for e in engines]


def engine_figures(
    result: RunResult,
    stats: list[dict[str, Any]],
    start_wall: float,
    before: list[dict[str, Any]],
    sent: list[Sent],
) -> None:
    """The stage's figures from the engines' reports: the requests that arrived since
    `start_wall`, and the counters' growth since `before`."""
    mine = [[r for r in s["requests"] if r["arrival"] >= start_wall] for s in stats]
    records = [r for rs in mine for r in rs]
    counts = [len(rs) for rs in mine]
    total = result.routed = sum(counts)
    result.shares = [c / total for c in counts] if total else []
    result.records = [
        [round(r["arrival"] - start_wall, 4), -1.0 if r["ttft_s"] is None else round(r["ttft_s"], 4),
         r["prompt_tokens"], r["cached_tokens"]]
        for r in records
    ]  # fmt: skip
    ttfts = sorted(r["ttft_s"] for r in records if r["ttft_s"] is not None)
    if ttfts:
        result.ttft_p50_s = percentile(ttfts, 0.50)
        result.ttft_p90_s = percentile(ttfts, 0.90)
    done = [r for r in records if r["completed"]]
    if done:
        span = max(r["end"] for r in done) - start_wall
        result.output_tps = sum(r["output_tokens"] for r in done) / span
        answered = [s.took_s for s in sent if s.outcome == "200"]
        if answered:
            engine_mean = sum(r["end"] - r["arrival"] for r in done) / len(done)
            result.router_added_s = sum(answered) / len(answered) - engine_mean
    grown = {
        k: sum(s[k] for s in stats) - sum(s[k] for s in before)
        for k in ("prefix_cache_queries", "prefix_cache_hits", "evictions")
    }
    if grown["prefix_cache_queries"]:
        result.hit_rate = grown["prefix_cache_hits"] / grown["prefix_cache_queries"]
    result.evictions = grown["evictions"]


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


def window(records: list[list[float]], since_s: float) -> dict[str, float]:
    """TTFT p90 and hit rate of the engine records that arrived `since_s` after the run's
    start or later."""
    rows = [r for r in records if r[0] >= since_s]
    ttfts = sorted(r[1] for r in rows if r[1] >= 0)
    prompt = sum(r[2] for r in rows)
    return {
        "n": len(rows),
        "ttft_p90_s": percentile(ttfts, 0.90),
        "hit_rate": sum(r[3] for r in rows) / prompt if prompt else math.nan,
    }


def run_stage(
    workload: str,
    policy: str,
    stage: Stage,
    routers: list[Proc],
    engines: list[Proc],
    session_header: bool,
    restart: Any = None,
) -> tuple[RunResult, list[Sent], list[Proc]]:
    """One stage through `routers` (the requests alternate between them); `restart`: a
    callable that restarts routers[0] a quarter into the stage and returns what it
    measured (see run_plan). Returns the figures, what each request got, and the
    routers live at its end."""
    result = RunResult(workload, stage.label, policy, requests=len(stage.arrivals), routers=len(routers))
    before = engine_stats(engines)
    router_cpu = [r.cpu_s() for r in routers]
    engine_cpu = [e.cpu_s() for e in engines]
    decisions = [router_metrics(r)[0] for r in routers]
    client_before = time.process_time()
    began = time.monotonic()
    info: dict[str, Any] = {}
    plan = None
    if restart is not None:
        # A quarter in: a new router takes 1-3 s to start here; most of the stage follows.
        at = stage.arrivals[len(stage.arrivals) // 4].at_s if stage.arrivals else 0.0
        plan = (at, lambda: info.update(restart(routers[0])))
    tag = f"{workload}-{stage.label}-{policy}-{int(began * 1000) % 10**8}"
    start_wall, sent = trio.run(
        send_all, [r.url for r in routers], stage.arrivals, stage.rate is None, session_header,
        tag, plan,
    )  # fmt: skip
    result.wall_s = time.monotonic() - began
    live = list(routers)
    if info:
        live[0] = info["new"]
    stats = engine_stats(engines)
    end_decisions = [router_metrics(r)[0] for r in live]
    result.engine_cpu_s = [e.cpu_s() - c for e, c in zip(engines, engine_cpu, strict=True)]
    if info:
        # The old router's CPU and decisions up to its stop, the new one's since it was
        # ready (its start-up, imports and the first replay, is reported apart).
        old_cpu = info["old_cpu"] - router_cpu[0]
        new_cpu = live[0].cpu_s() - info["new_start_cpu"]
        result.router_cpu_s = old_cpu + new_cpu + sum(
            r.cpu_s() - c for r, c in zip(live[1:], router_cpu[1:], strict=True)
        )
        end_decisions[0] = end_decisions[0] + (info["old_decisions"] - decisions[0])
        decisions[0] = Counter()
        stopped, ready = info["stopped_at"], info["ready_at"]
        result.gap_failures, result.cut_failures = restart_failures(sent, stopped, ready)
        result.restart = {
            "stopped_s": round(stopped - start_wall, 3),
            "ready_s": round(ready - start_wall, 3),
            "down_s": round(ready - stopped, 3),
            "start_cpu_s": round(info["new_start_cpu"], 3),
            "fed_after_spawn_s": None if "fed_at" not in info else round(info["fed_at"] - info["spawned"], 3),
            "fed_after_ready_s": None if "fed_at" not in info else round(info["fed_at"] - ready, 3),
        }  # fmt: skip
    else:
        result.router_cpu_s = sum(r.cpu_s() - c for r, c in zip(live, router_cpu, strict=True))
    total: Counter[str] = Counter()
    for end, begin in zip(end_decisions, decisions, strict=True):
        total.update(end)
        total.subtract(begin)
    result.decisions = {k: v for k, v in sorted(total.items()) if v}
    result.cpu_s = result.router_cpu_s + sum(result.engine_cpu_s)
    result.client_cpu_s = time.process_time() - client_before
    result.statuses = dict(Counter(s.outcome for s in sent))
    engine_figures(result, stats, start_wall, before, sent)
    if info:
        result.restart["after"] = window(result.records, info["ready_at"] - start_wall)
        result.restart["start_wall"] = start_wall
    print("  " + row_text(result), flush=True)
    return result, sent, live


def restart_failures(sent: list[Sent], stopped: float, ready: float) -> tuple[int, int]:
    """Failures (neither 200 nor 503) of requests sent while no router was ready (from the
    old one's stop to the new one's readiness), and of those in flight at the stop."""
    gap = cut = 0
    for s in sent:
        if s.outcome in ("200", "503"):
            continue
        if stopped <= s.at <= ready:
            gap += 1
        elif s.at < stopped <= s.at + s.took_s:
            cut += 1
    return gap, cut


def restarter(policy: str, setting: str | None, engines: list[Proc], run: str) -> Any:
    """What restarts a router mid-stage: stop it, start a new one on the same port, and
    (precise) wait until its index holds every engine's blocks."""

    def restart(old: Proc) -> dict[str, Any]:
        info: dict[str, Any] = {"old_cpu": old.cpu_s(), "old_decisions": router_metrics(old)[0]}
        info["stopped_at"] = time.monotonic()
        old.stop()
        listen = old.url.removeprefix("http://")
        new = start_router(setting, engines, run, listen, name=f"router-{run}-restarted")
        info.update(new=new, spawned=new.started, ready_at=time.monotonic(), new_start_cpu=new.cpu_s())
        if policy == "precise":
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                entries = router_metrics(new)[1]
                if len(entries) >= len(engines) and all(v > 0 for v in entries.values()):
                    info["fed_at"] = time.monotonic()
                    break
                time.sleep(0.05)
        return info

    return restart


def fill_predictions(result: RunResult, sent: list[Sent], predicted: dict[str, int]) -> None:
    """Compare the router's cached_predicted with the engine's cached_tokens, per request."""
    after = result.restart.get("ready_s")
    start = result.restart.get("start_wall", 0.0)
    late = [0, 0]
    for s in sent:
        guess = predicted.get(s.request_id)
        if guess is None or s.cached is None:
            continue
        result.predicted += 1
        result.predicted_exact += guess == s.cached
        result.predicted_over += guess > s.cached
        if after is not None and s.at - start >= after:
            late[0] += 1
            late[1] += guess == s.cached
    if after is not None:
        result.restart["after"]["predicted"], result.restart["after"]["predicted_exact"] = late
    result.restart.pop("start_wall", None)


def run_plan(
    plan: Plan, policy: str, setting: str | None, fleet: Fleet, session_header: bool
) -> list[RunResult]:
    """Every stage of the plan under one policy: on one router (or two) and warm caches,
    or each stage on empty caches and a fresh router."""
    groups = [plan.stages] if plan.warm else [[stage] for stage in plan.stages]
    results = []
    for group in groups:
        fleet.prepare(policy)
        engines = fleet.engines
        name = f"{plan.workload}-{'warm' if plan.warm else group[0].label}-{policy}"
        listen = f"127.0.0.1:{free_port()}" if plan.restart_at else "127.0.0.1:0"
        routers: list[Proc] = []
        every: list[Proc] = []
        sent_by: list[tuple[RunResult, list[Sent]]] = []
        try:
            for i in range(plan.routers):
                routers.append(start_router(setting, engines, f"{name}-{i}" if plan.routers > 1 else name, listen))
            every += routers
            idle = settle(routers)
            for stage in group:
                restart = None
                if plan.restart_at == stage.label:
                    restart = restarter(policy, setting, engines, name)
                result, sent, routers = run_stage(
                    plan.workload, policy, stage, routers, engines, session_header, restart
                )
                result.router_idle_cpu = idle
                every += [r for r in routers if r not in every]
                if not stage.lead:
                    results.append(result)
                    sent_by.append((result, sent))
        finally:
            for router in every:
                router.stop()
        guesses = predictions(every)
        for result, sent in sent_by:
            fill_predictions(result, sent, guesses)
    return results


# --------------------------------------------------------------------------- report


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f}"


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def row_text(r: RunResult) -> str:
    if r.unavailable:
        return f"{r.workload:11} {r.rate:>6} {r.policy:17} unavailable: {r.unavailable}"
    restart = f"  restart: {r.gap_failures} failed while down, {r.cut_failures} cut" if r.restart else ""
    return (
        f"{r.workload:11} {r.rate:>6} {r.policy:17} n={r.requests:<4} "
        f"TTFT p50 {ms(r.ttft_p50_s):>7} ms p90 {ms(r.ttft_p90_s):>7} ms  "
        f"{r.output_tps:7.0f} tok/s  hits {r.hit_rate:6.1%}  evicted {r.evictions:6}  "
        f"router CPU {r.router_cpu_ms:5.2f} ms/req  max share {r.max_share:5.1%}  "
        f"503s {r.status_503}  other failures {r.other_failures}{restart}  "
        f"({r.wall_s:.1f} s; CPU s: router {r.router_cpu_s:.1f}, engines {sum(r.engine_cpu_s):.1f}, "
        f"client {r.client_cpu_s:.1f})"
    )


def ordered(results: list[RunResult], workload: str) -> list[RunResult]:
    rows = [r for r in results if r.workload == workload]
    rates = list(dict.fromkeys(r.rate for r in rows))
    return sorted(rows, key=lambda r: (rates.index(r.rate), POLICIES.index(r.policy)))


def table(results: list[RunResult], workload: str) -> list[str]:
    lines = [
        "| rate (req/s) | policy | requests | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s "
        "| prefix hit rate | evicted blocks | router CPU (ms/req) | max share (even 12.5%) "
        "| shares per engine | 503s | other failures |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|",
    ]
    for r in ordered(results, workload):
        if r.unavailable:
            lines.append(f"| {r.rate} | {r.policy} | unavailable: {r.unavailable} |||||||||||")
            continue
        shares = " ".join(f"{s:.0%}" for s in r.shares)
        lines.append(
            f"| {r.rate} | {r.policy} | {r.requests} | {ms(r.ttft_p50_s)} | {ms(r.ttft_p90_s)} "
            f"| {r.output_tps:,.0f} | {r.hit_rate:.1%} | {r.evictions:,} | {r.router_cpu_ms:.2f} "
            f"| {r.max_share:.1%} | {shares} | {r.status_503} | {r.other_failures} |"
        )
    return lines


def detail_table(results: list[RunResult], workload: str) -> list[str]:
    """How the routers decided, what precise predicted, and where the CPU went."""
    lines = [
        "| rate (req/s) | policy | decisions | precise: predicted = engine's cached "
        "| router-added latency (ms, mean) | router idle CPU (% of a core) "
        "| engine CPU s (engine-0 / mean of the others) |",
        "|---|---|---|--:|--:|--:|--:|",
    ]
    for r in ordered(results, workload):
        if r.unavailable:
            continue
        decisions = ", ".join(f"{k} {v}" for k, v in r.decisions.items()) or "-"
        predicted = (
            f"{r.predicted_exact}/{r.predicted} ({r.predicted_exact / r.predicted:.1%}; "
            f"over {r.predicted_over})" if r.predicted else "-"
        )  # fmt: skip
        others = r.engine_cpu_s[1:]
        engines = (
            f"{r.engine_cpu_s[0]:.1f} / {sum(others) / len(others):.1f}" if others else "-"
        )
        lines.append(
            f"| {r.rate} | {r.policy} | {decisions} | {predicted} | {ms(r.router_added_s)} "
            f"| {r.router_idle_cpu:.1%} | {engines} |"
        )
    return lines


def restart_table(results: list[RunResult]) -> list[str]:
    lines = [
        "| rate (req/s) | policy | failed while down / cut in flight / other "
        "| down (s) | new router's start CPU (s) | index fed (s after spawn) "
        "| after the restart: requests | TTFT p90 (ms), restarted / never restarted "
        "| hit rate, restarted / never restarted | predicted = engine's cached |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in ordered(results, "restart"):
        if r.unavailable or not r.restart:
            continue
        info, after = r.restart, r.restart["after"]
        same = find(results, "evicting", r.rate, r.policy)
        base = window(same.records, info["ready_s"]) if same else {"ttft_p90_s": math.nan, "hit_rate": math.nan}
        fed = "-" if info["fed_after_spawn_s"] is None else f"{info['fed_after_spawn_s']:.2f}"
        predicted = (
            f"{after['predicted_exact']}/{after['predicted']}" if after.get("predicted") else "-"
        )
        lines.append(
            f"| {r.rate} | {r.policy} | {r.gap_failures} / {r.cut_failures} / {r.other_failures} "
            f"| {info['down_s']:.2f} | {info['start_cpu_s']:.2f} | {fed} | {after['n']} "
            f"| {ms(after['ttft_p90_s'])} / {ms(base['ttft_p90_s'])} "
            f"| {after['hit_rate']:.1%} / {base['hit_rate']:.1%} | {predicted} |"
        )
    return lines


def find(results: list[RunResult], workload: str, rate: str, policy: str) -> RunResult | None:
    for r in results:
        if (r.workload, r.rate, r.policy) == (workload, rate, policy) and not r.unavailable:
            return r
    return None


def first_over(
    results: list[RunResult], workload: str, rates: list[str], policy: str
) -> tuple[RunResult | None, str | None]:
    """The policy's run at the lowest rate, and the first rate where its TTFT p90 passes
    5x that (None: never)."""
    base = find(results, workload, rates[0], policy)
    if base is None:
        return None, None
    for rate in rates[1:]:
        run = find(results, workload, rate, policy)
        if run is not None and run.ttft_p90_s > 5 * base.ttft_p90_s:
            return base, rate
    return base, None


def key_rates(results: list[RunResult], s: Settings) -> dict[str, str]:
    """The rate each workload's checks read: multi-turn, where least_outstanding first
    passes 5x its lowest-rate p90; private contexts and evicting, where cache_aware does
    (two-routers and restart, evicting's); the top rate where that never happens, and for
    the others."""
    mt = [f"{r:g}" for r in s.mt.rates]
    pc = [f"{r:g}" for r in s.pc.rates]
    tm = [f"{r:g}" for r in s.tm.rates]
    trigger = first_over(results, "evicting", tm, "cache_aware")[1]
    evicting = trigger or max(
        (r.rate for r in results if r.workload == "two-routers"), key=float, default=tm[-1]
    )
    return {
        "multi-turn": first_over(results, "multi-turn", mt, "least_outstanding")[1] or mt[-1],
        "hot-prefix": f"{s.hp.rates[-1]:g}",
        "no-reuse": f"{s.nr.rates[-1]:g}",
        "private-contexts": first_over(results, "private-contexts", pc, "cache_aware")[1] or pc[-1],
        "evicting": evicting,
        "two-routers": evicting,
        "restart": evicting,
    }


def summary_table(results: list[RunResult], s: Settings, workloads: list[str]) -> list[str]:
    rates = key_rates(results, s)
    lines = [
        "| workload at rate (req/s) | policy | TTFT p90 (ms) | output tok/s | prefix hit rate "
        "| router CPU (ms/req) |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for workload in WORKLOADS:
        if workload not in workloads:
            continue
        for policy in POLICIES:
            r = find(results, workload, rates[workload], policy)
            if r is None:
                continue
            lines.append(
                f"| {workload} at {r.rate} | {policy} | {ms(r.ttft_p90_s)} | {r.output_tps:,.0f} "
                f"| {r.hit_rate:.1%} | {r.router_cpu_ms:.2f} |"
            )
    return lines


def cpu_per_request(results: list[RunResult], policy: str, workloads: set[str]) -> tuple[float, float]:
    """The router's CPU per routed request over the single-router runs of `workloads`
    (ms), all of it and less its idle rate over the runs' time."""
    runs = [r for r in results if r.policy == policy and r.workload in workloads and not r.unavailable]
    routed = sum(r.routed for r in runs)
    if not routed:
        return math.nan, math.nan
    cpu = sum(r.router_cpu_s for r in runs)
    idle = sum(r.router_idle_cpu * r.wall_s for r in runs if not math.isnan(r.router_idle_cpu))
    return cpu / routed * 1000, (cpu - idle) / routed * 1000


SINGLE_ROUTER = {"multi-turn", "hot-prefix", "no-reuse", "private-contexts", "evicting"}


def checks(results: list[RunResult], s: Settings, workloads: list[str]) -> list[str]:
    """The issue's done-when checks, as PASS/FAIL lines (SKIP: the workload did not run)."""
    out = [f"SKIP  {w}: not run" for w in WORKLOADS if w not in workloads]

    def line(ok: bool, text: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    # Multi-turn: the first rate where least_outstanding's p90 passes 5x its lowest-rate p90.
    rates = [f"{r:g}" for r in s.mt.rates]
    base, trigger = first_over(results, "multi-turn", rates, "least_outstanding")
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
    for policy in ("cache_aware", "precise"):
        runs = [r for r in results if r.policy == policy and not r.unavailable]
        if not runs:
            line(False, f"no 503s: {policy} unavailable")
            continue
        line(all(r.status_503 == 0 for r in runs),
             f"no 503s with {policy} in any run ({sum(r.status_503 for r in runs)}); other "
             f"failures {sum(r.other_failures for r in runs)} (and in the restarts, "
             f"{sum(r.gap_failures for r in runs)} sent while no router listened, "
             f"{sum(r.cut_failures for r in runs)} cut in flight)")  # fmt: skip
    even = 1 / REPLICAS
    for rate in ["serial", *(f"{r:g}" for r in s.hp.rates)] if "hot-prefix" in workloads else []:
        for policy in ("cache_aware", "precise"):
            run = find(results, "hot-prefix", rate, policy)
            if run is None:
                line(False, f"hot prefix at {rate}: {policy} unavailable")
                continue
            line(run.max_share <= 1.5 * even,
                 f"hot prefix at {rate}{'' if rate == 'serial' else ' req/s'}: {policy}'s busiest "
                 f"engine took {run.max_share:.1%} of the requests, within 1.5x the even share "
                 f"({1.5 * even:.2%})")  # fmt: skip
    for rate in [f"{r:g}" for r in s.nr.rates] if "no-reuse" in workloads else []:
        ca = find(results, "no-reuse", rate, "cache_aware")
        lo = find(results, "no-reuse", rate, "least_outstanding")
        if ca is None or lo is None:
            line(False, f"no reuse at {rate} req/s: cache_aware or least_outstanding unavailable")
            continue
        line(ca.ttft_p90_s <= 1.05 * lo.ttft_p90_s and ca.output_tps >= 0.95 * lo.output_tps,
             f"no reuse at {rate} req/s: cache_aware TTFT p90 {ms(ca.ttft_p90_s)} ms vs "
             f"{ms(lo.ttft_p90_s)} ms, {ca.output_tps:,.0f} vs {lo.output_tps:,.0f} output tok/s "
             f"(within 5%)")  # fmt: skip
    out += precise_checks(results, s, workloads)
    if "private-contexts" in workloads:
        out.append(private_contexts_note(results, s))
    return out


def private_contexts_note(results: list[RunResult], s: Settings) -> str:
    """Where no policy can win much: every conversation's context is its own, so a hit
    needs its context still cached where it went, and the caches hold about half of
    what is open. The TTFT p90s of every policy at the rate cache_aware passes 5x its
    lowest-rate p90, side by side (no verdict: the issue's checks read the evicting
    workload, whose prompts are shared)."""
    rate = key_rates(results, s)["private-contexts"]
    runs = {p: find(results, "private-contexts", rate, p) for p in POLICIES}
    p90 = {p: r.ttft_p90_s for p, r in runs.items() if r is not None}
    if not p90:
        return "NOTE  private contexts: no policy ran"
    ca, pr = runs["cache_aware"], runs["precise"]
    versus = ""
    if ca is not None and pr is not None:
        versus = (f"; precise against cache_aware {ratio(ca.ttft_p90_s, pr.ttft_p90_s):.2f}x "
                  f"lower, {ratio(pr.output_tps, ca.output_tps):.2f}x the output tok/s")  # fmt: skip
    spread = ratio(max(p90.values()), min(p90.values()))
    return (f"NOTE  private contexts at {rate} req/s: TTFT p90 "
            + ", ".join(f"{p} {ms(v)} ms" for p, v in p90.items())
            + f": the slowest policy {spread:.2f}x the fastest{versus}")  # fmt: skip


def precise_checks(results: list[RunResult], s: Settings, workloads: list[str]) -> list[str]:
    """Issue 22's done-when checks for `precise`."""
    out: list[str] = []

    def line(ok: bool, text: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    rates = [f"{r:g}" for r in s.tm.rates]
    rate = key_rates(results, s)["evicting"]
    base, trigger = first_over(results, "evicting", rates, "cache_aware")
    ca = find(results, "evicting", rate, "cache_aware")
    pr = find(results, "evicting", rate, "precise")
    if "evicting" not in workloads:
        pass
    elif base is None or ca is None or pr is None:
        line(False, "evicting: cache_aware or precise unavailable")
    elif trigger is None:
        line(False, f"evicting: cache_aware's TTFT p90 never exceeded 5x its p90 at "
                    f"{rates[0]} req/s ({ms(base.ttft_p90_s)} ms; {ms(ca.ttft_p90_s)} ms at "
                    f"{rate} req/s): raise the top rate")  # fmt: skip
    else:
        head = (f"evicting at {rate} req/s (cache_aware's p90 {ms(ca.ttft_p90_s)} ms > 5x "
                f"{ms(base.ttft_p90_s)} ms at {rates[0]} req/s):")  # fmt: skip
        line(3 * pr.ttft_p90_s <= ca.ttft_p90_s,
             f"{head} precise TTFT p90 {ms(pr.ttft_p90_s)} ms, at least 3x lower than "
             f"cache_aware's (ratio {ratio(ca.ttft_p90_s, pr.ttft_p90_s):.2f}x)")  # fmt: skip
        line(pr.output_tps >= ca.output_tps,
             f"{head} precise {pr.output_tps:,.0f} output tok/s, at least cache_aware's "
             f"{ca.output_tps:,.0f} ({ratio(pr.output_tps, ca.output_tps):.2f}x)")  # fmt: skip
    if "two-routers" in workloads:
        one = {p: find(results, "evicting", rate, p) for p in ("least_outstanding", "cache_aware", "precise")}
        two = {p: find(results, "two-routers", rate, p) for p in one}
        for baseline in ("least_outstanding", "cache_aware"):
            a, b, c, d = one[baseline], one["precise"], two[baseline], two["precise"]
            if a is None or b is None or c is None or d is None:
                line(False, f"2 routers at {rate} req/s: {baseline} or precise did not run "
                            "with one router and with two")  # fmt: skip
                continue
            gain1, gain2 = ratio(a.ttft_p90_s, b.ttft_p90_s), ratio(c.ttft_p90_s, d.ttft_p90_s)
            line(gain2 >= 0.9 * gain1,
                 f"2 routers at {rate} req/s: precise keeps at least 90% of its single-router "
                 f"gain over {baseline} in TTFT p90: {gain2:.2f}x ({ms(c.ttft_p90_s)} / "
                 f"{ms(d.ttft_p90_s)} ms) against {gain1:.2f}x ({ms(a.ttft_p90_s)} / "
                 f"{ms(b.ttft_p90_s)} ms) with one router: {ratio(gain2, gain1):.0%}")  # fmt: skip
    single = SINGLE_ROUTER & set(workloads)
    if single:
        ca_all, ca_net = cpu_per_request(results, "cache_aware", single)
        pr_all, pr_net = cpu_per_request(results, "precise", single)
        per = "; ".join(
            f"{w} {cpu_per_request(results, 'precise', {w})[0]:.2f} vs "
            f"{cpu_per_request(results, 'cache_aware', {w})[0]:.2f}"
            for w in WORKLOADS if w in single
        )  # fmt: skip
        line(pr_all <= 2 * ca_all,
             f"router CPU per routed request (tokenizing's router side included), all "
             f"single-router runs: precise {pr_all:.2f} ms, at most 2x cache_aware's "
             f"{ca_all:.2f} ms ({ratio(pr_all, ca_all):.2f}x; less each router's idle rate: "
             f"{pr_net:.2f} vs {ca_net:.2f} ms, {ratio(pr_net, ca_net):.2f}x; by workload, ms: "
             f"{per})")  # fmt: skip
    if "restart" in workloads:
        pr = next((r for r in results if r.workload == "restart" and r.policy == "precise" and r.restart), None)
        if pr is None:
            line(False, "restart: precise did not run")
        else:
            info, after = pr.restart, pr.restart["after"]
            fed = info["fed_after_spawn_s"]
            same = find(results, "evicting", pr.rate, "precise")
            exact = (f"{after['predicted_exact']}/{after['predicted']} predictions after the "
                     f"restart equal the engine's cached tokens") if after.get("predicted") else "no predictions"  # fmt: skip
            if same is not None and same.predicted:
                exact += (f" (never restarted, the whole stage: {same.predicted_exact}/"
                          f"{same.predicted})")  # fmt: skip
            line(fed is not None and fed <= 1.0,
                 f"restart at {pr.rate} req/s: the new precise router's index held every "
                 f"engine's blocks within 1 s of its start: "
                 f"{'never (10 s)' if fed is None else f'{fed:.2f} s'} after its spawn "
                 f"({info['fed_after_ready_s']} s after it was ready); {exact}")  # fmt: skip
    return out


@dataclass
class Settings:
    params: EngineParams
    mt: MultiTurn
    hp: HotPrefix
    nr: NoReuse
    pc: PrivateContexts
    tm: Teams = field(default_factory=Teams)
    conversations: int = 0  # how many the private-contexts schedule opens


def parameters_text(s: Settings) -> list[str]:
    params, mt, hp, nr, pc = s.params, s.mt, s.hp, s.nr, s.pc
    sessions_tokens = mt.sessions * sum(mt.context_words) / 2
    all_caches = REPLICAS * params.cache_tokens
    open_tokens = pc.open_conversations * sum(pc.context_words) / 2
    opened_tokens = s.conversations * sum(pc.context_words) / 2
    tm = s.tm
    team_tokens = tm.teams * tm.system_words
    return [
        f"- engines: {REPLICAS} mock engines, each: KV cache {params.kv_blocks} blocks of "
        f"{params.block_size} tokens ({params.cache_tokens:,} tokens; all {all_caches:,}), prefill "
        f"{params.prefill_tps:,.0f} tokens/s shared, decode {params.decode_tps:g} tokens/s per "
        f"sequence, at most {params.max_seqs} sequences running (the rest queue, FIFO); each "
        "publishes KV-cache events (ZMQ, vLLM's map encoding, a replay socket)",
        f"- multi-turn: {mt.sessions} sessions, each with a private context of "
        f"{mt.context_words[0]}-{mt.context_words[1]} words (about {sessions_tokens:,.0f} tokens "
        f"in all, {sessions_tokens / params.cache_tokens:.1f}x one engine's cache, "
        f"{sessions_tokens / all_caches:.2f}x all of them), turns of "
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
        f"- private contexts: {pc.open_conversations} conversations open at any time, each "
        f"with a private context of {pc.context_words[0]}-{pc.context_words[1]} words (about "
        f"{open_tokens:,.0f} tokens open, {open_tokens / all_caches:.1f}x all the engines' "
        f"caches); a turn of {pc.question_words} words goes to an open conversation drawn at "
        f"random and carries it so far, answers of {pc.answer_tokens} tokens; a conversation "
        f"closes after {pc.turns} turns and a new one opens ({s.conversations} opened in all, "
        f"about {opened_tokens:,.0f} tokens of context, {opened_tokens / all_caches:.1f}x all "
        f"the caches); Poisson at {', '.join(f'{r:g}' for r in pc.rates)} req/s in turn, "
        f"{pc.duration_s:g} s each, warm as multi-turn",
        f"- evicting (llm-d's precise-routing workload, scaled): "
        f"{tm.teams} teams, each with a {tm.system_words}-word system prompt of its own (about "
        f"{team_tokens:,.0f} tokens in all: {team_tokens / all_caches:.2f}x all the engines' "
        f"caches, {team_tokens / params.cache_tokens:.1f}x one engine's) and "
        f"{tm.users_per_team} users; a turn goes to a user drawn at random, "
        f"{tm.question_words[0]}-{tm.question_words[1]} words carrying the user's conversation so far, answers of "
        f"{tm.answer_tokens} tokens; a user starts afresh after {tm.turns} turns; Poisson at "
        f"{', '.join(f'{r:g}' for r in tm.rates)} req/s in turn, {tm.duration_s:g} s each "
        f"({tm.top_duration_s:g} s at the top rate, after {tm.top_lead_s:g} s at it unreported), "
        "warm as multi-turn",
        "- two-routers: the evicting stages up to the rate of its check, through two routers "
        "of the same policy and config, request i to router i mod 2 (each sees every other "
        "turn of each user)",
        "- restart: the evicting stages up to that rate on one router on a fixed port, stopped "
        f"(SIGTERM, shutdown_grace_s = {SHUTDOWN_GRACE_S}) at the request a quarter into the last "
        "stage and a new router started on the same port; the client keeps sending",
        "- a token is a word of the chat rendering; TTFT is the engine's own measure "
        "(arrival to first token); output tok/s = output tokens / (last answer's end - run "
        "start); hit rate = cached prompt tokens / prompt tokens; router CPU = the router "
        "process's user + system CPU over the stage / requests the engines saw (its "
        "background work included; the engines' side of /tokenize is theirs)",
    ]


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=9, help="the arrival schedules' seed (default 9)")
    p.add_argument("--quick", action="store_true", help="shorter runs at fewer rates: a rough look")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument(
        "--session-header",
        action="store_true",
        help="send each multi-turn request's session as x-session-id (the router's session\n"
        "affinity, which every policy honours): a reference, not the benchmark",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="run each router under cProfile (routing-logs/router-*.prof); its CPU figures\n"
        "then include the profiler's cost",
    )
    p.add_argument(
        "--evicting-rates",
        default="",
        help="comma-separated request rates of the evicting workloads (default 8,24,48,64)",
    )
    p.add_argument(
        "--teams",
        type=int,
        default=0,
        help="teams in the evicting workloads (default 75: their prompts 0.73x all the\n"
        "caches, llm-d's ratio; 120: 1.17x)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a check FAILs")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "routing.md", help="results file")
    return p.parse_args(argv)


def settings_for(quick: bool) -> Settings:
    s = Settings(EngineParams(), MultiTurn(), HotPrefix(), NoReuse(), PrivateContexts())
    if quick:
        s.mt = MultiTurn(rates=(3.0, 48.0), duration_s=6.0)
        s.hp = HotPrefix(serial_requests=24, rates=(24.0,), duration_s=4.0)
        s.nr = NoReuse(rates=(24.0,), duration_s=4.0)
        s.pc = PrivateContexts(rates=(4.0, 48.0), duration_s=5.0)
        s.tm = Teams(rates=(8.0, 64.0), duration_s=5.0, top_duration_s=10.0, top_lead_s=3.0)
    return s


def plan_for(workload: str, s: Settings, seed: int, results: list[RunResult]) -> Plan:
    if workload == "multi-turn":
        return Plan(workload, multi_turn_stages(s.mt, seed), warm=True)
    if workload == "hot-prefix":
        return Plan(workload, [Stage(r, hot_prefix_schedule(s.hp, r, seed)) for r in (None, *s.hp.rates)], warm=False)
    if workload == "no-reuse":
        return Plan(workload, [Stage(r, no_reuse_schedule(s.nr, r, seed)) for r in s.nr.rates], warm=False)
    if workload == "private-contexts":
        stages, s.conversations = private_context_stages(s.pc, seed)
        return Plan(workload, stages, warm=True)
    stages = teams_stages(s.tm, seed)
    if workload == "evicting":
        return Plan(workload, stages, warm=True)
    # Up to the rate the checks read: where cache_aware's p90 first passed 5x its lowest
    # rate's on the evicting workload (all the rates when it never did or did not run).
    trigger = first_over(results, "evicting", [st.label for st in stages], "cache_aware")[1]
    if trigger is not None:
        stages = stages[: [st.label for st in stages].index(trigger) + 1]
    if workload == "two-routers":
        return Plan(workload, stages, warm=True, routers=2)
    return Plan(workload, stages, warm=True, restart_at=stages[-1].label)


def main(argv: list[str] | None = None) -> int:
    global PROFILE
    args = parse_args(sys.argv[1:] if argv is None else argv)
    PROFILE = args.profile
    s = settings_for(args.quick)
    if args.evicting_rates:
        rates = tuple(float(r) for r in args.evicting_rates.split(",") if r)
        s.tm = Teams(**{**asdict(s.tm), "rates": rates})
    if args.teams > 0:
        s.tm = Teams(**{**asdict(s.tm), "teams": args.teams})
    s.conversations = private_context_stages(s.pc, args.seed)[1]
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = (set(policies) - set(POLICIES)) | (set(workloads) - set(WORKLOADS))
    if unknown:
        print(f"unknown policy or workload: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    workloads = [w for w in WORKLOADS if w in workloads]
    began = time.monotonic()
    load_before = os.getloadavg()
    results: list[RunResult] = []
    print("routing benchmark; parameters:\n" + "\n".join(parameters_text(s)), flush=True)
    try:
        fleet = Fleet(s.params)
        settings = {p: router_setting(p, fleet.engines) for p in policies}
        missing = {p: why for p, (_, why) in settings.items() if why}
        for policy, why in missing.items():
            print(f"  the router does not run balancing = {policy!r} yet: {why}", flush=True)
        for policy, (value, why) in settings.items():
            if value is None and not why:
                print(f"  {policy}: the router's default (it has no `balancing` key yet)", flush=True)
        for workload in workloads:
            plan = plan_for(workload, s, args.seed, results)
            for policy in policies:
                if policy in missing:
                    results += [
                        RunResult(plan.workload, stage.label, policy, unavailable=missing[policy])
                        for stage in plan.stages
                    ]
                    continue
                setting = settings[policy][0]
                results += run_plan(plan, policy, setting, fleet, args.session_header)
    except BenchError as exc:
        print(f"the benchmark could not run: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in STARTED:
            proc.stop()
    verdicts = checks(results, s, workloads)
    load_after = os.getloadavg()
    report = [
        "# Routing benchmark",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, seed {args.seed}, {time.monotonic() - began:.0f} s; "
        f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} before, "
        f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after"
        + (" (routers under cProfile)" if args.profile else ""),
        "",
        *parameters_text(s),
        "",
        "## Summary (each workload at the rate its checks read)",
        "",
        *summary_table(results, s, workloads),
    ]
    for workload in workloads:
        report += ["", f"## {workload}", "", *table(results, workload), "", *detail_table(results, workload)]
        if workload == "restart":
            report += ["", *restart_table(results)]
    report += ["", "## Checks", "", "```", *verdicts, "```", ""]
    text = "\n".join(report)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    parameters = {
        "engine": asdict(s.params),
        "multi_turn": asdict(s.mt),
        "hot_prefix": asdict(s.hp),
        "no_reuse": asdict(s.nr),
        "private_contexts": asdict(s.pc),
        "evicting": asdict(s.tm),
    }
    runs = [asdict(r) for r in results]
    everything = {"parameters": parameters, "runs": runs, "checks": verdicts}
    args.out.with_suffix(".json").write_text(json.dumps(everything, indent=1))
    print(f"written to {args.out} and {args.out.with_suffix('.json')}")
    failed = any(v.startswith("FAIL") for v in verdicts)
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
