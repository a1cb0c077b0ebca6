#!/usr/bin/env python3
"""Stream migration benchmark (issue 39): what a replica killed mid-stream costs the
streams that went through it, with the router's migration on and off, and what keeping
streams so that they can be continued costs the router.

Run it from the repository root with the project's virtualenv:

    .venv/bin/python bench/migration_bench.py            # defaults (~2.5 min on 2 cores)
    .venv/bin/python bench/migration_bench.py --quick    # a smoke run (under a minute)
    .venv/bin/python bench/migration_bench.py --help

What it starts, all real processes on 127.0.0.1 (free ports), logs in a temporary folder
(kept, and named at the end): for each variant afresh, 3 paced mock engines
(`python -m llmgw_mock_engine serve m --mock-tokens N --mock-tokens-per-second R`: each
word of a streamed answer after a sleep of 1/R, the text `answer_text(body, N)`, a
continuation (`continue_final_message`) answered with the words after the ones it names)
and one router (`python -m llmgw_server --config FILE`, one worker, `balancing =
"round_robin"`, `migrate_seam_comment = true`; migration off is `migrate_max = 0`). The
client is this process: trio + httpx.AsyncClient, chat completions streamed with
`stream_options.include_usage`, each with its own prompt; each SSE event is stamped with
time.monotonic() when the bytes that complete it arrive.

1. Kill (variants `on` and `off`, the same schedule): --streams (S, 60) concurrent streams
   of --tokens (T, 100) tokens at --rate (R, 25) tokens/s, spread by round robin over the
   3 replicas; once every stream has had its first event (30 s at most) and --kill-at
   (0.4) of a stream's T/R has passed since they were sent, replica 0 is SIGKILLed (not
   restarted).
   - The seam: a migrated stream is one with a `: migrated` comment. Its added gap is the
     time from the last data event before the comment to the first one after it, less
     that stream's median gap between data events (the seam's left out): the router
     seeing the connection die, connecting to another replica, the continuation's prefill
     (none in the mock) and its first token. Since the engine dies at a random point
     between two tokens, the gap holds on average half a token's pace (0.5/R) of the dead
     engine's own. So the second figure: from the SIGKILL to the stream's next data event,
     less one median gap (what the router and the next replica add). p50 and p99 over the
     migrated streams (nearest rank), and their count; and the router's own count
     (llmgw_stream_migrations_total, by outcome).
   - Failed streams: a client-visible error: an answer other than 200, a connection error
     (httpx), an error event, no `data: [DONE]`, a text other than answer_text(body, T),
     a usage whose completion_tokens is not T.
2. Keep (variants `on` and `off`, no kill): --keep-streams (S, 60) concurrent streams of
   --keep-tokens (2,000) tokens at --keep-rate (50) tokens/s, their starts spread over
   --keep-stagger-s (1.5 s, so that the streams' keepers do not all compact at once: a
   kept stream reads its raw bytes once they pass 8 KiB, about 40 of the mock's chat
   events). First a warm-up of S short streams (8 tokens), then the router's idle RSS
   (VmRSS of /proc/PID/status, summed over the router's process tree) and CPU time
   (utime + stime of /proc/PID/stat). While the streams run, the RSS is sampled every
   --sample-s (0.2 s) with the events the client has had so far; reported: the RSS
   growth over the idle at the first sample where the client had --rss-at (90%) of the
   streams' events (the kept text is then near its largest), the largest growth of any
   sample, the CPU time from the first stream sent to the last one's end, and that CPU
   per streamed token. Then the cost per kept stream: (on - off) / S bytes of RSS, and
   (on - off) / (S x tokens) CPU microseconds per token. RSS counts what the allocator
   holds: memory freed by a compaction (the raw bytes read into text) that it keeps for
   reuse still counts.

Each variant's machine busy-ness (the /proc/stat busy share of all cores while it ran)
and the CPU of the engines and of this client are reported beside it: on a shared machine
the figures move with the neighbours' load. With --rounds N each phase runs N times,
variants alternating; the kill phase's seams and failures are pooled, the keep phase's
figures are the medians of the rounds. Results: a markdown table to stdout and
bench/results/migration.md, and migration.json (the figures, the command line, the
parameters), or under --out. Exit status: 0 when it ran, 2 when it could not run; with
--strict 1 when a stream failed with migration on or none failed with it off.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from llmgw_mock_engine.engine import answer_text  # noqa: E402

sys.path.insert(0, str(HERE))
from tenancy_bench import free_port, percentile, progress, raise_nofile  # noqa: E402

RESULTS_DIR = HERE / "results"
MODEL = "m"
REPLICAS = 3
CHAT = "/v1/chat/completions"
SEAM = ": migrated"
TICK = os.sysconf("SC_CLK_TCK")
WARMUP_TOKENS = 8
VARIANTS = ("on", "off")


# -- arithmetic and parsing (pure; tests/test_migration_bench.py) -------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole SSE events at the start of `buffer`, and the part of one that follows."""
    *events, rest = buffer.split(b"\n\n")
    return events, rest


