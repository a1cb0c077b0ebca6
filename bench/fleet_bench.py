"""Fleet benchmark: one control plane process and N simulated nodes, each with its own
stream (mutual TLS with --tls, as in production).

The simulated agents run in several processes (bench/fleet_sim.py, --sim-procs;
by default one per 2,500 nodes), so that the simulator is not the bottleneck it
measures: each figure comes with the simulator's own CPU beside it (all its
processes, and the busiest one; near 1.0 the busiest one was saturated and the
figure says more about the simulator than the server). The server's CPU is read
from /proc, and also given per registration and per heartbeat: CPU-seconds that
do not depend on what else shares the machine's cores.

Measured, in one run:
- first registration: every agent boots at a random moment within --boot-s
  (10 s), dials with the agent's own code and registers; the time until the last
  one is registered, from the first boot;
- steady state: server CPU while every node heartbeats at the interval the server
  gave it (the base, 5 s, grows with the fleet past [control] heartbeats_per_s,
  --heartbeats-per-s; the average is reported), with its acks,
  server memory per node (RSS over the idle server's, divided by N);
- GET /v1/admin/status with every node, whole and one page of it;
- restart storm: the server is killed and started again; every agent dials again
  with its real full-jitter backoff; the time until every node has registered
  again, from the server's start, the spread, and the connection attempts;
- shutdown: SIGTERM with every stream open, until the process exits.

During registration and the restart storm an operator's admin request (a new
connection each time, GET /v1/admin/status?limit=1, as the CLI does) is made every
second: every one must be answered. Connection attempts are given per node (the
goal: at most 2 on average); an agent the control port refuses is told when to
come back and waits for it, as the real agent does (its sessions that failed say
"refused, told when to come back"). The bench's own admin calls are retried.

The simulator shares the machine's cores with the server, as agents' load shares
a real server's machine with other work: it runs in the bench's own session (one
scheduling autogroup with the bench), the server in another, so the kernel's
autogroup scheduling gives neither a larger share by the number of processes; the
server's cores used in each phase and the simulator's are reported beside the
figures. Each run records the machine's yardstick: a fixed CPU loop's time before
and after, and the load average (other work on the machine shows there).

Run: .venv/bin/python bench/fleet_bench.py --nodes 10000 --tls --runs 3
(development: --nodes 1000 or 2000 --runs 1; prints a table per run and a summary,
and writes them to bench/results/fleet[-tls]-N.md)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmgw_core.certs import init_ca, issue_node

TICK = os.sysconf("SC_CLK_TCK")
HERE = Path(__file__).resolve().parent


def node_name(i: int) -> str:
    return f"sim-{i:05d}"  # as fleet_sim names them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def runqueue_seconds(pid: int) -> float:
    """Seconds the process has waited for a core while it could run (/proc schedstat):
    what the machine's other work took from it."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def progress(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def describe(failures: dict[str, int]) -> str:
    if not failures:
        return "none"
    return "; ".join(f"{why}: {count:,}" for why, count in sorted(failures.items(), key=lambda x: -x[1]))


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def yardstick() -> float:
    """Seconds for a fixed CPU loop in this process: the machine's speed right now
    (about 0.1 s on an idle 2020s core; more when other work shares the cores)."""
    t = time.perf_counter()
    total = 0
    for k in range(2_000_000):
        total += k
    assert total
    return time.perf_counter() - t


def autogroups() -> str:
    """Whether the kernel schedules sessions as groups (then the server, in its own
    session, gets half the cores against the bench and all its simulators together)."""
    try:
        enabled = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return "autogroup scheduling: unknown"
    return "autogroup scheduling on: server in its own session, simulators in the bench's" if (
        enabled
    ) else "autogroup scheduling off: every process weighs the same"


class AdminProbe:
    """An operator during a storm: a new connection and GET status?limit=1 every second,
    each given 10 s; how many were answered and why the others were not."""

    def __init__(self, url: str, ca: Path | None) -> None:
        self.url, self.ca = url, ca
        self.answered = 0
        self.failed: dict[str, int] = {}
        self.slowest = 0.0

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(self.once)
                await trio.sleep(1.0)

    async def once(self) -> None:
        t = time.perf_counter()
        try:
            async with httpx.AsyncClient(
                verify=str(self.ca) if self.ca else False, timeout=10
            ) as client:
                response = await client.get(f"{self.url}/v1/admin/status", params={"limit": 1})
            if response.status_code == 200:
                self.answered += 1
                self.slowest = max(self.slowest, time.perf_counter() - t)
                return
            why = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            why = type(exc).__name__
        self.failed[why] = self.failed.get(why, 0) + 1

    def report(self) -> str:
        asked = self.answered + sum(self.failed.values())
        text = f"{self.answered} of {asked} answered (slowest {self.slowest:.1f} s)"
        return text if not self.failed else f"{text}; failed: {describe(self.failed)}"


