#!/usr/bin/env python3
"""Router benchmark: the router against the mock engine, side by side, in one run.

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/router_bench.py            # about 2 minutes
    .venv/bin/python bench/router_bench.py --help     # shorter runs, profiling, ...

It starts real processes on free loopback ports (each binds port 0 and prints
its URL): one mock engine, one router in front of it, and the minimal h11
server of bench/router_minimal_h11.py, and measures with `wrk` (Debian package
`wrk`; `make bench` installs it) and bench/wrk/chat.lua:

1. requests/s and p50/p99 latency directly against the engine and through the
   router, for plain chat completions and for 50-chunk streams (role chunk,
   48 tokens, finish chunk, then `[DONE]`), at 1 and at 32 connections;
2. the CPU time (user + sys, from /proc/PID/stat) the router process spends
   per request during each router run, against the budget (0.5 ms per plain
   request, 2 ms per 50-chunk stream), with the engine's CPU per request for
   context. Two more kinds are informational: "static", a GET answered by the
   server itself, next to the minimal h11 server (the issue's reference machine
   answered one for 0.09 ms: this tells how fast this machine is, and what
   llmgw's own HTTP layer costs); "paced", the same streams with the engine
   writing 1,000 tokens/s, so the router relays the chunks one by one as it
   will with a real engine, instead of many per read;
3. with a fresh router and a slow engine (1 token/s): the router's resident
   memory while it holds 1,000 concurrent open streams (budget 200 MiB peak),
   and whether every stream is cancelled upstream once its client goes away.

RLIMIT_NOFILE's soft limit is raised to the hard one here, and the processes
started inherit it (the router needs two descriptors per held stream).
The results table is printed as markdown and written to bench/results/router.md
(git-ignored); process logs go to bench/results/router-logs/. The exit status
is 0 when the benchmark ran, whatever the verdicts (--strict: 1 when a budget
is OVER or a check FAILs), and 2 when it could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.metadata
import json
import os
import platform
import pstats
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

ROOT = Path(__file__).resolve().parent.parent
WRK_SCRIPT = ROOT / "bench" / "wrk" / "chat.lua"
RESULTS_DIR = ROOT / "bench" / "results"
LOG_DIR = RESULTS_DIR / "router-logs"
CLK_TCK = os.sysconf("SC_CLK_TCK")

MODEL = "bench"
STREAM_TOKENS = 48  # + the role chunk + the finish chunk = 50 chunks, then [DONE]
EXPECTED_CHUNKS = STREAM_TOKENS + 2
# "paced" is not in the budget: the same 50-chunk stream, with the engine
# writing one token at a time (--paced-tps), so that the router relays each chunk on
# its own instead of many at once; shown against the stream budget for information.
# "static" is a calibration, not a budget: GET /health on the engine and GET /healthz on
# the router, both answered by llmgw's h11-on-trio server without proxying; the issue's
# reference machine answered such a static request for 0.09 ms of CPU.
BUDGET_MS = {"plain": 0.5, "stream": 2.0, "paced": 2.0}
STATIC_REFERENCE_MS = 0.09
KINDS = ("static", "plain", "stream", "paced")
STATIC_PATH = {"engine": "/health", "router": "/healthz", "minimal": "/"}
TARGET_LABEL = {
    "engine": "engine direct",
    "router": "via router",
    "minimal": "minimal h11 server",  # bench/router_minimal_h11.py: the machine's yardstick
}
BUDGET_RSS_MIB = 200.0
HOLD_TOKENS = 600  # at 1 token/s a held stream would last 10 minutes
PROMPT = "Say something about foxes and dogs."


class BenchError(Exception):
    """The benchmark could not run (a process died, a port never opened, ...)."""


# --------------------------------------------------------------------------- processes


def raise_nofile_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard one; child processes inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _child_setup() -> None:
    # Inherited already; set again in case the parent could not, and undo an
    # ignored SIGINT that a non-interactive shell may have handed down.
    raise_nofile_limit()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Benchmark this checkout's code, whatever the virtualenv's editable install points at.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


STARTED: list[Proc] = []  # every process this run started, stopped at the end whatever happens


class Proc:
    """A started process whose output goes to a log file, and what /proc says about it."""

    def __init__(self, name: str, argv: list[str], url_pattern: str) -> None:
        self.name = name
        self.argv = argv
        self.url_pattern = re.compile(url_pattern)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_child_env(),
            preexec_fn=_child_setup,
            start_new_session=True,  # a Ctrl-C on the benchmark reaches only the benchmark
        )
        self.pid = self.popen.pid
        self.url = ""
        STARTED.append(self)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_url(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = self.url_pattern.search(self.log_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self.url
            if self.popen.poll() is not None:
                raise BenchError(
                    f"{self.name} exited with status {self.popen.returncode} before serving:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)
        raise BenchError(f"{self.name} printed no URL within {timeout} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_s(self) -> float:
        """user + sys CPU seconds of the process (all its threads), from /proc/PID/stat."""
        text = Path(f"/proc/{self.pid}/stat").read_text()
        fields = text[text.rindex(")") + 2 :].split()
        # fields[0] is the state (field 3 of proc(5)); utime and stime are fields 14 and 15.
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def status_kib(self, key: str) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise BenchError(f"no {key} in /proc/{self.pid}/status")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Signal the process and wait; kill it if it outstays `timeout`. Returns its status."""
        status: int | None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                status = self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
                status = None  # had to be killed
        else:
            status = self.popen.returncode
        if not self._log.closed:
            self._log.close()
        return status