@attrs.frozen
class Item:
    """One line of a stream that matters here: a data event (its JSON), a comment, [DONE]."""

    t: float
    kind: str  # "data", "comment", "done"
    value: Any = None  # the data event's JSON, or the comment's line


def items_of(events: Sequence[tuple[float, bytes]]) -> list[Item]:
    items: list[Item] = []
    for t, event in events:
        for line in event.split(b"\n"):
            if line.startswith(b":"):
                items.append(Item(t, "comment", line.decode(errors="replace")))
            elif line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    items.append(Item(t, "done"))
                elif payload:
                    try:
                        items.append(Item(t, "data", json.loads(payload)))
                    except ValueError:
                        items.append(Item(t, "data", None))
    return items


def chat_text(items: Sequence[Item]) -> str:
    pieces = []
    for item in items:
        if item.kind == "data" and isinstance(item.value, dict):
            for choice in item.value.get("choices") or []:
                pieces.append(((choice or {}).get("delta") or {}).get("content") or "")
    return "".join(pieces)


def failure_of(status: int | None, connection_error: str | None, items: Sequence[Item],
               expected_text: str, tokens: int) -> str | None:  # fmt: skip
    """What the client saw go wrong with a stream, or None when it came whole."""
    if connection_error is not None:
        return "connection error"
    if status != 200:
        return "status"
    data = [item.value for item in items if item.kind == "data"]
    if any(not isinstance(d, dict) or "error" in d for d in data):
        return "error event"
    if not any(item.kind == "done" for item in items):
        return "no [DONE]"
    if chat_text(items) != expected_text:
        return "wrong text"
    usage = [d["usage"] for d in data if isinstance(d, dict) and d.get("usage")]
    if len(usage) != 1 or usage[0].get("completion_tokens") != tokens:
        return "wrong usage"
    return None


@attrs.frozen
class SeamGap:
    before: float  # the last data event before the seam
    after: float  # the first one after it
    usual: float  # the stream's median gap between data events, the seam's left out

    @property
    def added(self) -> float:
        return self.after - self.before - self.usual


def seam_gaps(items: Sequence[Item]) -> list[SeamGap]:
    """Each `: migrated` seam of a stream, between two data events."""
    times: list[float] = []
    seams: list[int] = []  # the index in `times` of the first data event after a seam
    for item in items:
        if item.kind == "data":
            times.append(item.t)
        elif item.kind == "comment" and item.value == SEAM:
            seams.append(len(times))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    usual = median([g for i, g in enumerate(gaps) if i + 1 not in seams])
    return [SeamGap(times[s - 1], times[s], usual) for s in seams if 0 < s < len(times)]


# -- processes ----------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def tree(root: int) -> list[int]:
    """A live process and its live descendants."""
    children = _children()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) of the processes, from /proc/PID/stat."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def status_bytes(pids: Sequence[int], field: str) -> int:
    """A /proc/PID/status field in kB (VmRSS, VmHWM), summed, in bytes."""
    total = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