async def with_retries(call: Any, what: str, tries: int = 5) -> Any:
    """The bench's own admin calls: a storm may refuse one connection; try again."""
    for k in range(tries):
        try:
            return await call()
        except httpx.HTTPError as exc:
            if k == tries - 1:
                raise
            progress(f"{what}: {type(exc).__name__}; again in {2**k} s")
            await trio.sleep(2**k)
    raise AssertionError("unreachable")


class Server:
    def __init__(self, config: Path, log: Path, control: int) -> None:
        self.config, self.log, self.control = config, log, control
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> float:
        """Start it; returns when it was started (monotonic), once it accepts."""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_server", "--config", str(self.config),
             "--log-level", "WARNING"],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            preexec_fn=raise_nofile,
            start_new_session=True,  # killed as a group; its own scheduling autogroup
        )
        with trio.fail_after(60):
            while True:
                try:
                    (await trio.open_tcp_stream("127.0.0.1", self.control)).socket.close()
                    return started
                except OSError:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"the server exited: see {self.log}") from None
                    await trio.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Sims:
    """The simulator processes and what they last reported."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.reports: list[dict[str, int]] = [{} for _ in procs]
        self.registrations: list[float] = []  # every registration's time
        self.firsts: list[float] = []  # each node's first registration since the epoch
        self.failures: list[dict[str, int]] = [{} for _ in procs]  # why sessions ended

    def failure_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counts in self.failures:
            for why, count in counts.items():
                total[why] = total.get(why, 0) + count
        return total

    def total(self, key: str) -> int:
        return sum(r.get(key, 0) for r in self.reports)

    def cpu(self) -> list[float]:
        return [cpu_seconds(p.pid) for p in self.procs]

    def waited(self) -> float:
        return sum(runqueue_seconds(p.pid) for p in self.procs)

    def send(self, line: str) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line.encode() + b"\n")
            p.stdin.flush()

    async def follow(self, index: int, ready: trio.Event) -> None:
        out = self.procs[index].stdout
        assert out is not None
        stream = trio.lowlevel.FdStream(os.dup(out.fileno()))
        buffer = b""
        async with stream:
            while True:
                data = await stream.receive_some()
                if not data:
                    return
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line == b"ready":
                        ready.set()
                        continue
                    report = json.loads(line)
                    self.registrations += report.pop("at")
                    self.firsts += report.pop("firsts")
                    self.failures[index] = report.pop("failures")
                    self.reports[index] = report


class Phase:
    """CPU of the server and the simulator over one stretch of wall time."""

    def __init__(self, server: Server, sims: Sims) -> None:
        self.server, self.sims = server, sims
        self.t0 = time.monotonic()
        self.server0 = cpu_seconds(server.pid)
        self.waited0 = runqueue_seconds(server.pid)
        self.sims0 = sims.cpu()
        self.sims_waited0 = sims.waited()
        self.heartbeats0 = sims.total("heartbeats")

    def end(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        sims = [b - a for a, b in zip(self.sims0, self.sims.cpu(), strict=True)]
        return {
            "wall": wall,
            "server_cpu": cpu_seconds(self.server.pid) - self.server0,
            "server_waited": runqueue_seconds(self.server.pid) - self.waited0,
            "sim_cores": sum(sims) / wall,
            "sim_busiest": max(sims) / wall,
            "sim_waited": (self.sims.waited() - self.sims_waited0) / wall,
            "heartbeats": self.sims.total("heartbeats") - self.heartbeats0,
        }


def sim_note(p: dict[str, float]) -> str:
    """The simulator's cores, and those it waited for: a starved simulator is slow to
    answer the server's handshakes, and the server's deadlines then cut it."""
    return (
        f"{p['sim_cores']:.2f} cores (busiest process {p['sim_busiest']:.2f}; "
        f"waited for {p['sim_waited']:.2f} more)"
    )


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return " / ".join(f"{values[int(q * (len(values) - 1))]:.1f} s" for q in (0.1, 0.5, 0.9))


async def wait_for(condition: object, timeout: float) -> bool:
    with trio.move_on_after(timeout):
        while not condition():  # type: ignore[operator]
            await trio.sleep(0.1)
        return True
    return False


@attrs.frozen
class StatusTimes:
    whole_s: float  # wall, median of nine
    page_s: float  # ?limit=100, wall, median of forty
    size: int  # bytes of the whole status
    whole_cpu_s: float  # the server's CPU for one, the heartbeats' share taken out
    page_cpu_s: float


async def time_status(url: str, ca: Path | None, pid: int) -> StatusTimes:
    """The status's wall time and the server's CPU for it. The simulators share the
    cores meanwhile, so the wall time varies from run to run by more than the code's
    cost does; the server's CPU over a block of requests, less what it spent in the 3 s
    just before the block at the same rate (its heartbeats), varies less."""
    async with httpx.AsyncClient(verify=str(ca) if ca else False, timeout=60) as client:

        async def block(count: int, params: dict[str, int]) -> tuple[list[float], float, int]:
            await client.get(f"{url}/v1/admin/status", params={"node": "none"})  # connected
            idle0, i0 = cpu_seconds(pid), time.monotonic()
            await trio.sleep(3.0)
            background = (cpu_seconds(pid) - idle0) / (time.monotonic() - i0)
            walls, size = [], 0
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            for _ in range(count):
                t = time.perf_counter()
                response = await client.get(f"{url}/v1/admin/status", params=params)
                walls.append(time.perf_counter() - t)
                size = len(response.content)
            busy = cpu_seconds(pid) - cpu0 - background * (time.monotonic() - t0)
            return walls, max(0.0, busy) / count, size

        whole, whole_cpu, size = await block(9, {})
        page, page_cpu, _ = await block(40, {"limit": 100})
    return StatusTimes(
        statistics.median(whole), statistics.median(page), size, whole_cpu, page_cpu
    )


def histogram_bounds(page: str, name: str, quantiles: tuple[float, ...]) -> tuple[int, list[float]]:
    """(observations, for each quantile the upper bound of the bucket it falls in) of a
    Prometheus histogram without labels in `page`; inf past the last finite bound."""
    buckets: list[tuple[float, int]] = []
    for line in page.splitlines():
        if line.startswith(name + '_bucket{le="'):
            bound, count = line[len(name) + 12 :].split('"} ')
            buckets.append((float(bound), int(float(count))))
    total = buckets[-1][1] if buckets else 0
    return total, [
        next((b for b, c in buckets if c >= q * total), math.inf) for q in quantiles
    ]


async def reconcile_times(url: str, ca: Path | None) -> tuple[int, list[float]]:
    """The control plane's reconcile steps so far: how many, and their p50 / p99 bounds."""
    async with httpx.AsyncClient(verify=str(ca) if ca else False, timeout=60) as client:
        page = (await client.get(f"{url}/metrics")).text
    return histogram_bounds(page, "llmgw_control_reconcile_seconds", (0.5, 0.99))