def start_mock(name: str, *extra: str) -> Proc:
    proc = Proc(
        name,
        [sys.executable, "-m", "llmgw_mock_engine", "serve", MODEL,
         "--host", "127.0.0.1", "--port", "0", *extra],
        r"mock engine serving .* on (http://127\.0\.0\.1:\d+)",
    )
    proc.wait_url()
    return proc


def start_router(name: str, engine_url: str, profile: Path | None = None) -> Proc:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    config = LOG_DIR / f"{name}.toml"
    config.write_text(
        "# written by bench/router_bench.py\n"
        "[server]\n"
        'listen = "127.0.0.1:0"\n'
        "shutdown_grace_s = 2\n"
        "\n[[models]]\n"
        f'name = "{MODEL}"\n'
        f'endpoints = ["{engine_url}"]\n'
    )
    prefix = [sys.executable]
    if profile is not None:
        prefix += ["-m", "cProfile", "-o", str(profile)]
    proc = Proc(
        name,
        [*prefix, "-m", "llmgw_server", "--config", str(config)],
        r"listening on (http://127\.0\.0\.1:\d+)",
    )
    proc.wait_url()
    deadline = time.monotonic() + 15
    while True:  # ready once the first health probe round found the engine
        try:
            status, _, _ = http_request("GET", proc.url + "/readyz")
            if status == 200:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline or not proc.alive():
            raise BenchError(f"{name} never became ready:\n{proc.log_tail()}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- HTTP helpers


def machine_cpu() -> tuple[int, int, int]:
    """(all, idle, stolen) CPU ticks of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    fields += [0] * (8 - len(fields))
    # user nice system idle iowait irq softirq steal (guest time is counted in user)
    return sum(fields[:8]), fields[3] + fields[4], fields[7]


def _our_cpu_s(*procs: Proc) -> float:
    """CPU seconds of this benchmark: itself, the servers it runs and the wrk runs it waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime
    return total + sum(p.cpu_s() for p in procs if p.alive())


def _split(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def chat_body(stream: bool, max_tokens: int | None = None) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        body["stream"] = True
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def http_request(
    method: str,
    url: str,
    body: bytes | None = None,
    timeout: float = 10.0,
    extra: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    host, port = _split(url)
    path = urlsplit(url).path or "/"
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        headers.update(extra or {})
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        conn.close()


def sse_events(data: bytes) -> list[bytes]:
    """The `data:` payloads of a server-sent event stream, in order."""
    events = []
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            events.append(b"\n".join(lines))
    return events


@dataclass
class StreamShape:
    chunks: int  # data events before [DONE]
    done: bool
    content_type: str
    text: str


def stream_shape(base_url: str) -> StreamShape:
    status, headers, data = http_request(
        "POST", base_url + "/v1/chat/completions", chat_body(stream=True)
    )
    if status != 200:
        raise BenchError(f"stream from {base_url} answered {status}: {data[:300]!r}")
    events = sse_events(data)
    done = bool(events) and events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in (events[:-1] if done else events)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return StreamShape(len(chunks), done, headers.get("content-type", ""), text)


def plain_text(base_url: str) -> str:
    status, _, data = http_request("POST", base_url + "/v1/chat/completions", chat_body(False))
    if status != 200:
        raise BenchError(f"plain request to {base_url} answered {status}: {data[:300]!r}")
    return str(json.loads(data)["choices"][0]["message"]["content"])


def set_engine_pace(engine_url: str, tokens_per_second: float) -> None:
    body = json.dumps({"tokens_per_second": tokens_per_second}).encode()
    status, _, data = http_request("POST", engine_url + "/mock/control", body)
    if status != 200:
        raise BenchError(f"the engine refused its new pace: {status} {data[:200]!r}")


def prometheus_value(text: str, name: str) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def metric(url: str, name: str) -> float | None:
    try:
        status, _, data = http_request("GET", url + "/metrics", timeout=5)
    except OSError:
        return None
    return prometheus_value(data.decode(errors="replace"), name) if status == 200 else None


# --------------------------------------------------------------------------- wrk


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]
    raw: str

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def run_wrk(url: str, conns: int, duration_s: int, kind: str, threads: int) -> WrkResult:
    env = dict(
        os.environ,
        LLMGW_BENCH_MODEL=MODEL,
        LLMGW_BENCH_STREAM="0" if kind in ("plain", "static") else "1",
        LLMGW_BENCH_GET="1" if kind == "static" else "0",
    )
    argv = [
        "wrk", f"-t{min(threads, conns)}", f"-c{conns}", f"-d{duration_s}s", "--latency",
        "--timeout", "10s", "-s", str(WRK_SCRIPT), url,
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=duration_s + 30, check=False
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH ")), None)
    if done.returncode != 0 or line is None:
        raise BenchError(
            f"wrk failed (status {done.returncode}): {' '.join(argv)}\n{done.stdout}\n{done.stderr}"
        )
    r = json.loads(line[6:])
    errors = {k[4:]: int(v) for k, v in r.items() if k.startswith("err_")}
    return WrkResult(
        requests=int(r["requests"]),
        duration_s=r["duration_us"] / 1e6,
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        errors=errors,
        raw=done.stdout,
    )


@dataclass
class Row:
    target: str  # "engine" or "router"
    kind: str  # one of KINDS
    conns: int
    wrk: WrkResult
    router_ms: float | None  # router (or minimal server) CPU per request
    engine_ms: float | None  # engine CPU per request

    @property
    def verdict(self) -> str:
        if self.router_ms is None:
            return ""
        if self.kind == "static":
            return "(calibration)"
        if self.wrk.requests == 0 or self.wrk.error_count:
            return "FAIL"
        verdict = "PASS" if self.router_ms <= BUDGET_MS[self.kind] else "OVER"
        return verdict + " (info)" if self.kind == "paced" else verdict


def measure(
    target: str, url: str, kind: str, conns: int, args: argparse.Namespace,
    engine: Proc | None, router: Proc | None,
) -> Row:
    """One wrk run against `url`; `router` is the process held to the budget (or the
    minimal server), `engine` the one measured for context."""
    url += STATIC_PATH[target] if kind == "static" else "/v1/chat/completions"
    if args.warmup > 0:
        run_wrk(url, conns, args.warmup, kind, args.wrk_threads)
        time.sleep(0.2)
    router_before = router.cpu_s() if router else 0.0
    engine_before = engine.cpu_s() if engine else 0.0
    result = run_wrk(url, conns, args.duration, kind, args.wrk_threads)
    time.sleep(0.3)  # let the servers finish with the connections wrk closed
    requests = max(result.requests, 1)
    router_ms = (router.cpu_s() - router_before) * 1000 / requests if router else None
    engine_ms = (engine.cpu_s() - engine_before) * 1000 / requests if engine else None
    row = Row(target, kind, conns, result, router_ms, engine_ms)
    cpu = " ".join(
        f"{name} {ms:.3f} ms/req"
        for name, ms in (("minimal" if target == "minimal" else "router", router_ms),
                         ("engine", engine_ms))
        if ms is not None
    )
    print(
        f"  {target:7} {kind:6} c={conns:<3} {result.rps:8.0f} req/s  p50 {result.p50_ms:7.2f} ms"
        f"  p99 {result.p99_ms:7.2f} ms  {cpu}"
        + (f"  ERRORS {result.errors}" if result.error_count else ""),
        flush=True,
    )
    return row


# --------------------------------------------------------------------------- 1,000 open streams


@dataclass
class HoldResult:
    wanted: int
    first_chunk: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)  # the first few
    open_s: float = 0.0
    still_flowing: int = 0  # streams that received more chunks while held
    rss_idle_kib: int = 0
    rss_holding_kib: int = 0
    hwm_kib: int = 0
    router_fds: int = 0
    engine_rss_kib: int = 0
    hold_s: float = 0.0
    hold_cpu_s: float = 0.0
    chunks_relayed: int = 0
    router_in_flight: float | None = None
    engine_running: float | None = None
    router_in_flight_after: float | None = None
    engine_running_after: float | None = None
    drain_s: float | None = None
    router_alive: bool = True


async def hold_streams(
    router: Proc, engine: Proc, count: int, hold_s: float, timeout_s: float
) -> HoldResult:
    host, port = _split(router.url)
    body = chat_body(stream=True)
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    result = HoldResult(wanted=count)
    result.rss_idle_kib = router.status_kib("VmRSS")
    limiter = trio.CapacityLimiter(64)  # connects in flight at once
    settled = trio.Event()
    pending = count
    later_chunks = [0] * count

    def one_settled() -> None:
        nonlocal pending
        pending -= 1
        if pending == 0:
            settled.set()

    async def client(i: int) -> None:
        stream: trio.SocketStream | None = None
        first = False
        try:
            async with limiter:
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all(request)
                conn = h11.Connection(h11.CLIENT)
                got_head = got_chunk = False
                while not got_chunk:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await stream.receive_some(65536)
                        if not data:
                            raise BenchError("connection closed before the first chunk")
                        conn.receive_data(data)
                    elif isinstance(event, h11.Response):
                        if event.status_code != 200:
                            raise BenchError(f"status {event.status_code}")
                        got_head = True
                    elif isinstance(event, h11.Data) and got_head:
                        got_chunk = b"data:" in bytes(event.data)
                    elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                        raise BenchError("the answer ended before its first chunk")
            result.first_chunk += 1
            first = True
            one_settled()
            while True:  # keep draining what the router relays, as a client would
                data = await stream.receive_some(65536)
                if not data:
                    raise BenchError("the router closed a held stream")
                later_chunks[i] += data.count(b"data:")
        except (OSError, trio.BrokenResourceError, h11.ProtocolError, BenchError) as exc:
            result.failed += 1
            if len(result.failures) < 5:
                result.failures.append(
                    f"stream {i} {'after' if first else 'before'} its first chunk: "
                    f"{type(exc).__name__}: {exc}"
                )
            if not first:
                one_settled()
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    started = time.monotonic()
    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(client, i)
        with trio.move_on_after(timeout_s):
            await settled.wait()
        result.open_s = time.monotonic() - started
        await trio.sleep(1.0)  # let memory settle
        counted = sum(later_chunks)
        cpu_before = router.cpu_s()
        hold_started = time.monotonic()
        await trio.sleep(hold_s)
        result.hold_cpu_s = router.cpu_s() - cpu_before
        result.hold_s = time.monotonic() - hold_started
        result.chunks_relayed = sum(later_chunks) - counted
        result.still_flowing = sum(1 for n in later_chunks if n > 0)
        result.rss_holding_kib = router.status_kib("VmRSS")
        result.hwm_kib = router.status_kib("VmHWM")
        result.router_fds = router.open_fds()
        result.engine_rss_kib = engine.status_kib("VmRSS")
        result.router_in_flight = await trio.to_thread.run_sync(
            metric, router.url, "llmgw_requests_in_flight"
        )
        result.engine_running = await trio.to_thread.run_sync(
            metric, engine.url, "vllm:num_requests_running"
        )
        nursery.cancel_scope.cancel()  # every client closes its connection
    # A client that goes away must cancel its upstream request at once.
    closed = time.monotonic()
    while time.monotonic() - closed < 10:
        r_in = await trio.to_thread.run_sync(metric, router.url, "llmgw_requests_in_flight")
        e_run = await trio.to_thread.run_sync(metric, engine.url, "vllm:num_requests_running")
        result.router_in_flight_after, result.engine_running_after = r_in, e_run
        if r_in == 0 and e_run == 0:
            result.drain_s = time.monotonic() - closed
            break
        await trio.sleep(0.1)
    result.hwm_kib = router.status_kib("VmHWM")
    result.router_alive = router.alive()
    return result


# --------------------------------------------------------------------------- report


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def _fmt_ms(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def environment_lines(
    args: argparse.Namespace, shape: dict[str, StreamShape], load: dict[str, float]
) -> list[str]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    wrk_version = subprocess.run(
        ["wrk", "-v"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()
    lines = [
        f"- Machine: {os.cpu_count()} CPUs ({cpu or platform.machine()}), "
        f"Linux {platform.release()}; the budgets are for a 2-core machine",
        f"- Code: llmgw {commit or '?'}; Python {platform.python_version()}, "
        f"trio {trio.__version__}, h11 {_version('h11')}; "
        f"{wrk_version[0] if wrk_version else 'wrk'}",
        f"- Load: `wrk -t{args.wrk_threads} -c<conns> -d{args.duration:g}s --latency` "
        f"with bench/wrk/chat.lua, after a {args.warmup:g} s warm-up run of the same shape; "
        "everything (wrk, router, engine) shares this machine's CPUs over loopback",
        "- Router CPU per request: user + sys ticks of the router process "
        f"(/proc/PID/stat, {CLK_TCK} ticks/s) over the run, divided by the requests wrk completed",
    ]
    if load:
        lines.append(
            f"- Machine during the wrk runs: {load['busy']:.0f}% busy, of which "
            f"{load['others']:.0f}% by processes other than this benchmark's; "
            f"{load['steal']:.1f}% stolen by the hypervisor (from /proc/stat). "
            "Other load makes the figures move by 10-50% between runs"
        )
    if shape:
        d, r = shape.get("engine"), shape.get("router")
        lines.append(
            f"- Stream shape: {d.chunks if d else '?'} data chunks direct, "
            f"{r.chunks if r else '?'} through the router (role chunk, {STREAM_TOKENS} tokens, "
            "finish chunk), then `data: [DONE]`; stream latency is to the last byte"
        )
    return lines


def render(
    args: argparse.Namespace,
    shape: dict[str, StreamShape],
    rows: list[Row],
    hold: HoldResult | None,
    notes: list[str],
    load: dict[str, float],
) -> str:
    out = ["# Router benchmark", "", f"Run at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.", ""]
    out += environment_lines(args, shape, load)
    out += ["", "## Throughput, latency and CPU per request", ""]
    out.append(
        "| path | answer | conns | req/s | p50 ms | p99 ms | errors "
        "| router CPU ms/req | budget ms/req | verdict | engine CPU ms/req |"
    )
    out.append("|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|")
    answer = {
        "static": "static GET",
        "plain": "plain",
        "stream": f"{EXPECTED_CHUNKS}-chunk stream",
        "paced": f"{EXPECTED_CHUNKS}-chunk stream, {args.paced_tps:g} tok/s",
    }
    for row in rows:
        w = row.wrk
        errors = str(w.error_count) if w.error_count else "0"
        if w.error_count:
            errors += " (" + ", ".join(f"{k} {v}" for k, v in w.errors.items() if v) + ")"
        out.append(
            f"| {TARGET_LABEL[row.target]} "
            f"| {answer[row.kind]} | {row.conns} | {w.rps:.0f} | {w.p50_ms:.2f} | {w.p99_ms:.2f} "
            f"| {errors} | {_fmt_ms(row.router_ms)} "
            f"| {_budget(row)} "
            f"| {row.verdict} | {_fmt_ms(row.engine_ms)} |"
        )
    by_key = {(r.target, r.kind, r.conns): r for r in rows}
    overhead = []
    for kind in KINDS[1:]:  # the static pages are not proxied
        for conns in args.conns:
            d, r = by_key.get(("engine", kind, conns)), by_key.get(("router", kind, conns))
            if d and r and d.wrk.p50_ms and d.wrk.rps:
                overhead.append(
                    f"{kind} c={conns}: p50 {r.wrk.p50_ms - d.wrk.p50_ms:+.2f} ms, "
                    f"req/s x{r.wrk.rps / d.wrk.rps:.2f}"
                )
    if overhead:
        out += ["", "Through the router versus direct: " + "; ".join(overhead) + "."]
    out += _calibration(rows)
    if hold is not None:
        out += ["", f"## {hold.wanted:,} concurrent open streams", ""]
        out.append(
            f"A fresh router in front of a fresh engine that streams 1 token/s "
            f"(`--mock-tokens {HOLD_TOKENS} --mock-tokens-per-second 1`); "
            f"raw HTTP/1.1 clients on trio open the streams, read the first chunk, "
            f"keep reading for {hold.hold_s:.1f} s, then close."
        )
        out += ["", "| measure | value | budget | verdict |", "|---|--:|--:|---|"]
        got = hold.first_chunk == hold.wanted
        out.append(
            f"| streams that got their first chunk | {hold.first_chunk:,} / {hold.wanted:,} "
            f"(in {hold.open_s:.1f} s) | all | {'PASS' if got else 'FAIL'} |"
        )
        out.append(
            f"| streams still flowing while held | {hold.still_flowing:,} | all "
            f"| {'PASS' if hold.still_flowing == hold.wanted else 'FAIL'} |"
        )
        out.append(f"| router VmRSS before opening | {_mib(hold.rss_idle_kib)} | | |")
        out.append(f"| router VmRSS while holding | {_mib(hold.rss_holding_kib)} | | |")
        hwm_ok = hold.hwm_kib / 1024 <= BUDGET_RSS_MIB
        out.append(
            f"| router peak RSS (VmHWM) | {_mib(hold.hwm_kib)} | <= {BUDGET_RSS_MIB:.0f} MiB "
            f"| {'PASS' if hwm_ok and got else 'OVER' if not hwm_ok else 'FAIL'} |"
        )
        per_stream = (hold.rss_holding_kib - hold.rss_idle_kib) / max(hold.first_chunk, 1)
        out.append(f"| router memory per held stream | {per_stream:.1f} KiB | | |")
        out.append(f"| router open file descriptors | {hold.router_fds:,} | | |")
        if hold.hold_s:
            share = hold.hold_cpu_s / hold.hold_s * 100
            per_chunk = hold.hold_cpu_s * 1e6 / max(hold.chunks_relayed, 1)
            out.append(
                f"| router CPU while holding ({hold.chunks_relayed / hold.hold_s:.0f} chunks/s) "
                f"| {share:.0f}% of a core, {per_chunk:.0f} us per chunk | | |"
            )
        out.append(
            f"| in flight while holding: router / engine "
            f"| {_num(hold.router_in_flight)} / {_num(hold.engine_running)} | | |"
        )
        drained = hold.drain_s is not None
        out.append(
            f"| in flight after the clients closed: router / engine "
            f"| {_num(hold.router_in_flight_after)} / {_num(hold.engine_running_after)}"
            + (f" (after {hold.drain_s:.1f} s)" if drained else " (after 10 s)")
            + f" | 0 / 0 | {'PASS' if drained else 'FAIL'} |"
        )
        out.append(f"| engine VmRSS while holding (context) | {_mib(hold.engine_rss_kib)} | | |")
        if hold.failed:
            out += ["", f"{hold.failed} streams failed, for example: " + "; ".join(hold.failures)]
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def _calibration(rows: list[Row]) -> list[str]:
    """Scale the router's figures by how this machine compares with the issue's reference."""
    minimal = [r for r in rows if r.target == "minimal" and r.router_ms and not r.wrk.error_count]
    if not minimal:
        return []
    yardstick = max(minimal, key=lambda r: r.conns)  # many clients, as a throughput figure
    assert yardstick.router_ms is not None
    factor = yardstick.router_ms / STATIC_REFERENCE_MS
    scaled = [
        f"{r.kind} c={r.conns}: {r.router_ms / factor:.2f} ms (budget {BUDGET_MS[r.kind]})"
        for r in rows
        if r.target == "router" and r.kind in ("plain", "stream") and r.router_ms is not None
    ]
    lines = [
        "",
        f"Calibration: the minimal h11-on-trio server spent {yardstick.router_ms:.3f} ms "
        f"of CPU per static request at c={yardstick.conns}, where the issue's reference "
        f"machine spent {STATIC_REFERENCE_MS} ms: during this run, work cost {factor:.2f}x "
        "as much CPU here as on the reference.",
    ]
    if scaled:
        lines[-1] += (
            " Scaled by that factor, for comparison only (the verdicts above are as measured), "
            "the router's CPU per request would be: " + "; ".join(scaled) + "."
        )
    return lines


def _budget(row: Row) -> str:
    if row.router_ms is None:
        return ""
    if row.kind == "static":
        return f"ref. {STATIC_REFERENCE_MS}"
    return f"<= {BUDGET_MS[row.kind]}"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def print_profile(path: Path, limit: int = 25) -> None:
    if not path.exists():
        print(f"(no profile at {path}: did the router exit cleanly?)")
        return
    print(f"\n## Router profile ({path}), top {limit} by own time\n")
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(limit)
    print(f"\n## Router profile, top {limit} by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(limit)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up seconds per run (0: none)")
    p.add_argument("--conns", default="1,32", help="connection counts (default 1,32)")
    p.add_argument(
        "--kinds", default=",".join(KINDS),
        help="what to measure (default static,plain,stream,paced): a static GET answered\n"
        "by the server itself (calibration), plain chat completions, 50-chunk streams\n"
        "written as fast as the engine can, and the same streams paced at --paced-tps\n"
        "tokens/s (informational, not in the issue's budget)",
    )
    p.add_argument(
        "--paced-tps", type=float, default=1000.0,
        help="the engine's tokens/s per stream for the paced kind (default 1000)",
    )
    p.add_argument("--wrk-threads", type=int, default=1, help="wrk -t (default 1)")
    p.add_argument("--hold", type=int, default=1000, help="streams to hold open (0: skip)")
    p.add_argument("--hold-seconds", type=float, default=3.0, help="how long to hold them")
    p.add_argument(
        "--profile", type=Path, default=None,
        help="run the throughput router under cProfile, write the profile to this file and\n"
        "print its top functions (CPU figures are then inflated by the profiler)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a budget is OVER")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "router.md", help="results file")
    args = p.parse_args(argv)
    args.conns = [int(c) for c in str(args.conns).split(",") if c]
    args.kinds = [k for k in str(args.kinds).split(",") if k]
    if not set(args.kinds) <= set(KINDS):
        p.error(f"--kinds takes some of {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if shutil.which("wrk") is None:
        print("router_bench: wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    if not WRK_SCRIPT.exists():
        print(f"router_bench: {WRK_SCRIPT} is missing", file=sys.stderr)
        return 2
    soft, _ = raise_nofile_limit()
    needed = 3 * args.hold + 256  # the router holds two sockets per stream
    notes: list[str] = []
    if args.hold and soft != resource.RLIM_INFINITY and soft < needed:
        notes.append(f"RLIMIT_NOFILE is {soft}: too low for {args.hold} streams, lowered the hold")
        args.hold = max(0, (soft - 256) // 3)
    started = time.monotonic()
    rows: list[Row] = []
    shape: dict[str, StreamShape] = {}
    hold: HoldResult | None = None
    load: dict[str, float] = {}
    try:
        print(f"router_bench: logs in {LOG_DIR.relative_to(ROOT)}/", flush=True)
        engine = start_mock("engine", "--mock-tokens", str(STREAM_TOKENS))
        router = start_router("router", engine.url, args.profile)
        minimal = Proc(
            "minimal-h11",
            [sys.executable, str(ROOT / "bench" / "router_minimal_h11.py"), "--port", "0"],
            r"minimal h11 server on (http://127\.0\.0\.1:\d+)",
        )
        minimal.wait_url()
        print(f"  engine {engine.url} (pid {engine.pid}), router {router.url} (pid {router.pid})")

        for target, url in (("engine", engine.url), ("router", router.url)):
            shape[target] = stream_shape(url)
            s = shape[target]
            print(
                f"  {target}: a stream has {s.chunks} data chunks"
                f"{' + [DONE]' if s.done else ' and NO [DONE]'} ({s.content_type})"
            )
        if shape["engine"].text != shape["router"].text or not shape["router"].done:
            notes.append("the stream through the router differs from the engine's own stream")
        if shape["router"].chunks != EXPECTED_CHUNKS:
            notes.append(f"expected {EXPECTED_CHUNKS} chunks per stream, counted "
                         f"{shape['router'].chunks}")
        if plain_text(engine.url) != plain_text(router.url):
            notes.append("the plain answer through the router differs from the engine's own")

        print("throughput (wrk):", flush=True)
        cpu_before = machine_cpu()
        ours_before = _our_cpu_s(engine, router, minimal)
        for kind in args.kinds:
            pace = args.paced_tps if kind == "paced" else 0.0
            set_engine_pace(engine.url, pace)
            for conns in args.conns:
                if kind == "static":
                    rows.append(measure("minimal", minimal.url, kind, conns, args, None, minimal))
                rows.append(measure("engine", engine.url, kind, conns, args, engine, None))
                rows.append(measure("router", router.url, kind, conns, args, engine, router))
                if not router.alive():
                    raise BenchError(f"the router died:\n{router.log_tail()}")
        total, idle, steal = (b - a for a, b in zip(cpu_before, machine_cpu(), strict=True))
        ours = _our_cpu_s(engine, router, minimal) - ours_before
        total = max(total, 1)
        load = {
            "busy": 100 * (1 - idle / total),
            "steal": 100 * steal / total,
            "others": max(0.0, 100 * ((total - idle - steal) / CLK_TCK - ours) * CLK_TCK / total),
        }
        status = router.stop(signal.SIGTERM)
        if status != 0:
            notes.append(f"the router exited with status {status} on SIGTERM (expected 0)")
        engine.stop()
        minimal.stop()
        if args.profile is not None:
            print_profile(args.profile)

        if args.hold:
            print(f"holding {args.hold} open streams:", flush=True)
            slow = start_mock(
                "engine-slow", "--mock-tokens", str(HOLD_TOKENS), "--mock-tokens-per-second", "1"
            )
            hold_router = start_router("router-hold", slow.url)
            hold = trio.run(hold_streams, hold_router, slow, args.hold, args.hold_seconds, 60.0)
            print(
                f"  {hold.first_chunk}/{hold.wanted} streams got their first chunk in "
                f"{hold.open_s:.1f} s; router VmRSS {_mib(hold.rss_holding_kib)}, "
                f"VmHWM {_mib(hold.hwm_kib)}; engine VmRSS {_mib(hold.engine_rss_kib)}",
                flush=True,
            )
            if not hold.router_alive:
                notes.append(f"the router died while holding streams:\n{hold_router.log_tail()}")
            status = hold_router.stop(signal.SIGTERM)
            if status != 0:
                notes.append(f"the hold router exited with status {status} on SIGTERM")
    except BenchError as exc:
        print(f"router_bench: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in STARTED:
            if proc.alive():
                proc.stop(signal.SIGKILL if proc.name.startswith("engine") else signal.SIGTERM)

    notes.append(f"the whole benchmark took {time.monotonic() - started:.0f} s")
    if args.profile is not None:
        notes.append("the router ran under cProfile: its CPU figures are inflated")
    report = render(args, shape, rows, hold, notes, load)
    print("\n" + report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"written to {args.out}")
    over = [r for r in rows if r.verdict in ("OVER", "FAIL") or r.wrk.error_count]
    hold_bad = hold is not None and (
        hold.first_chunk != hold.wanted
        or hold.hwm_kib / 1024 > BUDGET_RSS_MIB
        or hold.drain_s is None
    )
    return 1 if args.strict and (over or hold_bad) else 0


if __name__ == "__main__":
    sys.exit(main())