class Meter:
    """The machine's busy share, and CPU seconds of processes, between start and stop."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.busy = machine_busy()
        self.engines = cpu_s([p.pid for p in fleet.engines])
        self.client = time.process_time()

    def stop(self) -> dict[str, float]:
        busy, total = machine_busy()
        return {
            "machine_busy": (busy - self.busy[0]) / max(total - self.busy[1], 1.0),
            "engines_cpu_s": cpu_s([p.pid for p in self.fleet.engines]) - self.engines,
            "client_cpu_s": time.process_time() - self.client,
        }


def answers(port: int, path: str) -> int | None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


class _Exited(Exception):
    pass


class Fleet:
    """3 mock engines and a router in front of them, for one variant."""

    def __init__(self, work: Path, name: str, tokens: int, rate: float, migrate: bool) -> None:
        self.work = work
        self.name = name
        self.engine_flags = ["--mock-tokens", str(tokens), "--mock-tokens-per-second", f"{rate:g}"]
        self.migrate = migrate
        self.engines: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.url = ""

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p
        )}  # fmt: skip
        with log.open("ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=raise_nofile,
                start_new_session=True,
            )

    def start(self, tries: int = 3) -> None:
        """Start the processes, again on other ports where one exited (its free port
        taken between the check and its bind, on a machine shared with other tests)."""
        for attempt in range(tries):
            try:
                self._start()
                return
            except _Exited as exc:
                self.stop()
                self.engines, self.ports, self.router = [], [], None
                if attempt == tries - 1:
                    raise RuntimeError(str(exc)) from None
                progress(f"{exc}: starting {self.name} again")

    def _start(self, timeout_s: float = 60.0) -> None:
        for k in range(REPLICAS):
            port = free_port()
            self.ports.append(port)
            self.engines.append(self._spawn(
                [sys.executable, "-m", "llmgw_mock_engine", "serve", MODEL, "--host",
                 "127.0.0.1", "--port", str(port), *self.engine_flags],
                self.work / f"{self.name}-engine-{k}.log",
            ))  # fmt: skip
        router_port = free_port()
        endpoints = ", ".join(f'"http://127.0.0.1:{p}"' for p in self.ports)
        config = self.work / f"{self.name}-router.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{router_port}"\n'
            '[router]\nbalancing = "round_robin"\nmigrate_seam_comment = true\n'
            + ("" if self.migrate else "migrate_max = 0\n")
            + f'[[models]]\nname = "{MODEL}"\nendpoints = [{endpoints}]\n'
        )
        self.router = self._spawn(
            [sys.executable, "-m", "llmgw_server", "--config", str(config)],
            self.work / f"{self.name}-router.log",
        )
        self.url = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + timeout_s
        waits = [(p, port, "/health") for p, port in zip(self.engines, self.ports, strict=True)]
        waits.append((self.router, router_port, "/readyz"))
        for proc, port, path in waits:
            while answers(port, path) != 200:
                if proc.poll() is not None:
                    raise _Exited(f"{proc.args!r} exited {proc.returncode} (logs: {self.work})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"127.0.0.1:{port}{path} never answered 200")
                time.sleep(0.05)

    def router_pids(self) -> list[int]:
        assert self.router is not None
        return tree(self.router.pid)

    def kill(self, k: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.engines[k].pid, signal.SIGKILL)

    def stop(self) -> None:
        procs = [p for p in [*self.engines, self.router] if p is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


# -- the client ---------------------------------------------------------------------------


def body_of(i: int, phase: str, max_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"migration bench {phase} stream {i}"}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


@attrs.define
class Stream:
    """One stream as the client had it: its events stamped on arrival (or, kept=False,
    only its bytes)."""

    body: dict[str, Any]
    status: int | None = None
    connection_error: str | None = None
    events: list[tuple[float, bytes]] = attrs.field(factory=list)
    chunks: list[bytes] = attrs.field(factory=list)
    sent: float = 0.0

    def items(self) -> list[Item]:
        if self.chunks:
            events, _ = split_events(b"".join(self.chunks))
            return items_of([(0.0, e) for e in events])
        return items_of(self.events)


class Counter:
    def __init__(self) -> None:
        self.events = 0
        self.first = 0  # streams that have had their first event


async def read_stream(
    client: httpx.AsyncClient, url: str, stream: Stream, counter: Counter, stamp: bool
) -> None:
    stream.sent = time.monotonic()
    try:
        async with client.stream("POST", url + CHAT, json=stream.body) as answer:
            stream.status = answer.status_code
            rest = b""
            first = True
            async for chunk in answer.aiter_bytes():
                now = time.monotonic()
                if stamp:
                    events, rest = split_events(rest + chunk)
                    stream.events.extend((now, e) for e in events)
                    counter.events += len(events)
                else:
                    stream.chunks.append(chunk)
                    counter.events += chunk.count(b"\n\n")
                if first:
                    first = False
                    counter.first += 1
            if stamp and rest.strip():
                stream.events.append((time.monotonic(), rest))
    except httpx.HTTPError as exc:
        stream.connection_error = f"{type(exc).__name__}: {exc}"


def client_for(streams: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=30.0), limits=limits)


def migrations(url: str) -> dict[str, float]:
    """The router's llmgw_stream_migrations_total, by outcome."""
    try:
        page = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("llmgw_stream_migrations_total{"):
            key, _, value = line.rpartition(" ")
            outcome = key.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