async def run(args: argparse.Namespace) -> None:
    raise_nofile()
    n = args.nodes
    work = Path(tempfile.mkdtemp(prefix="llmgw-fleet-bench-"))
    certs = work / "certs" if args.tls else None
    if certs is not None:
        t = time.monotonic()
        init_ca(certs)
        for i in range(n):
            issue_node(certs, node_name(i))
        print(f"issued {n} node certificates in {time.monotonic() - t:.0f} s", file=sys.stderr)
    procs_n = args.sim_procs or max(1, math.ceil(n / 2500))
    results: list[dict[str, Any]] = []
    try:
        for k in range(args.runs):
            progress(f"run {k + 1} of {args.runs}")
            results.append(await one_run(args, work / f"run-{k + 1}", certs, procs_n))
    finally:
        if certs is not None:
            shutil.rmtree(certs)  # one key per node: not left behind in /tmp
    mode = "mutual TLS" if certs else "plaintext"
    sources = "one source address" if args.one_address else "a source address per node"
    lines = [
        f"fleet bench: {n:,} nodes, {mode}, {procs_n} simulator processes ({sources}), "
        f"{os.cpu_count()} cores shared by the server and the simulator; {autogroups()}",
        f"command: {' '.join([Path(sys.executable).name, *sys.argv])}",
        "",
        "| run | register all | attempts per node | admin requests during registration "
        "| storm: all back | attempts per node after the server's start "
        "| admin requests during the storm "
        "| server cores (registration / storm) | server cores waited for "
        "| yardstick before / after | load before / after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(results):
        lines.append(
            f"| {k + 1} | {r['registration']} | {r['reg_attempts']:.2f} | {r['reg_admin']} "
            f"| {r['storm']} | {r['storm_attempts']:.2f} | {r['storm_admin']} "
            f"| {r['reg_cores']:.2f} / {r['storm_cores']:.2f} "
            f"| {r['reg_waited']:.2f} / {r['storm_waited']:.2f} "
            f"| {r['yard0']:.2f} s / {r['yard1']:.2f} s | {r['load0']} / {r['load1']} |"
        )
    lines += [
        "",
        "(yardstick: a fixed CPU loop's time in the bench process; about 0.1 s on an idle "
        "core, more while other work shares the cores. Cores waited for: the server's time "
        "runnable but not running, over the phase's wall time, from /proc schedstat)",
    ]
    for k, r in enumerate(results):
        lines += [
            "",
            f"### run {k + 1}",
            "",
            "| fleet simulator | measured | simulator CPU |",
            "|---|---|---|",
            *[f"| {a} | {b} | {c} |" for a, b, c in r["rows"]],
            "",
            "README row: | nodes | first registration of all | server CPU, heartbeating "
            "| memory per node | restart storm | status |",
            r["readme"],
        ]
    text = "\n".join(lines)
    print(text)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"fleet{'-tls' if certs else ''}-{n}.md").write_text(text + "\n")


