"""Fleet simulator: how the control plane holds up under many connected nodes.

One process runs N simulated agents, each with a real websocket to a real
server process: register with an 8-GPU inventory, then heartbeat every 5 s.
Measured, side by side in one run:
- the server's CPU (cores) and RSS per node while N nodes heartbeat;
- how long a registration storm takes to settle after a server restart, with
  the agents' real full-jitter reconnect backoff.

Run: .venv/bin/python bench/fleet_bench.py [--nodes 1000] [--window 30]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmgw_agent.agent import backoff_delay
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.inventory import Gpu, Inventory
from llmgw_core.wire import PROTOCOL, Heartbeat, Register, Welcome, decode_down, encode

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Sim:
    def __init__(
        self, url: str, nodes: int, heartbeat_s: float, certs: Path | None = None
    ) -> None:
        self.url = url
        self.certs = certs  # mTLS: one certificate per simulated node
        self.nodes = nodes
        self.heartbeat_s = heartbeat_s
        self.registered: set[str] = set()
        self.registered_at: dict[str, float] = {}
        self.connects = 0
        self.rng = random.Random(7)

    def inventory(self, i: int) -> Inventory:
        name = f"sim-{i:04d}"
        return Inventory(
            name=name,
            address=f"10.{i // 250}.{i % 250}.1",
            labels={"pool": "bench"},
            fabric={"ib_domain": f"pod-{i // 32}"},
            cpus=96,
            memory_mib=1_000_000,
            gpus=tuple(Gpu(g, f"GPU-{i}-{g}", "NVIDIA H100 80GB HBM3", 81559, 81000) for g in range(8)),
        )

    def _context(self, name: str) -> ssl.SSLContext | None:
        if self.certs is None:
            return None
        context = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        context.load_cert_chain(
            str(self.certs / "nodes" / f"{name}.crt"), str(self.certs / "nodes" / f"{name}.key")
        )
        return context

    async def agent(self, i: int) -> None:
        inventory = self.inventory(i)
        attempt = 0
        await trio.sleep(self.rng.uniform(0, 2))  # nodes do not boot in the same millisecond
        while True:
            try:
                async with trio_websocket.open_websocket_url(
                    self.url, self._context(inventory.name), connect_timeout=30
                ) as ws:
                    self.connects += 1
                    await ws.send_message(encode(Register(PROTOCOL, "bench", inventory)))
                    welcome = decode_down(await ws.get_message())
                    assert isinstance(welcome, Welcome)
                    attempt = 0
                    self.registered.add(inventory.name)
                    self.registered_at[inventory.name] = time.monotonic()
                    seq = 0
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_drain, ws, nursery.cancel_scope)
                        await trio.sleep(self.rng.uniform(0, self.heartbeat_s))
                        while True:
                            seq += 1
                            await ws.send_message(encode(Heartbeat(seq)))
                            await trio.sleep(self.heartbeat_s)
            except* (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed):
                pass
            self.registered.discard(inventory.name)
            attempt += 1
            await trio.sleep(backoff_delay(attempt, 0.5, 30.0, self.rng))


async def _drain(ws: trio_websocket.WebSocketConnection, scope: trio.CancelScope) -> None:
    try:
        while True:
            await ws.get_message()
    except trio_websocket.ConnectionClosed:
        scope.cancel()


def start_server(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw_server", "--config", str(config), "--log-level", "WARNING"],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        preexec_fn=raise_nofile,
    )


async def wait_all(sim: Sim, n: int, timeout: float) -> float:
    start = time.monotonic()
    with trio.move_on_after(timeout):
        while len(sim.registered) < n:
            await trio.sleep(0.05)
    return time.monotonic() - start


async def run(args: argparse.Namespace) -> None:
    raise_nofile()
    work = Path(tempfile.mkdtemp(prefix="llmgw-fleet-bench-"))
    control = free_port()
    config = work / "server.toml"
    certs = work / "certs" if args.tls else None
    if certs is not None:
        init_ca(certs)
        for i in range(args.nodes):
            issue_node(certs, f"sim-{i:04d}")
        agents = (
            f'[agents]\nca = "{certs}/ca.crt"\ncert = "{certs}/server.crt"\n'
            f'key = "{certs}/server.key"\n'
        )
    else:
        agents = "[agents]\ninsecure = true\n"  # the control plane alone, not TLS
    # One model no node can hold: the control plane works (registers, explains,
    # heartbeats), and no engine is started.
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        + agents
        +
        f"[control]\nunreachable_after_s = {3 * args.heartbeat}\nlost_after_s = 120\n"
        '[[models]]\nname = "unplaceable"\n[models.profile]\nengine = "vllm"\nmodel = "x"\n'
        'tensor_parallel = 4\ngpu_model = "B300"\n'
    )
    log = work / "server.log"
    server = start_server(config, log)
    await trio.sleep(1.5)
    base_rss = rss_kib(server.pid)
    scheme = "wss" if certs else "ws"
    sim = Sim(f"{scheme}://127.0.0.1:{control}/v1/agent", args.nodes, args.heartbeat, certs)
    results: list[tuple[str, str]] = []
    async with trio.open_nursery() as nursery:
        t0 = time.monotonic()
        for i in range(args.nodes):
            nursery.start_soon(sim.agent, i)
        took = await wait_all(sim, args.nodes, 300)
        results.append(("first registration of all nodes (agents booting over 2 s)", f"{took:.1f} s"))
        await trio.sleep(args.heartbeat * 2)  # past registration: steady heartbeats
        cpu0, t_cpu = cpu_seconds(server.pid), time.monotonic()
        await trio.sleep(args.window)
        cores = (cpu_seconds(server.pid) - cpu0) / (time.monotonic() - t_cpu)
        rss = rss_kib(server.pid)
        results.append((f"server CPU with {args.nodes} nodes heartbeating every {args.heartbeat:g} s",
                        f"{cores:.3f} cores (budget < 0.1)"))
        results.append(("server RSS: idle / with the fleet", f"{base_rss / 1024:.0f} MiB / {rss / 1024:.0f} MiB"))
        results.append(("server memory per node", f"{(rss - base_rss) / args.nodes:.1f} KiB (budget < 50)"))
        # A server restart: every agent reconnects with full-jitter backoff.
        server.send_signal(signal.SIGKILL)
        server.wait()
        await trio.sleep(0.5)
        connects_before = sim.connects
        restart = time.monotonic()
        server = start_server(config, log)
        took = await wait_all(sim, args.nodes, 300)
        spread = sorted(t - restart for t in sim.registered_at.values() if t > restart)
        results.append(("registration storm after a restart: all nodes back", f"{took:.1f} s"))
        if spread:
            q = [spread[int(p * (len(spread) - 1))] for p in (0.1, 0.5, 0.9)]
            results.append(("  re-registrations at p10 / p50 / p90", " / ".join(f"{x:.1f} s" for x in q)))
        results.append(("  connection attempts during the storm", str(sim.connects - connects_before)))
        settle_cpu0, settle_t = cpu_seconds(server.pid), time.monotonic()
        await trio.sleep(min(args.window, 10))
        results.append(("server CPU right after the storm",
                        f"{(cpu_seconds(server.pid) - settle_cpu0) / (time.monotonic() - settle_t):.3f} cores"))
        nursery.cancel_scope.cancel()
    del t0
    t_stop = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
        results.append(("server shutdown with every stream open (SIGTERM to exit)", f"{time.monotonic() - t_stop:.1f} s"))
    except subprocess.TimeoutExpired:
        server.kill()
        results.append(("server shutdown with every stream open", "over 60 s: killed"))
    lines = ["| fleet simulator | measured |", "|---|---|", *[f"| {a} | {b} |" for a, b in results]]
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / ("fleet-tls.md" if args.tls else "fleet.md")).write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--heartbeat", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--tls", action="store_true", help="mutual TLS, as in production")
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