# -- the phases ---------------------------------------------------------------------------


async def kill_phase(args: argparse.Namespace, work: Path, variant: str, k: int) -> dict[str, Any]:
    fleet = Fleet(work, f"kill-{variant}-{k}", args.tokens, args.rate, variant == "on")
    fleet.start()
    try:
        meter = Meter(fleet)
        streams = [Stream(body_of(i, "kill")) for i in range(args.streams)]
        counter = Counter()
        duration = args.tokens / args.rate
        killed = all_started = math.nan
        started = time.monotonic()

        async def killer() -> None:
            nonlocal killed, all_started
            # Every stream streaming first (on a loaded machine that can take longer than
            # a stream's own length): one not yet answered would be retried, not broken.
            with trio.move_on_after(30.0):
                while counter.first < len(streams):
                    await trio.sleep(0.01)
            all_started = time.monotonic()
            await trio.sleep(max(0.0, started + args.kill_at * duration - time.monotonic()))
            fleet.kill(0)
            killed = time.monotonic()

        with trio.fail_after(duration * 4 + 60):
            async with client_for(args.streams) as client, trio.open_nursery() as nursery:
                nursery.start_soon(killer)
                for stream in streams:
                    nursery.start_soon(read_stream, client, fleet.url, stream, counter, True)
        wall = time.monotonic() - started
        meters = meter.stop()
        by_router = migrations(fleet.url)
    finally:
        fleet.stop()
    failures: dict[str, int] = {}
    gaps: list[SeamGap] = []
    after_kill: list[float] = []
    usual: list[float] = []
    migrated = 0
    for stream in streams:
        items = stream.items()
        why = failure_of(stream.status, stream.connection_error, items,
                         answer_text(stream.body, args.tokens), args.tokens)  # fmt: skip
        if why is not None:
            failures[why] = failures.get(why, 0) + 1
        seams = seam_gaps(items)
        if any(i.kind == "comment" and i.value == SEAM for i in items):
            migrated += 1
        gaps.extend(seams)
        after_kill.extend(g.after - killed - g.usual for g in seams)
        usual.extend(g.usual for g in seams)
    return {
        "variant": variant,
        "round": k,
        "streams": len(streams),
        "failed": sum(failures.values()),
        "failures": failures,
        "migrated_streams": migrated,
        "seam_added_ms": [g.added * 1000 for g in gaps],
        "kill_to_next_ms": [x * 1000 for x in after_kill],
        "usual_gap_ms": [x * 1000 for x in usual],
        "all_streaming_after_s": all_started - started,
        "killed_after_s": killed - started,
        "router_migrations": by_router,
        "wall_s": wall,
        **meters,
    }