async def one_run(
    args: argparse.Namespace, work: Path, certs: Path | None, procs_n: int
) -> dict[str, Any]:
    """One whole measurement: a fresh server and simulator."""
    n = args.nodes
    work.mkdir(parents=True)
    result: dict[str, Any] = {"yard0": yardstick(), "load0": load()}
    control = free_port()
    if certs is not None:
        agents = (
            f'[agents]\nca = "{certs}/ca.crt"\ncert = "{certs}/server.crt"\n'
            f'key = "{certs}/server.key"\n'
        )
    else:
        agents = "[agents]\ninsecure = true\n"
    config = work / "server.toml"
    # One model no node can hold: the control plane registers, explains and takes
    # heartbeats, and no engine is started.
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        + agents
        + f"[control]\nunreachable_after_s = {3 * args.heartbeat}\nlost_after_s = 120\n"
        + (f"heartbeats_per_s = {args.heartbeats_per_s}\n" if args.heartbeats_per_s else "")
        + '[[models]]\nname = "unplaceable"\n[models.profile]\nengine = "vllm"\nmodel = "x"\n'
        'tensor_parallel = 4\ngpu_model = "B300"\n'
    )
    server = Server(config, work / "server.log", control)
    await server.start()
    await trio.sleep(1.0)
    base_rss = rss_kib(server.pid)
    scheme = "wss" if certs else "ws"
    sizes = [n // procs_n + (1 if k < n % procs_n else 0) for k in range(procs_n)]
    firsts = [sum(sizes[:k]) for k in range(procs_n)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "fleet_sim.py"),
             "--url", f"{scheme}://127.0.0.1:{control}/v1/agent",
             "--first", str(first), "--count", str(size), "--boot-s", str(args.boot),
             *(["--certs", str(certs)] if certs else []),
             *([] if args.one_address else ["--own-addresses"])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=raise_nofile,
            # Not a session of their own: each would be an autogroup weighing as much
            # as the server, which would then get 1 / (sims + 1) of the cores.
        )
        for first, size in zip(firsts, sizes, strict=True)
    ]
    sims = Sims(procs)
    rows: list[tuple[str, str, str]] = []
    readme: dict[str, str] = {}
    admin = f"{'https' if certs else 'http'}://127.0.0.1:{control}"
    ca = certs / "ca.crt" if certs else None
    try:
        async with trio.open_nursery() as nursery:
            readies = [trio.Event() for _ in procs]
            for k, ready in enumerate(readies):
                nursery.start_soon(sims.follow, k, ready)
            for ready in readies:
                await ready.wait()
            # -- first registration ------------------------------------------------
            t0 = time.monotonic() + 0.2
            phase = Phase(server, sims)
            probe = AdminProbe(admin, ca)
            async with trio.open_nursery() as probing:
                probing.start_soon(probe.run)
                sims.send(f"go {t0}")
                done = await wait_for(lambda: sims.total("registered") >= n, args.cap)
                probing.cancel_scope.cancel()
            took = (max(sims.registrations) - t0) if done else float("inf")
            reg = phase.end()
            registered = sims.total("registered")
            result["reg_attempts"] = sims.total("connects") / n
            result["reg_admin"] = probe.report()
            result["reg_cores"] = reg["server_cpu"] / reg["wall"]
            result["reg_waited"] = reg["server_waited"] / reg["wall"]
            result["registration"] = (
                f"{took:.1f} s" if done else f"{registered:,} of {n:,} in {args.cap:g} s"
            )
            rows.append((
                f"first registration of all {n:,} (agents booting over {args.boot:g} s)",
                f"{result['registration']}; {sims.total('connects'):,} connection attempts "
                f"({result['reg_attempts']:.2f} per node); server {result['reg_cores']:.2f} cores, "
                f"and {result['reg_waited']:.2f} more it waited for (the machine's other work)",
                sim_note(reg),
            ))
            rows.append(("admin requests during registration (one a second)", probe.report(), ""))
            readme["registration"] = f"{took:.1f} s" if done else f"not all in {args.cap:g} s"
            failures_at_registration = sims.failure_counts()
            rows.append(("sessions that failed during registration", describe(failures_at_registration), ""))
            progress(f"registered: {result['registration']}")
            # -- steady heartbeats ----------------------------------------------------
            await trio.sleep(2 * args.heartbeat)  # past registration: steady heartbeats
            progress(f"steady: {args.window:g} s window")
            phase = Phase(server, sims)
            await trio.sleep(args.window)
            steady = phase.end()
            cores = steady["server_cpu"] / steady["wall"]
            per_hb = steady["server_cpu"] / max(1.0, steady["heartbeats"])
            every = n * steady["wall"] / max(1.0, steady["heartbeats"])
            rows.append((
                f"server CPU, {n:,} nodes heartbeating ({steady['heartbeats'] / steady['wall']:.0f}"
                f" a second: every {every:.1f} s on average)",
                f"{cores:.3f} cores ({per_hb * 1e6:.0f} µs of CPU per heartbeat and its ack)",
                sim_note(steady),
            ))
            per_reg = (reg["server_cpu"] - reg["heartbeats"] * per_hb) / max(1, registered)
            rows.append((
                "server CPU per registration (dial, TLS, register, heartbeats excluded)",
                f"{per_reg * 1e3:.2f} ms",
                "",
            ))
            rss = rss_kib(server.pid)
            rows.append((
                "server memory per node (RSS over the idle server's)",
                f"{(rss - base_rss) / n:.1f} KiB ({base_rss / 1024:.0f} MiB idle, "
                f"{rss / 1024:.0f} MiB with the fleet)",
                "",
            ))
            readme["cpu"] = f"{cores:.3f} cores"
            readme["memory"] = f"{(rss - base_rss) / n:.1f} KiB"
            # -- admin status ---------------------------------------------------------
            progress("status")
            times = await with_retries(lambda: time_status(admin, ca, server.pid), "status")
            rows.append((
                f"GET /v1/admin/status with {n:,} nodes: whole / ?limit=100",
                f"{times.whole_s * 1e3:.0f} ms ({times.size / 1e6:.1f} MB) / "
                f"{times.page_s * 1e3:.0f} ms; server CPU {times.whole_cpu_s * 1e3:.0f} / "
                f"{times.page_cpu_s * 1e3:.1f} ms each",
                "",
            ))
            readme["status"] = f"{times.whole_s * 1e3:.0f} ms"
            steps, (p50, p99) = await with_retries(lambda: reconcile_times(admin, ca), "metrics")
            rows.append((
                "reconcile steps since the start (registration, then heartbeats): p50 / p99",
                f"{steps:,} steps; p50 <= {p50 * 1e3:g} ms, p99 <= {p99 * 1e3:g} ms "
                "(upper bounds of llmgw_control_reconcile_seconds' buckets)",
                "",
            ))
            # -- restart storm --------------------------------------------------------
            progress("storm: the server is killed")
            server.kill()
            await wait_for(lambda: sims.total("registered") == 0, 30)
            connects = sims.total("connects")
            sims.send(f"epoch {time.monotonic()}")
            await trio.sleep(1.0)  # the reports carry the epoch
            restart = await server.start()
            connects_at_start = sims.total("connects")  # those before were refused: no server
            phase = Phase(server, sims)
            probe = AdminProbe(admin, ca)
            async with trio.open_nursery() as probing:
                probing.start_soon(probe.run)
                done = await wait_for(lambda: sims.total("since_epoch") >= n, args.cap)
                probing.cancel_scope.cancel()
            storm = phase.end()
            attempts = sims.total("connects") - connects
            since_start = sims.total("connects") - connects_at_start
            result["storm_attempts"] = since_start / n
            result["storm_admin"] = probe.report()
            result["storm_cores"] = storm["server_cpu"] / storm["wall"]
            result["storm_waited"] = storm["server_waited"] / storm["wall"]
            if done:
                firsts_back = [t - restart for t in sims.firsts]  # each node's first, once
                took = max(firsts_back)
                result["storm"] = f"{took:.1f} s"
                rows.append((
                    "restart storm: every node back, from the server's start",
                    f"{took:.1f} s (p10 / p50 / p90 {quantiles(firsts_back)}); "
                    f"{attempts:,} connection attempts, {since_start:,} of them after the "
                    f"server's start ({since_start / n:.2f} per node); "
                    f"server {result['storm_cores']:.2f} cores (waited for {result['storm_waited']:.2f})",
                    sim_note(storm),
                ))
                readme["storm"] = f"all back in {took:.1f} s, {attempts:,} connection attempts"
            else:
                result["storm"] = f"{sims.total('since_epoch'):,} of {n:,} in {args.cap:g} s"
                rows.append((
                    "restart storm",
                    f"{result['storm']}; {attempts:,} connection attempts, {since_start:,} of "
                    f"them after the server's start ({since_start / n:.2f} per node); "
                    f"server {result['storm_cores']:.2f} cores (waited for {result['storm_waited']:.2f})",
                    sim_note(storm),
                ))
                readme["storm"] = f"not all back in {args.cap:g} s"
            rows.append(("admin requests during the storm (one a second)", probe.report(), ""))
            rows.append((
                "sessions that failed (registration and storm)",
                describe(sims.failure_counts()),
                "",
            ))
            rows.append((
                "server CPU per registration in the storm",
                f"{storm['server_cpu'] / n * 1e3:.2f} ms",
                "",
            ))
            # -- shutdown -------------------------------------------------------------
            progress("shutdown")
            t_stop = time.monotonic()
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            try:
                await trio.to_thread.run_sync(server.proc.wait, 60)
                rows.append((
                    "server shutdown with every stream open (SIGTERM to exit)",
                    f"{time.monotonic() - t_stop:.1f} s",
                    "",
                ))
            except subprocess.TimeoutExpired:
                server.kill()
                rows.append(("server shutdown with every stream open", "over 60 s: killed", ""))
            sims.send("stop")
            nursery.cancel_scope.cancel()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait()
        if server.proc is not None and server.proc.poll() is None:
            server.kill()
    result["yard1"], result["load1"] = yardstick(), load()
    result["rows"] = rows
    result["readme"] = (
        f"| {n:,}{', mutual TLS' if certs else ''} | {readme['registration']} | {readme['cpu']} "
        f"| {readme['memory']} | {readme['storm']} | {readme['status']} |"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--tls", action="store_true", help="mutual TLS, as in production")
    parser.add_argument("--runs", type=int, default=3, help="whole measurements, one after another")
    parser.add_argument("--heartbeat", type=float, default=5.0)
    parser.add_argument(
        "--heartbeats-per-s",
        type=float,
        default=0.0,
        help="the server's [control] heartbeats_per_s (0: its default, 200)",
    )
    parser.add_argument("--boot", type=float, default=10.0, help="agents boot over this long")
    parser.add_argument("--window", type=float, default=30.0, help="steady-state window, s")
    parser.add_argument("--cap", type=float, default=180.0, help="give up on a phase after, s")
    parser.add_argument("--sim-procs", type=int, default=0, help="0: one per 2,500 nodes")
    parser.add_argument(
        "--one-address", action="store_true",
        help="every simulated node dials from 127.0.0.1 (as behind one NAT) instead of its own",
    )
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
