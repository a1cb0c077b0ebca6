#!/usr/bin/env python3
"""Data-plane benchmark: llmgw's router beside vllm-router, in one run, like for like.

Run it from the repository root with the project's virtualenv (`make bench` runs it too):

    .venv/bin/python bench/dataplane_bench.py             # about 5 minutes
    .venv/bin/python bench/dataplane_bench.py --runs 9    # more interleaved runs
    .venv/bin/python bench/dataplane_bench.py --quick     # a smoke test (under a minute)

What it starts, all on loopback ports of this machine:
- bench/fast_engine (Go, standard library; built here with `go build`, Debian's
  golang-go): one process serving several ports, each a replica to a gateway, two
  replicas for each gateway so that the balancing policy has a choice, and so that the
  engine can say which gateway asked for what (its GET /bench/stats). It answers plain
  chat completions at once and streams `--chunks` events paced `--interval-ms` apart;
- vllm-router (PyPI, pinned in bench/requirements-vllm-router.txt, installed into its own
  virtualenv under ~/.cache/llmgw/bench/), `--policy round_robin` and `--policy
  cache_aware`, its other options left at their defaults;
- llmgw's router (this checkout's code) with `balancing = "round_robin"` and
  `"cache_aware"`, with `[server] workers = 1` and `= N` (N: the cores, as "auto").

Each gateway is measured with wrk (bench/wrk/dataplane.lua: 64 conversations sharing a
system prompt, the same sequence for every gateway) at a fixed number of connections, for
plain requests and for paced streams: the gateway's own CPU time (user + sys of its
process tree from /proc/PID/stat: the parent and every worker) over the run, divided by
the requests wrk completed; per chunk is that divided by the chunks in a stream; p50 and
p99 latency are wrk's (a stream's is to its last byte). Rounds are interleaved (every
gateway once per round, in a rotating order, then the next round) and the medians over
the rounds are reported, with each llmgw figure as a ratio to vllm-router's with the same
policy from the same run. Last, with workers = 2, one worker is SIGKILLed under load and
a probe counts whether the port kept answering.

The table is printed as markdown; everything measured goes to bench/results/dataplane.json
and process logs to bench/results/dataplane-logs/. Exit status 0 when the benchmark ran,
2 when it could not (missing tool, a process that never served, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from router_bench import (
    http_request,
    machine_cpu,
    raise_nofile_limit,
    sse_events,
)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
ENGINE_SRC = BENCH / "fast_engine"
WRK_SCRIPT = BENCH / "wrk" / "dataplane.lua"
BENCH_KEY = "sk-dataplane-bench"
REQUIREMENTS = BENCH / "requirements-vllm-router.txt"
RESULTS_DIR = BENCH / "results"
LOG_DIR = RESULTS_DIR / "dataplane-logs"
CACHE = Path(os.environ.get("LLMGW_BENCH_CACHE", Path.home() / ".cache" / "llmgw" / "bench"))
VLLM_VENV = CACHE / "vllm-router-venv"
CLK_TCK = os.sysconf("SC_CLK_TCK")

MODEL = "bench"
KINDS = ("plain", "paced", "steady")
POLICIES = ("round_robin", "cache_aware")
PROMPT = "Say something about foxes and dogs."


class BenchError(Exception):
    """The benchmark could not run."""


# --------------------------------------------------------------------------- setup


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def build_engine() -> Path:
    """bench/fast_engine built with `go build`, once per version of its source."""
    go = shutil.which("go")
    if go is None:
        raise BenchError("Go is not installed: apt-get install -y golang-go (make bench does)")
    binary = CACHE / f"fast_engine-{_digest(ENGINE_SRC / 'main.go', ENGINE_SRC / 'go.mod')}"
    if binary.exists():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"  building {ENGINE_SRC.relative_to(ROOT)} -> {binary}", flush=True)
    done = subprocess.run(
        [go, "build", "-o", str(binary), "."], cwd=ENGINE_SRC, capture_output=True, text=True,
        check=False, timeout=600,
    )
    if done.returncode != 0:
        raise BenchError(f"go build failed:\n{done.stdout}{done.stderr}")
    return binary


def install_vllm_router() -> Path:
    """vllm-router's executable from its own virtualenv, installed once per requirements file."""
    stamp = VLLM_VENV / ".installed-stamp"
    want = _digest(REQUIREMENTS)
    exe = VLLM_VENV / "bin" / "vllm-router"
    if exe.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return exe
    print(f"  installing {REQUIREMENTS.relative_to(ROOT)} into {VLLM_VENV}", flush=True)
    python = VLLM_VENV / "bin" / "python"
    steps = [] if python.exists() else [[sys.executable, "-m", "venv", str(VLLM_VENV)]]
    steps.append([str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)])
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=900)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    if not exe.exists():
        raise BenchError(f"no {exe} after installing vllm-router")
    stamp.write_text(want + "\n")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command (which may hold spaces): [0] is field 3 of proc(5), the state.
    return text[text.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            children.setdefault(int(_proc_stat(int(entry))[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + sys) of a process tree: every live process's own time and the
    time of the children it has reaped (a worker that died and was waited for counts)."""
    ticks = 0
    for pid in process_tree(root):
        with contextlib.suppress(OSError, IndexError, ValueError):
            f = _proc_stat(pid)
            ticks += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return ticks / CLK_TCK


def own_cpu_s(pid: int) -> float:
    """CPU seconds (user + sys) of one process, its children left out."""
    f = _proc_stat(pid)
    return (int(f[11]) + int(f[12])) / CLK_TCK


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


STARTED: list[Proc] = []


class Proc:
    """A process in a session of its own, its output in a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        self.pid = self.popen.pid
        STARTED.append(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def cpu_s(self) -> float:
        return tree_cpu_s(self.pid)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL it after `grace_s`. Returns the status."""
        status: int | None = self.popen.poll()
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                status = self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                status = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # whatever of the group outlived its leader
        if status is None:
            self.popen.wait()
        if not self._log.closed:
            self._log.close()
        return status


def wait_for(what: str, proc: Proc, check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            value = check()
            if value:
                return value
        if not proc.alive():
            raise BenchError(f"{proc.name} exited ({proc.popen.returncode}) before {what}:\n"
                             f"{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{proc.name}: no {what} within {timeout_s:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.05)


def start_engine(binary: Path, replicas: int, args: argparse.Namespace) -> tuple[Proc, list[str]]:
    proc = Proc("fast-engine", [
        str(binary), "-model", MODEL, "-replicas", str(replicas), "-chunks", str(args.chunks),
        "-owned-by", args.engine_owned_by,
        "-interval", f"{args.interval_ms}ms",
    ])

    def urls() -> list[str]:
        found = [line.rsplit(" ", 1)[1] for line in proc.log_text().splitlines()
                 if line.startswith("fast engine serving")]
        return found if len(found) == replicas else []

    return proc, wait_for("its URLs", proc, urls, 15)


def engine_stats(engine_url: str) -> dict[str, int]:
    status, _, data = http_request("GET", engine_url + "/bench/stats")
    if status != 200:
        raise BenchError(f"the engine's /bench/stats answered {status}")
    return {k: int(v) for k, v in json.loads(data).items()}


@dataclass
class Gateway:
    name: str  # what the table calls it
    product: str  # "vllm-router" or "llmgw"
    policy: str
    workers: int  # llmgw's [server] workers (vllm-router: 1 process, its own threads)
    upstreams: list[str]
    proc: Proc
    url: str = ""
    processes: int = 1  # counted once it serves
    threads: int = 0
    baseline: bool = False  # llmgw running --baseline-src's code, not this checkout's

    def children(self) -> list[int]:
        return [p for p in process_tree(self.proc.pid) if p != self.proc.pid]


def _child_env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    # This checkout's code (or --llmgw-src), whatever the virtualenv's editable install has.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_llmgw(
    name: str, policy: str, workers: int, upstreams: list[str], args: argparse.Namespace,
    src: Path | None = None,
) -> Gateway:
    config = LOG_DIR / f"{name}.toml"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    endpoints = ", ".join(f'"{u}"' for u in upstreams)
    tenancy = ""
    if args.tenant == "limited":
        digest = "sha256:" + hashlib.sha256(BENCH_KEY.encode()).hexdigest()
        if src is None:
            # Limits the bench never reaches: every request goes through admission,
            # its reservation and its settlement, and is never refused.
            tenancy = (
                f'\n[[auth.keys]]\ndigest = "{digest}"\ntenant = "bench"\n'
                '\n[[tenants]]\nname = "bench"\nrequests_per_minute = 1000000000\n'
                "tokens_per_minute = 1000000000000\nmax_in_flight = 1000000\n"
            )
        else:  # the baseline, from before tenants: the same key, checked the same way
            tenancy = f'\n[auth]\napi_keys = ["{digest}"]\n'
    config.write_text(
        "# written by bench/dataplane_bench.py\n"
        "[server]\n"
        'listen = "127.0.0.1:0"\n'
        f"workers = {workers}\n"
        f"access_log = {'true' if args.access_log == 'on' else 'false'}\n"
        "shutdown_grace_s = 2\n"
        "\n[router]\n"
        f'balancing = "{policy}"\n'
        + (f"migrate_max = {args.migrate_max}\n" if args.migrate_max is not None and src is None
           else "")
        + "\n[[models]]\n"
        f'name = "{MODEL}"\n'
        f"endpoints = [{endpoints}]\n" + tenancy
    )
    proc = Proc(name, [sys.executable, "-m", "llmgw_server", "--config", str(config)],
                env=_child_env(src or args.llmgw_src))
    gw = Gateway(name, "llmgw", policy, workers, upstreams, proc, baseline=src is not None)

    def url() -> str:
        for line in proc.log_text().splitlines():
            if "listening on http://" in line and "control plane" not in line:
                return line.rsplit("listening on ", 1)[1].split()[0]
        return ""

    gw.url = wait_for("its URL", proc, url, 60)
    wait_for("/readyz 200", proc, lambda: http_request("GET", gw.url + "/readyz")[0] == 200)
    return gw


def start_vllm_router(
    name: str, exe: Path, policy: str, upstreams: list[str]
) -> Gateway:
    for attempt in range(3):  # a free port found here may be taken before the router binds it
        port, metrics_port = free_port(), free_port()
        argv = [
            str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *upstreams,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(metrics_port),
        ]
        proc = Proc(name, argv)
        gw = Gateway(name, "vllm-router", policy, 1, upstreams, proc,
                     url=f"http://127.0.0.1:{port}")
        try:
            health = gw.url + "/health"
            wait_for("/health 200", proc, lambda u=health: http_request("GET", u)[0] == 200)
            return gw
        except BenchError:
            if proc.alive() or attempt == 2:
                raise
            STARTED.remove(proc)
            proc.stop()
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- correctness


def chat_body(stream: bool) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def answer_shape(base_url: str) -> tuple[str, int, bool]:
    """(plain answer's text, data events in a stream, whether it ended with [DONE])."""
    # The key of --tenant limited (a gateway without keys takes any).
    key = {"authorization": f"Bearer {BENCH_KEY}"}
    status, _, data = http_request(
        "POST", base_url + "/v1/chat/completions", chat_body(False), extra=key
    )
    if status != 200:
        raise BenchError(f"a plain request to {base_url} answered {status}: {data[:300]!r}")
    text = str(json.loads(data)["choices"][0]["message"]["content"])
    status, _, data = http_request(
        "POST", base_url + "/v1/chat/completions", chat_body(True), extra=key
    )
    if status != 200:
        raise BenchError(f"a stream from {base_url} answered {status}: {data[:300]!r}")
    events = sse_events(data)
    done = bool(events) and events[-1] == b"[DONE]"
    return text, len(events) - (1 if done else 0), done


# --------------------------------------------------------------------------- wrk


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def wrk_argv(url: str, conns: int, duration_s: int, threads: int) -> list[str]:
    return [
        "wrk", f"-t{min(threads, conns)}", f"-c{conns}", f"-d{duration_s}s", "--latency",
        "--timeout", "10s", "-s", str(WRK_SCRIPT), url + "/v1/chat/completions",
    ]


def wrk_env(kind: str, args: argparse.Namespace) -> dict[str, str]:
    return dict(
        os.environ,
        LLMGW_BENCH_MODEL=MODEL,
        LLMGW_BENCH_STREAM="1" if kind == "paced" else "0",
        LLMGW_BENCH_DELAY_MS=f"{args.steady_delay_ms:g}" if kind == "steady" else "0",
        LLMGW_BENCH_CONVERSATIONS=str(args.conversations),
        LLMGW_BENCH_KEY=BENCH_KEY if args.tenant == "limited" else "",
    )


def parse_wrk(returncode: int, stdout: str, stderr: str, argv: list[str]) -> WrkResult:
    line = next((x for x in stdout.splitlines() if x.startswith("BENCH ")), None)
    if returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({returncode}): {' '.join(argv)}\n{stdout}\n{stderr}")
    r = json.loads(line[6:])
    return WrkResult(
        requests=int(r["requests"]),
        duration_s=r["duration_us"] / 1e6,
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        errors={k[4:]: int(v) for k, v in r.items() if k.startswith("err_") and v},
    )


def run_wrk(url: str, kind: str, duration_s: int, args: argparse.Namespace) -> WrkResult:
    conns = {"plain": args.plain_conns, "paced": args.paced_conns}.get(kind, args.steady_conns)
    argv = wrk_argv(url, conns, duration_s, args.wrk_threads)
    done = subprocess.run(argv, capture_output=True, text=True, env=wrk_env(kind, args),
                          timeout=duration_s + 60, check=False)
    return parse_wrk(done.returncode, done.stdout, done.stderr, argv)


@dataclass
class Sample:
    round: int
    gateway: str
    kind: str
    cpu_ms: float  # the gateway's CPU per request
    parent_cpu_ms: float  # of which its first process's own (with workers: the supervisor's)
    engine_cpu_ms: float
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]


def measure(
    gw: Gateway, kind: str, round_no: int, engine: Proc, args: argparse.Namespace
) -> Sample:
    if args.warmup > 0:
        run_wrk(gw.url, kind, args.warmup, args)
        time.sleep(0.2)
    gw_before, engine_before = gw.proc.cpu_s(), engine.cpu_s()
    parent_before = own_cpu_s(gw.proc.pid)
    result = run_wrk(gw.url, kind, args.duration, args)
    time.sleep(0.3)  # let the gateway finish with the connections wrk closed
    requests = max(result.requests, 1)
    sample = Sample(
        round_no, gw.name, kind,
        cpu_ms=(gw.proc.cpu_s() - gw_before) * 1000 / requests,
        parent_cpu_ms=(own_cpu_s(gw.proc.pid) - parent_before) * 1000 / requests,
        engine_cpu_ms=(engine.cpu_s() - engine_before) * 1000 / requests,
        requests=result.requests, rps=result.rps, p50_ms=result.p50_ms, p99_ms=result.p99_ms,
        errors=result.errors,
    )
    gw.threads = max(gw.threads, sum(threads_of(p) for p in process_tree(gw.proc.pid)))
    if not gw.proc.alive():
        raise BenchError(f"{gw.name} died:\n{gw.proc.log_tail()}")
    per_chunk = f" ({sample.cpu_ms * 1000 / args.chunks:5.1f} us/chunk)" if kind == "paced" else ""
    if gw.processes > 1:
        per_chunk += f" (supervisor {sample.parent_cpu_ms:.3f})"
    print(
        f"  round {round_no} {gw.name:30} {kind:5} {sample.rps:7.0f} req/s  "
        f"p50 {sample.p50_ms:6.2f}  p99 {sample.p99_ms:7.2f} ms  "
        f"CPU {sample.cpu_ms:.3f} ms/req{per_chunk}"
        + (f"  ERRORS {sample.errors}" if sample.errors else ""),
        flush=True,
    )
    return sample


# --------------------------------------------------------------------------- survival


@dataclass
class Survival:
    ran: bool
    why_not: str = ""
    processes_before: int = 0
    killed_pid: int = 0
    replaced_within_s: float | None = None
    wrk_requests: int = 0
    wrk_errors: dict[str, int] = field(default_factory=dict)
    probes_ok: int = 0
    probes_failed_after_kill: int = 0
    probe_failures: list[str] = field(default_factory=list)
    longest_gap_after_kill_s: float = 0.0  # between two answered probes, once a worker died


def survival_check(upstreams: list[str], args: argparse.Namespace) -> Survival:
    gw = start_llmgw("llmgw-survival-w2", "round_robin", 2, upstreams, args)
    try:
        children = wait_workers(gw, 2, 10.0)
        if len(children) < 2:
            return Survival(
                False, f"llmgw with workers = 2 ran {1 + len(children)} process(es): this "
                "checkout has no multi-process workers yet",
                processes_before=1 + len(children),
            )
        result = Survival(True, processes_before=1 + len(children))
        load_s = max(6, args.duration * 2)
        argv = wrk_argv(gw.url, args.plain_conns, load_s, args.wrk_threads)
        wrk = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=wrk_env("plain", args))
        stop = threading.Event()
        probes: list[tuple[float, bool, str]] = []

        def probe() -> None:  # a fresh connection each time: does the port accept and answer?
            while not stop.is_set():
                t = time.monotonic()
                try:
                    status, _, _ = http_request(
                        "POST", gw.url + "/v1/chat/completions", chat_body(False), timeout=5)
                    probes.append((t, status == 200, f"status {status}"))
                except OSError as exc:
                    probes.append((t, False, f"{type(exc).__name__}: {exc}"))
                time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        time.sleep(load_s / 3)
        cpu = {p: tree_cpu_s(p) for p in children}
        time.sleep(0.5)
        # The busiest child is surely a worker serving requests (not some helper process).
        victim = max(children, key=lambda p: tree_cpu_s(p) - cpu.get(p, 0.0))
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        result.killed_pid = victim
        while time.monotonic() - killed_at < 15:
            now = [p for p in gw.children() if p != victim]
            if len(now) >= len(children):
                result.replaced_within_s = time.monotonic() - killed_at
                break
            time.sleep(0.05)
        out, err = wrk.communicate(timeout=load_s + 60)
        stop.set()
        prober.join(10)
        w = parse_wrk(wrk.returncode, out, err, argv)
        result.wrk_requests, result.wrk_errors = w.requests, w.errors
        result.probes_ok = sum(1 for _, ok, _ in probes if ok)
        after = [(t, ok, why) for t, ok, why in probes if t >= killed_at]
        result.probes_failed_after_kill = sum(1 for _, ok, _ in after if not ok)
        result.probe_failures = [why for _, ok, why in after if not ok][:5]
        last = killed_at
        for t, ok, _ in after:
            if ok:
                result.longest_gap_after_kill_s = max(result.longest_gap_after_kill_s, t - last)
                last = t
        return result
    finally:
        gw.proc.stop()


def wait_workers(gw: Gateway, workers: int, timeout_s: float) -> list[int]:
    """The gateway's child processes once `workers` of them run (or whatever ran by then)."""
    deadline = time.monotonic() + timeout_s
    children = gw.children()
    while len(children) < workers and time.monotonic() < deadline:
        time.sleep(0.1)
        children = gw.children()
    return children


# --------------------------------------------------------------------------- report


def summarize(
    gateways: list[Gateway], samples: list[Sample], args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for gw in gateways:
        for kind in args.kinds:
            mine = [s for s in samples if s.gateway == gw.name and s.kind == kind]
            if not mine:
                continue
            ref = next(g for g in gateways if g.product == "vllm-router" and g.policy == gw.policy)
            theirs = {s.round: s for s in samples if s.gateway == ref.name and s.kind == kind}
            cpu = [s.cpu_ms for s in mine]
            plain = [s.cpu_ms for s in samples if s.gateway == gw.name and s.kind == "plain"]
            ref_median = statistics.median(s.cpu_ms for s in theirs.values())
            per_round = [s.cpu_ms / theirs[s.round].cpu_ms for s in mine
                         if s.round in theirs and theirs[s.round].cpu_ms > 0]
            rows.append({
                "gateway": gw.name, "product": gw.product, "policy": gw.policy,
                "workers": gw.workers, "processes": gw.processes, "threads": gw.threads,
                "kind": kind, "runs": len(mine),
                "cpu_ms_median": statistics.median(cpu), "cpu_ms_min": min(cpu),
                "cpu_ms_max": max(cpu),
                "per_chunk_us_median": (statistics.median(cpu) * 1000 / args.chunks
                                        if kind == "paced" else None),
                # (stream - plain) / chunks: what relaying a chunk adds, the request's own cost
                # left out; the table's per-chunk figure is the issue's, per stream / chunks.
                "marginal_chunk_us_median": (
                    (statistics.median(cpu) - statistics.median(plain)) * 1000 / args.chunks
                    if kind == "paced" and plain else None),
                "ratio_to_vllm_router": statistics.median(cpu) / ref_median if ref_median else None,
                "ratio_to_one_worker": _to_one_worker(gw, gateways, samples, kind),
                "ratio_to_baseline": _to_baseline(gw, gateways, samples, kind),
                "ratio_per_round_median": statistics.median(per_round) if per_round else None,
                "ratio_per_round_min": min(per_round) if per_round else None,
                "ratio_per_round_max": max(per_round) if per_round else None,
                "rps_median": statistics.median(s.rps for s in mine),
                "p50_ms_median": statistics.median(s.p50_ms for s in mine),
                "p99_ms_median": statistics.median(s.p99_ms for s in mine),
                "errors": sum(sum(s.errors.values()) for s in mine),
                "engine_cpu_ms_median": statistics.median(s.engine_cpu_ms for s in mine),
                "parent_cpu_ms_median": statistics.median(s.parent_cpu_ms for s in mine),
            })
    return rows


def _to_one_worker(
    gw: Gateway, gateways: list[Gateway], samples: list[Sample], kind: str
) -> float | None:
    """llmgw's median CPU per request with these workers over its median with one."""
    one = next((g for g in gateways if g.product == "llmgw" and g.policy == gw.policy
                and g.workers == 1 and g.baseline == gw.baseline), None)
    if gw.product != "llmgw" or one is None:
        return None
    return _median_ratio(gw, one, samples, kind)


def _to_baseline(
    gw: Gateway, gateways: list[Gateway], samples: list[Sample], kind: str
) -> float | None:
    """This checkout's median CPU per request over --baseline-src's (same policy, workers)."""
    base = next((g for g in gateways if g.baseline and g.policy == gw.policy
                 and g.workers == gw.workers), None)
    if gw.product != "llmgw" or gw.baseline or base is None:
        return None
    return _median_ratio(gw, base, samples, kind)


def _median_ratio(gw: Gateway, base_gw: Gateway, samples: list[Sample], kind: str) -> float | None:
    base = [s.cpu_ms for s in samples if s.gateway == base_gw.name and s.kind == kind]
    mine = [s.cpu_ms for s in samples if s.gateway == gw.name and s.kind == kind]
    if not base or not mine or not statistics.median(base):
        return None
    return statistics.median(mine) / statistics.median(base)


def engine_requests(
    gateways: list[Gateway], before: dict[str, int], after: dict[str, int]
) -> dict[str, dict[str, int]]:
    """What each gateway asked of its own engine ports during the runs, by method and path,
    and the connections it opened ("PORT METHOD PATH" counts from the engine, summed)."""
    out: dict[str, dict[str, int]] = {}
    for gw in gateways:
        ports = {u.rsplit(":", 1)[1] for u in gw.upstreams}
        counts: dict[str, int] = {}
        for key, value in after.items():
            port, what = key.split(" ", 1)
            if port in ports and value - before.get(key, 0) and what != "GET /bench/stats":
                counts[what] = counts.get(what, 0) + value - before.get(key, 0)
        out[gw.name] = dict(sorted(counts.items()))
    return out


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, survival: Survival | None,
             env: dict[str, Any], engine_side: dict[str, dict[str, int]]) -> str:
    by = {(r["gateway"], r["kind"]): r for r in rows}
    names = list(dict.fromkeys(r["gateway"] for r in rows))
    conns = {"plain": args.plain_conns, "paced": args.paced_conns}
    out = [
        f"Medians of {args.runs} interleaved runs ({args.duration:g} s of wrk each; plain: "
        f"{conns['plain']} connections; paced: {conns['paced']} connections, {args.chunks}-chunk "
        f"streams, a chunk every {args.interval_ms:g} ms). CPU: the gateway's process tree, "
        "per request; x: llmgw's median over vllm-router's, same policy, same run "
        "(range of the per-round ratios in brackets).",
        "",
        "| gateway | procs | plain CPU ms | x | plain p50 / p99 ms | req/s "
        "| paced CPU ms/stream | us/chunk | x | paced p50 / p99 ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]

    def ratio(r: dict[str, Any] | None) -> str:
        if r is None or r["product"] == "vllm-router" or r["ratio_to_vllm_router"] is None:
            return "1" if r is not None and r["product"] == "vllm-router" else ""
        lo, hi = r["ratio_per_round_min"], r["ratio_per_round_max"]
        span = f" ({lo:.1f}-{hi:.1f})" if lo is not None and len({lo, hi}) > 1 else ""
        return f"{r['ratio_to_vllm_router']:.2f}{span}"

    for name in names:
        p, s = by.get((name, "plain")), by.get((name, "paced"))
        any_row = p or s
        assert any_row is not None
        cells = [name, str(any_row["processes"])]
        if p:
            err = f", {p['errors']} errors" if p["errors"] else ""
            cells += [f"{p['cpu_ms_median']:.3f}", ratio(p),
                      f"{p['p50_ms_median']:.2f} / {p['p99_ms_median']:.2f}{err}",
                      f"{p['rps_median']:.0f}"]
        else:
            cells += ["", "", "", ""]
        if s:
            err = f", {s['errors']} errors" if s["errors"] else ""
            cells += [f"{s['cpu_ms_median']:.3f}", f"{s['per_chunk_us_median']:.1f}", ratio(s),
                      f"{s['p50_ms_median']:.2f} / {s['p99_ms_median']:.2f}{err}"]
        else:
            cells += ["", "", "", ""]
        out.append("| " + " | ".join(cells) + " |")
    steady = [r for r in rows if r["kind"] == "steady"]
    if steady:
        offered = args.steady_conns * 1000 / args.steady_delay_ms
        out += ["", f"Steady load: plain requests, {args.steady_conns} connections each pausing "
                f"{args.steady_delay_ms:g} ms before every request (under {offered:.0f} req/s "
                "offered, the same for every gateway, below what any of them can take): CPU per "
                "request without the batching a saturated process gets. x: over vllm-router's "
                "(same policy), and over llmgw's with one worker.", "",
                "| gateway | procs | CPU ms/req | x vllm-router | x workers=1 | req/s "
                "| p50 / p99 ms |", "|---|--:|--:|--:|--:|--:|--:|"]
        for r in steady:
            one = r["ratio_to_one_worker"]
            err = f", {r['errors']} errors" if r["errors"] else ""
            out.append(
                f"| {r['gateway']} | {r['processes']} | {r['cpu_ms_median']:.3f} | {ratio(r)} | "
                f"{'' if one is None else f'{one:.2f}'} | {r['rps_median']:.0f} | "
                f"{r['p50_ms_median']:.2f} / {r['p99_ms_median']:.2f}{err} |")
    against_base = [r for r in rows if r["ratio_to_baseline"] is not None]
    if against_base:
        out += ["", f"This checkout beside --baseline-src ({args.baseline_src}), same rounds: "
                "median CPU per request (per stream for paced) over the baseline's, same policy "
                "and workers.", "", "| gateway | kind | CPU ms | x baseline |", "|---|---|--:|--:|"]
        out += [f"| {r['gateway']} | {r['kind']} | {r['cpu_ms_median']:.3f} | "
                f"{r['ratio_to_baseline']:.3f} |" for r in against_base]
    out += ["", f"Machine: {env['cpus']} CPUs, {env['cpu_model']}; during the runs "
            f"{env['load'].get('busy', 0):.0f}% busy, {env['load'].get('others', 0):.0f}% "
            "by processes other than this benchmark's. "
            f"llmgw {env['llmgw_commit']} (access log {args.access_log}); "
            f"vllm-router {env['vllm_router_version']} (`--policy P`, every other option at its "
            "default; " + ", ".join(f"{r['gateway']} ran {r['threads']} threads"
                                    for r in rows if r["product"] == "vllm-router"
                                    and r["kind"] == args.kinds[0]) + f"); {env['wrk']}."]
    if engine_side:
        out += ["", "What each gateway asked of its engine replicas during the runs, besides the "
                "requests it relayed (`POST /v1/chat/completions`):", ""]
        for name, counts in engine_side.items():
            relayed = counts.get("POST /v1/chat/completions", 0)
            extra = [f"{what} {n}" + (f" ({n / relayed:.1f} per request)" if n > relayed / 10
                                      else "")
                     for what, n in counts.items()
                     if what not in ("POST /v1/chat/completions", "connections")]
            out.append(f"- {name}: {relayed} relayed over {counts.get('connections', 0)} "
                       f"connections opened; {', '.join(extra) or 'nothing else'}")
    if survival is not None:
        if not survival.ran:
            out += ["", f"Killed worker: not run: {survival.why_not}."]
        else:
            replaced = (f"replaced in {survival.replaced_within_s:.1f} s"
                        if survival.replaced_within_s is not None else "NOT replaced within 15 s")
            out += ["", (
                f"Killed worker: llmgw with workers = 2 ({survival.processes_before} processes) "
                f"under wrk ({args.plain_conns} connections); one worker SIGKILLed, {replaced}. "
                f"wrk: {survival.wrk_requests} requests, "
                f"{sum(survival.wrk_errors.values())} errors {survival.wrk_errors or ''}; "
                f"a probe on fresh connections every 20 ms: {survival.probes_failed_after_kill} "
                "failed after the kill, longest wait between two answers "
                f"{survival.longest_gap_after_kill_s * 1000:.0f} ms."
            )]
    return "\n".join(out) + "\n"


def environment(args: argparse.Namespace) -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break

    def out(*argv: str) -> str:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
        except OSError:
            return "?"
        return (done.stdout or done.stderr).strip().splitlines()[0] if (
            done.stdout or done.stderr).strip() else "?"

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model or platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "llmgw_commit": out("git", "-C", str(ROOT), "describe", "--always", "--dirty")
        + ("" if args.llmgw_src == ROOT / "src" else f" (code from {args.llmgw_src})"),
        "wrk": out("wrk", "-v"),
        "go": out("go", "version"),
        "vllm_router_version": out(str(VLLM_VENV / "bin" / "python"), "-c",
                                   "import importlib.metadata as m; print(m.version('vllm-router'))"),
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="interleaved rounds (default 5)")
    # wrk takes whole seconds only.
    p.add_argument("--duration", type=int, default=3, help="seconds per wrk run (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up seconds before each (0: none)")
    p.add_argument("--plain-conns", type=int, default=16, help="wrk connections, plain (16)")
    p.add_argument("--paced-conns", type=int, default=16, help="wrk connections, paced (16)")
    p.add_argument("--wrk-threads", type=int, default=1, help="wrk -t (default 1)")
    p.add_argument("--steady-conns", type=int, default=16,
                   help="wrk connections, steady (16)")
    p.add_argument("--steady-delay-ms", type=float, default=8.0,
                   help="steady: each connection's pause before a request, ms (8)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="plain,paced,steady (default all three)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="round_robin,cache_aware (default both)")
    p.add_argument("--workers", default="1,auto",
                   help="llmgw [server] workers to measure (default 1,auto: auto = the cores)")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas per gateway (2)")
    p.add_argument("--chunks", type=int, default=50, help="data events per stream (50)")
    p.add_argument("--interval-ms", type=float, default=1.0,
                   help="the engine's pause between stream events, ms (1)")
    p.add_argument("--conversations", type=int, default=64,
                   help="distinct conversations wrk cycles through (64)")
    p.add_argument("--access-log", choices=("on", "off"), default="on",
                   help="llmgw's access log (default on, as shipped; vllm-router logs no\n"
                   "line per request at its default level)")
    p.add_argument("--llmgw-src", type=Path, default=ROOT / "src",
                   help="the llmgw code to run (default this checkout's src/; for a commit:\n"
                   "git archive COMMIT src | tar -x -C DIR, then --llmgw-src DIR/src)")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="also run llmgw from this code (as --llmgw-src), interleaved in the\n"
                   "same rounds: each llmgw row then gets its ratio to the baseline's")
    p.add_argument("--no-survival", action="store_true", help="skip the killed-worker check")
    p.add_argument("--engine-owned-by", default="bench",
                   help="what the fast engine's /v1/models says it is: vllm makes this "
                   "checkout's router ask it for token ids (return_token_ids, as it asks "
                   "vLLM) to continue broken streams from, and take them out of the answers")
    p.add_argument("--migrate-max", type=int, default=None,
                   help="[router] migrate_max of this checkout's llmgw (not the baseline's): "
                   "0 turns stream migration off (default: the config's default)")
    p.add_argument("--tenant", choices=("default", "limited"), default="default",
                   help="whose requests: the default tenant's (no key, no limits), or a "
                   "limited tenant's (a key, [[tenants]] limits never reached; the "
                   "baseline gets the same key in api_keys)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: 1 round of 1 s, no warm-up (figures are noise)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "dataplane.json", help="results")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.duration, args.warmup = 1, 1, 0
    args.llmgw_src = args.llmgw_src.resolve()
    if args.baseline_src is not None:
        args.baseline_src = args.baseline_src.resolve()
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.policies = [k for k in args.policies.split(",") if k]
    if not set(args.kinds) <= set(KINDS) or not args.kinds:
        p.error(f"--kinds takes some of {', '.join(KINDS)}")
    if not set(args.policies) <= set(POLICIES) or not args.policies:
        p.error(f"--policies takes some of {', '.join(POLICIES)}")
    cores = len(os.sched_getaffinity(0))
    try:
        args.workers = list(dict.fromkeys(
            cores if w == "auto" else int(w) for w in args.workers.split(",") if w))
    except ValueError:
        p.error("--workers takes numbers or auto, comma separated")
    if args.runs < 1 or args.duration < 1 or args.chunks < 2 or any(w < 1 for w in args.workers):
        p.error("--runs >= 1, --duration >= 1, --chunks >= 2 and workers >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if shutil.which("wrk") is None:
        print("dataplane_bench: wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    raise_nofile_limit()
    started = time.monotonic()
    gateways: list[Gateway] = []
    samples: list[Sample] = []
    survival: Survival | None = None
    load: dict[str, float] = {}
    stats_before: dict[str, int] = {}
    stats_after: dict[str, int] = {}
    try:
        print("dataplane_bench: setting up", flush=True)
        binary = build_engine()
        exe = install_vllm_router()
        plan: list[tuple[str, str, int]] = []  # (product, policy, workers)
        for policy in args.policies:
            plan.append(("vllm-router", policy, 1))
            plan += [("llmgw", policy, w) for w in args.workers]
            if args.baseline_src is not None:
                plan += [("llmgw@base", policy, w) for w in args.workers]
        slots = len(plan) + (0 if args.no_survival else 1)
        engine, urls = start_engine(binary, args.replicas * slots, args)
        upstream = [urls[i * args.replicas : (i + 1) * args.replicas] for i in range(slots)]
        print(f"  engine pid {engine.pid}: {len(urls)} replicas; logs in "
              f"{LOG_DIR.relative_to(ROOT)}/", flush=True)
        for i, (product, policy, workers) in enumerate(plan):
            if product == "vllm-router":
                gw = start_vllm_router(f"vllm-router {policy}", exe, policy, upstream[i])
            elif product == "llmgw@base":
                gw = start_llmgw(f"llmgw@base {policy} workers={workers}", policy, workers,
                                 upstream[i], args, src=args.baseline_src)
                gw.processes = 1 + len(wait_workers(gw, workers if workers > 1 else 0, 10.0))
            else:
                gw = start_llmgw(f"llmgw {policy} workers={workers}", policy, workers,
                                 upstream[i], args)
                gw.processes = 1 + len(wait_workers(gw, workers if workers > 1 else 0, 10.0))
            gateways.append(gw)
            print(f"  {gw.name}: {gw.url} (pid {gw.proc.pid}, {gw.processes} process"
                  f"{'es' if gw.processes > 1 else ''})", flush=True)
        direct = answer_shape(upstream[0][0])
        if direct[1] != args.chunks or not direct[2]:
            raise BenchError(f"the engine streamed {direct[1]} events, not {args.chunks}")
        for gw in gateways:
            if answer_shape(gw.url) != direct:
                raise BenchError(f"{gw.name} answered differently from the engine itself")
        stats_before = engine_stats(urls[0])

        print(f"measuring: {args.runs} rounds x {len(gateways)} gateways x "
              f"{len(args.kinds)} kinds", flush=True)
        cpu_before = machine_cpu()
        ours_before = _our_cpu_s(engine, gateways)
        for round_no in range(1, args.runs + 1):
            turn = (round_no - 1) % len(gateways)
            order = gateways[turn:] + gateways[:turn]
            for kind in args.kinds:
                for gw in order:
                    samples.append(measure(gw, kind, round_no, engine, args))
        total, idle, steal = (b - a for a, b in zip(cpu_before, machine_cpu(), strict=True))
        ours = _our_cpu_s(engine, gateways) - ours_before
        total = max(total, 1)
        load = {
            "busy": 100 * (1 - idle / total),
            "steal": 100 * steal / total,
            "others": max(0.0, 100 * (total - idle - steal - ours * CLK_TCK) / total),
            "ours_cpu_s": ours,
        }
        stats_after = engine_stats(urls[0])
        for gw in gateways:
            gw.proc.stop()
        if not args.no_survival:
            print("survival: SIGKILL one of 2 workers under load", flush=True)
            try:
                survival = survival_check(upstream[-1], args)
            except BenchError as exc:  # the measurements above still count
                survival = Survival(False, f"the check could not run: {exc}")
                print(f"  {survival.why_not}", flush=True)
        engine.stop()
    except (BenchError, subprocess.TimeoutExpired) as exc:
        print(f"dataplane_bench: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in STARTED:
            if proc.alive():
                proc.stop()

    env = environment(args)
    env["load"] = load
    engine_side = engine_requests(gateways, stats_before, stats_after)
    rows = summarize(gateways, samples, args)
    report = markdown(rows, args, survival, env, engine_side)
    print("\n" + report)
    result = {
        "bench": "dataplane",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "took_s": round(time.monotonic() - started, 1),
        "environment": env,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "gateways": [
            {"name": g.name, "product": g.product, "policy": g.policy, "workers": g.workers,
             "processes": g.processes, "threads_max": g.threads, "argv": g.proc.argv,
             "upstreams": g.upstreams}
            for g in gateways
        ],
        "summary": rows,
        "samples": [asdict(s) for s in samples],
        "engine_requests_during_runs": engine_side,
        "survival": asdict(survival) if survival is not None else None,
        "table_markdown": report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.out} (took {result['took_s']:.0f} s)")
    return 0


def _our_cpu_s(engine: Proc, gateways: list[Gateway]) -> float:
    """CPU seconds of this benchmark: itself, wrk (waited for), the engine and the gateways."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime
    procs = [engine.pid] + [g.proc.pid for g in gateways]
    return total + sum(tree_cpu_s(p) for p in procs)


if __name__ == "__main__":
    sys.exit(main())