async def keep_phase(args: argparse.Namespace, work: Path, variant: str, k: int) -> dict[str, Any]:
    fleet = Fleet(work, f"keep-{variant}-{k}", args.keep_tokens, args.keep_rate, variant == "on")
    fleet.start()
    try:
        s = args.keep_streams
        async with client_for(s) as client:
            warm = [Stream(body_of(i, "warm", WARMUP_TOKENS)) for i in range(s)]
            async with trio.open_nursery() as nursery:
                for stream in warm:
                    nursery.start_soon(read_stream, client, fleet.url, stream, Counter(), False)
            await trio.sleep(0.5)
            pids = fleet.router_pids()
            idle_rss = status_bytes(pids, "VmRSS")
            cpu0 = cpu_s(pids)
            meter = Meter(fleet)
            streams = [Stream(body_of(i, "keep")) for i in range(s)]
            counter = Counter()
            samples: list[tuple[float, int, int]] = []  # (t, events so far, RSS)
            expected = s * (args.keep_tokens + 3)  # role, tokens, finish, usage
            started = time.monotonic()

            async def sampler() -> None:
                while True:
                    samples.append((time.monotonic() - started, counter.events,
                                    status_bytes(pids, "VmRSS")))  # fmt: skip
                    await trio.sleep(args.sample_s)

            async def staggered(i: int, stream: Stream) -> None:
                await trio.sleep(args.keep_stagger_s * i / max(s - 1, 1))
                await read_stream(client, fleet.url, stream, counter, False)

            timeout = args.keep_tokens / args.keep_rate * 3 + 60
            with trio.fail_after(timeout):
                async with trio.open_nursery() as outer:
                    outer.start_soon(sampler)
                    async with trio.open_nursery() as nursery:
                        for i, stream in enumerate(streams):
                            nursery.start_soon(staggered, i, stream)
                    outer.cancel_scope.cancel()
            wall = time.monotonic() - started
            cpu = cpu_s(pids) - cpu0
            meters = meter.stop()
            peak_rss = max(x[2] for x in samples)
            hwm = status_bytes(pids, "VmHWM")
    finally:
        fleet.stop()
    at = next((x for x in samples if x[1] >= args.rss_at * expected), samples[-1])
    failures: dict[str, int] = {}
    for stream in streams:
        why = failure_of(stream.status, stream.connection_error, stream.items(),
                         answer_text(stream.body, args.keep_tokens), args.keep_tokens)  # fmt: skip
        if why is not None:
            failures[why] = failures.get(why, 0) + 1
    tokens = s * args.keep_tokens
    return {
        "variant": variant,
        "round": k,
        "streams": s,
        "tokens": tokens,
        "failed": sum(failures.values()),
        "failures": failures,
        "router_processes": len(pids),
        "idle_rss_bytes": idle_rss,
        "rss_growth_bytes": at[2] - idle_rss,
        "rss_sampled_at_s": at[0],
        "rss_sampled_at_share": at[1] / expected,
        "peak_growth_bytes": peak_rss - idle_rss,
        "router_hwm_bytes": hwm,
        "router_cpu_s": cpu,
        "cpu_us_per_token": cpu / tokens * 1e6,
        "wall_s": wall,
        **meters,
    }


# -- the report ---------------------------------------------------------------------------


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Per variant: the kill phase pooled over rounds, the keep phase's medians; then the
    cost per kept stream."""
    summary: dict[str, Any] = {"kill": {}, "keep": {}}
    for variant in VARIANTS:
        runs = [r for r in out["kill"] if r["variant"] == variant]
        if runs:
            added = [x for r in runs for x in r["seam_added_ms"]]
            after = [x for r in runs for x in r["kill_to_next_ms"]]
            failures: dict[str, int] = {}
            for r in runs:
                for why, n in r["failures"].items():
                    failures[why] = failures.get(why, 0) + n
            routed: dict[str, float] = {}
            for r in runs:
                for outcome, n in r["router_migrations"].items():
                    routed[outcome] = routed.get(outcome, 0.0) + n
            summary["kill"][variant] = {
                "rounds": len(runs),
                "streams": sum(r["streams"] for r in runs),
                "failed": sum(r["failed"] for r in runs),
                "failures": failures,
                "migrated_streams": sum(r["migrated_streams"] for r in runs),
                "seams": len(added),
                "seam_added_p50_ms": percentile(added, 50),
                "seam_added_p99_ms": percentile(added, 99),
                "kill_to_next_p50_ms": percentile(after, 50),
                "kill_to_next_p99_ms": percentile(after, 99),
                "usual_gap_p50_ms": percentile([x for r in runs for x in r["usual_gap_ms"]], 50),
                "router_migrations": routed,
                "killed_after_s": median([r["killed_after_s"] for r in runs]),
                "machine_busy": median([r["machine_busy"] for r in runs]),
                "wall_s": median([r["wall_s"] for r in runs]),
            }
        runs = [r for r in out["keep"] if r["variant"] == variant]
        if runs:
            keys = ("rss_growth_bytes", "peak_growth_bytes", "idle_rss_bytes", "router_cpu_s",
                    "cpu_us_per_token", "machine_busy", "engines_cpu_s", "client_cpu_s",
                    "wall_s", "rss_sampled_at_share")  # fmt: skip
            row: dict[str, Any] = {k: median([r[k] for r in runs]) for k in keys}
            row.update(rounds=len(runs), streams=runs[0]["streams"], tokens=runs[0]["tokens"],
                       failed=sum(r["failed"] for r in runs))  # fmt: skip
            summary["keep"][variant] = row
    keep = summary["keep"]
    if "on" in keep and "off" in keep:
        s = keep["on"]["streams"]
        summary["per_kept_stream"] = {
            "rss_bytes": (keep["on"]["rss_growth_bytes"] - keep["off"]["rss_growth_bytes"]) / s,
            "peak_bytes": (keep["on"]["peak_growth_bytes"] - keep["off"]["peak_growth_bytes"]) / s,
            "cpu_us_per_token": keep["on"]["cpu_us_per_token"] - keep["off"]["cpu_us_per_token"],
        }
    return summary


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.1f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def report(out: dict[str, Any]) -> str:
    a = out["parameters"]
    summary = out["summary"]
    lines = [
        "# Stream migration benchmark (bench/migration_bench.py)",
        "",
        f"Run {out['date']} on {out['cores']} cores (load average {out['loadavg'][0]:.2f} "
        f"at the start), {out['wall_s']:.0f} s in all. Command: `{out['command']}`",
        "",
    ]
    if summary["kill"]:
        lines += [
            f"## Streams through a replica kill ({a['rounds']} round(s) a variant)",
            "",
            f"{REPLICAS} mock replicas, round robin; {a['streams']} concurrent chat streams of "
            f"{a['tokens']} tokens at {a['rate']:g} tokens/s; replica 0 SIGKILLed once every "
            f"stream had its first event and {a['kill_at']:g} of a stream's "
            f"{a['tokens'] / a['rate']:g} s had passed. Added gap: the gap across the "
            "`: migrated` seam less the stream's median gap between data events; "
            "kill to next: from the SIGKILL to the stream's next data event, less that median.",
            "",
            "| migration | streams | failed | failures | migrated streams | router: migrations "
            "| added gap p50 / p99 ms | kill to next p50 / p99 ms | median gap ms "
            "| killed after s | machine busy | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant, k in summary["kill"].items():
            failures = ", ".join(f"{n} {why}" for why, n in sorted(k["failures"].items())) or "-"
            routed = ", ".join(f"{int(n)} {o}" for o, n in sorted(k["router_migrations"].items()))
            lines.append(
                f"| {variant} | {k['streams']} | {k['failed']} | {failures} | "
                f"{k['migrated_streams']} | {routed or '-'} | {_ms(k['seam_added_p50_ms'])} / "
                f"{_ms(k['seam_added_p99_ms'])} | {_ms(k['kill_to_next_p50_ms'])} / "
                f"{_ms(k['kill_to_next_p99_ms'])} | {_ms(k['usual_gap_p50_ms'])} | "
                f"{k['killed_after_s']:.2f} | {k['machine_busy']:.0%} | {k['wall_s']:.1f} |"
            )
        lines.append("")
    if summary["keep"]:
        lines += [
            f"## The router's cost per kept stream ({a['rounds']} round(s) a variant, medians)",
            "",
            f"{a['keep_streams']} concurrent chat streams of {a['keep_tokens']} tokens at "
            f"{a['keep_rate']:g} tokens/s (starts spread over {a['keep_stagger_s']:g} s), no "
            f"kill. RSS growth: the router's RSS over its idle (after a warm-up) when the "
            f"client had {a['rss_at']:.0%} of the streams' events; peak: the largest growth "
            "sampled. CPU: the router's, from the first stream sent to the last one's end.",
            "",
            "| migration | streams | tokens | failed | idle RSS MiB | RSS growth MiB | peak "
            "growth MiB | router CPU s | CPU us/token | engines CPU s | client CPU s "
            "| machine busy | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for variant, k in summary["keep"].items():
            lines.append(
                f"| {variant} | {k['streams']} | {k['tokens']:,} | {k['failed']} | "
                f"{_mib(k['idle_rss_bytes'])} | {_mib(k['rss_growth_bytes'])} | "
                f"{_mib(k['peak_growth_bytes'])} | {k['router_cpu_s']:.2f} | "
                f"{k['cpu_us_per_token']:.1f} | {k['engines_cpu_s']:.2f} | "
                f"{k['client_cpu_s']:.2f} | {k['machine_busy']:.0%} | {k['wall_s']:.1f} |"
            )
        per = summary.get("per_kept_stream")
        if per:
            lines += [
                "",
                f"Per kept stream (on - off): {per['rss_bytes']:,.0f} bytes of RSS at "
                f"{a['rss_at']:.0%} of its tokens ({per['peak_bytes']:,.0f} at the peak); "
                f"{per['cpu_us_per_token']:.1f} CPU microseconds per streamed token.",
            ]
        lines.append("")
    return "\n".join(lines)


def jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


async def main_async(args: argparse.Namespace) -> int:
    raise_nofile()
    work = Path(tempfile.mkdtemp(prefix="llmgw-migration-bench-"))
    started = time.monotonic()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "kill": [],
        "keep": [],
    }
    try:
        for k in range(args.rounds):
            order = VARIANTS if k % 2 == 0 else VARIANTS[::-1]
            for phase, run in (("kill", kill_phase), ("keep", keep_phase)):
                if phase not in args.phases:
                    continue
                for variant in order:
                    progress(f"{phase} phase, migration {variant}, round {k + 1}/{args.rounds}")
                    out[phase].append(await run(args, work, variant, k))
    except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
        progress(f"could not run: {exc!r}; logs in {work}")
        return 2
    out["wall_s"] = time.monotonic() - started
    out["parameters"] = {k: v for k, v in vars(args).items() if k != "out"}
    out["summary"] = summarize(out)
    text = report(out)
    print(text)
    results: Path = args.out
    results.mkdir(parents=True, exist_ok=True)
    (results / "migration.md").write_text(text + "\n")
    (results / "migration.json").write_text(json.dumps(jsonable(out), indent=1) + "\n")
    progress(f"logs kept in {work}; results in {results}/migration.md and migration.json")
    kill = out["summary"]["kill"]
    if args.strict and (
        kill.get("on", {}).get("failed", 0) != 0 or kill.get("off", {}).get("failed", 1) == 0
    ):
        return 1
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a stream failed with migration on, or none off")  # fmt: skip
    parser.add_argument("--phases", default="kill,keep", help="comma-separated: kill, keep")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant")
    parser.add_argument("--streams", type=int, default=None, help="kill phase (60; quick 20)")
    parser.add_argument("--tokens", type=int, default=None, help="kill phase (100; quick 60)")
    parser.add_argument("--rate", type=float, default=None, help="kill phase tokens/s (25; 30)")
    parser.add_argument("--kill-at", type=float, default=0.4,
                        help="the kill, as a share of a stream's tokens/rate")  # fmt: skip
    parser.add_argument("--keep-streams", type=int, default=None, help="keep phase (60; 20)")
    parser.add_argument("--keep-tokens", type=int, default=None, help="(2000; quick 1000)")
    parser.add_argument("--keep-rate", type=float, default=None, help="tokens/s (50; 100)")
    parser.add_argument("--keep-stagger-s", type=float, default=1.5)
    parser.add_argument("--rss-at", type=float, default=0.9,
                        help="the share of the streams' events at which RSS is read")  # fmt: skip
    parser.add_argument("--sample-s", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="the results' folder")
    args = parser.parse_args(argv)
    defaults = {
        "streams": (60, 20),
        "tokens": (100, 60),
        "rate": (25.0, 30.0),
        "keep_streams": (60, 20),
        "keep_tokens": (2000, 1000),
        "keep_rate": (50.0, 100.0),
    }
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.phases = [p for p in args.phases.split(",") if p]
    if set(args.phases) - {"kill", "keep"}:
        parser.error(f"unknown phases: {args.phases}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return trio.run(main_async, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
