"""`make demo`: the whole system on one machine without a GPU.

The server with its control plane, two agents with simulated GPUs, and mock
engines that the control plane places and the agents launch through the vLLM
adapter, all as separate processes. The router listens on $LLMGW_DEMO_PORT
(default 8080) and the control plane on the port after it; both are checked free
before anything starts. The engines take the 100 ports after those two. Everything
lives in a temporary directory (certificates, the CA's key included, configs, logs)
that is removed when the demo stops; `--keep DIR` works in DIR instead and leaves it,
for a local fleet started by hand (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from llmgw_core.certs import init_ca, issue_node
from llmgw_server.control.documents import StatusDoc, from_json
from llmgw_server.control.lifecycle import NodeStatus

CONF = Path(__file__).resolve().parents[2] / "conf"
MOCK = f'["{sys.executable}", "-m", "llmgw_mock_engine"]'
PORT_ENV = "LLMGW_DEMO_PORT"
NODES = (("sim-node-1", "node-2xl4.toml"), ("sim-node-2", "node-8xh100.toml"))
READY_TIMEOUT_S = 60.0
# The control plane places nothing for this long after its start, so that both agents have
# registered (they are started once it listens): best fit then puts demo-model's replicas on
# sim-node-1's L4s and demo-big on sim-node-2, and draining sim-node-1 moves them.
SETTLE_S = 6
ENGINE_PORTS = 100  # the control plane asks for at least 64


def demo_port(environ: Mapping[str, str]) -> int:
    """The router's port from $LLMGW_DEMO_PORT (default 8080); the control plane takes the
    next one and the engines the ENGINE_PORTS after it. Raises ValueError with the message
    for the user."""
    text = environ.get(PORT_ENV, "8080").strip()
    top = 65535 - 1 - ENGINE_PORTS
    if not text.isdigit() or not 1024 <= int(text) <= top:
        raise ValueError(f"{PORT_ENV}={text!r} must be a port from 1024 to {top}")
    return int(text)


def ports_in_use(ports: Sequence[tuple[int, str]], host: str = "127.0.0.1") -> list[str]:
    """A line for each (port, what) that cannot be listened on now."""
    busy = []
    for port, what in ports:
        with socket.socket() as probe:
            # As the server binds: a port left in TIME_WAIT by an earlier run is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                busy.append(f"port {port} ({what}) on {host}: {why}")
    return busy


def placement_lines(status: StatusDoc) -> list[str]:
    """What runs where, from the control plane's status: a line per node, then one per
    replica with the node and GPUs of each of its shards."""
    lines = []
    for node in status.nodes:
        gpus = node.gpus
        kind = gpus[0].name if gpus else "no GPU"
        lines.append(f"  node {node.name}: {len(gpus)} x {kind} (simulated), {node.status}")
    rows = []
    for r in sorted(status.replicas, key=lambda r: (r.model, r.replica_id)):
        shards = sorted(r.shards, key=lambda s: s.rank)
        where = " + ".join(
            f"{s.node} GPU{'s' if len(s.gpus) != 1 else ''} "
            f"{','.join(str(g) for g in s.gpus)}"
            + (f" (rank {s.rank})" if len(shards) > 1 else "")
            for s in shards
        )
        nodes = {s.node for s in shards}
        span = f"across {len(nodes)} nodes" if len(nodes) > 1 else "on one node"
        state = "serving" if r.serving else r.phase
        rows.append((r.model, r.replica_id, f"{span}: {where}, {state}"))
    width = [max((len(row[i]) for row in rows), default=0) for i in range(2)]
    lines += [f"  {m.ljust(width[0])}  {rid.ljust(width[1])}  {text}" for m, rid, text in rows]
    return lines


def all_serving(status: StatusDoc, nodes: Sequence[str] = ()) -> bool:
    """Every model has as many replicas serving as it asks for, and each of `nodes` is
    reachable (the banner shows them all: two nodes, one of them slower to start under
    load, could otherwise leave one out)."""
    serving: dict[str, int] = {}
    for r in status.replicas:
        serving[r.model] = serving.get(r.model, 0) + r.serving
    reachable = {n.name for n in status.nodes if n.status is NodeStatus.REACHABLE}
    return reachable >= set(nodes) and all(
        serving.get(m.name, 0) >= m.desired for m in status.models
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def drain_target(status: StatusDoc) -> str:
    """The node the banner suggests draining: one whose replicas all fit elsewhere, so that
    the drain shows a make-before-break move (demo-big fits only on sim-node-2)."""
    held: dict[str, set[str]] = {}
    for r in status.replicas:
        for s in r.shards:
            held.setdefault(s.node, set()).add(r.model)
    for name, _ in NODES:
        if held.get(name) and "demo-big" not in held[name]:
            return name
    return NODES[0][0]


def keep_dir(argv: Sequence[str]) -> Path | None:
    """The directory of `--keep DIR`: the demo works there and leaves it behind (configs,
    certificates, logs) for a local fleet run by hand. Raises ValueError with the message
    for the user."""
    if not argv:
        return None
    if len(argv) != 2 or argv[0] != "--keep":
        raise ValueError(f"usage: {Path(sys.argv[0]).name} [--keep DIR]")
    keep = Path(argv[1]).expanduser().resolve()
    if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        raise ValueError(f"--keep {argv[1]}: {keep} exists and is not an empty directory")
    return keep


def main() -> int:
    try:
        port = demo_port(os.environ)
        keep = keep_dir(sys.argv[1:])
    except ValueError as exc:
        print(f"llmgw demo: {exc}", file=sys.stderr)
        return 2
    control = port + 1
    busy = ports_in_use([(port, "the router"), (control, "the control plane")])
    if busy:
        print(
            f"llmgw demo: {'; '.join(busy)}: stop what listens there, or run the demo on other "
            f"ports with {PORT_ENV}=PORT (it takes PORT and PORT+1)",
            file=sys.stderr,
        )
        return 1
    signal.signal(signal.SIGTERM, _interrupt)  # stop the whole demo on SIGTERM as on Ctrl-C
    procs: dict[str, subprocess.Popen[bytes]] = {}
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    work = keep or Path(tempfile.mkdtemp(prefix="llmgw-demo-"))
    try:
        return _run(work, port, control, procs, kept=keep is not None)
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C or SIGTERM must not leave the processes or the CA key behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(work, procs)
        if keep is not None:
            print(f"llmgw demo: kept {work}: {_by_hand(work)}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
            if work.exists():
                print(f"llmgw demo: could not remove {work}; remove it by hand", file=sys.stderr)


def _by_hand(work: Path) -> str:
    """How to start the kept fleet again, each process in its own terminal."""
    agents = "; ".join(
        f"{sys.executable} -m llmgw_agent --config {work / name}.toml" for name, _ in NODES
    )
    return (
        f"run it again by hand with {sys.executable} -m llmgw_server --config "
        f"{work / 'server.toml'}; {agents}"
    )


def _run(
    work: Path, port: int, control: int, procs: dict[str, subprocess.Popen[bytes]], kept: bool
) -> int:
    certs = work / "certs"
    init_ca(certs)  # mutual TLS on the agent stream, as in production
    server_toml = work / "server.toml"
    server_toml.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        f'[agents]\nca = "{certs}/ca.crt"\ncert = "{certs}/server.crt"\n'
        f'key = "{certs}/server.key"\n'
        "[router]\nhealth_interval_s = 1.0\n"
        f"[control]\nsettle_after_start_s = {SETTLE_S}\n"
        "unreachable_after_s = 5\nlost_after_s = 30\n"
        # Next to the demo's own ports: two demos (or tests) on other ports never collide.
        f"engine_port_min = {control + 1}\nengine_port_max = {control + ENGINE_PORTS}\n"
        '[[models]]\nname = "demo-model"\nreplicas = 2\n[models.profile]\nengine = "vllm"\n'
        'model = "demo/demo-8b"\ntensor_parallel = 1\ngpu_memory_gib = 20\n'
        '[[models]]\nname = "demo-big"\n[models.profile]\nengine = "vllm"\n'
        'model = "demo/demo-70b"\ntensor_parallel = 2\npipeline_parallel = 2\n'
    )
    for name, inventory in NODES:
        crt, key, _ = issue_node(certs, name)
        (work / f"{name}.toml").write_text(
            f'name = "{name}"\nserver = "wss://127.0.0.1:{control}/v1/agent"\n'
            f'state_dir = "{work / name}"\ninventory_file = "{CONF / "sim" / inventory}"\n'
            'fabric = { ib_domain = "demo" }\nbind_host = "127.0.0.1"\n'
            f'[tls]\nca = "{certs}/ca.crt"\ncert = "{crt}"\nkey = "{key}"\n'
            f'[engines.vllm]\ncommand = {MOCK}\nenv = {{ LLMGW_MOCK_TPS = "30" }}\n'
        )
    logs = work / "logs"
    logs.mkdir()

    def start(name: str, *argv: str) -> None:
        with (logs / f"{name}.log").open("wb") as out:
            procs[name] = subprocess.Popen(
                [sys.executable, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    start("server", "-m", "llmgw_server", "--config", str(server_toml))
    if not _wait_until_listening(control, procs, logs):
        return 1
    for name, _ in NODES:
        start(name, "-m", "llmgw_agent", "--config", str(work / f"{name}.toml"))
    url = f"http://127.0.0.1:{port}"
    admin = f"https://127.0.0.1:{control}"
    trust = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    status = _wait_until_serving(url, admin, trust, procs, logs)
    if status is None:
        return 1
    print(
        f"\nllmgw demo: the router is at {url}/v1, the control plane at {admin}\n"
        "Two agents with simulated GPUs run mock engines; the control plane placed them "
        "(its status now):\n" + "\n".join(placement_lines(status)) + "\n\n"
        f"  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
        '    -d \'{"model": "demo-model", "stream": true, '
        '"messages": [{"role": "user", "content": "hello"}]}\'\n\n'
        "The fleet's state, why a model runs where it does, and a node's replicas moved off:\n"
        f"  {sys.executable} -m llmgw_server --config {server_toml} status\n"
        f"  {sys.executable} -m llmgw_server --config {server_toml} explain demo-big\n"
        f"  {sys.executable} -m llmgw_server --config {server_toml} drain {drain_target(status)}"
        "\n\n"
        f"The fleet page, live: {admin}/ui (your browser does not know the demo's CA: "
        f"{certs / 'ca.crt'})\n"
        f"Logs: {logs}\nCtrl-C stops it all and {'keeps' if kept else 'removes'} {work} "
        "(certificates, configs, logs).\n",
        flush=True,
    )
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                _report_exit(name, p, logs)
                return 1
        time.sleep(0.5)


def _wait_until_listening(
    port: int, procs: Mapping[str, subprocess.Popen[bytes]], logs: Path
) -> bool:
    """The control plane accepts connections (the agents then register at their first
    dial, within its settle time); False (after saying why) if the server exits or that
    takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        server = procs["server"]
        if server.poll() is not None:
            _report_exit("server", server, logs)
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return True
        time.sleep(0.1)
    print(
        f"llmgw demo: the control plane did not listen within {READY_TIMEOUT_S:g} s",
        file=sys.stderr,
    )
    return False


def _wait_until_serving(
    url: str,
    admin: str,
    trust: ssl.SSLContext,
    procs: Mapping[str, subprocess.Popen[bytes]],
    logs: Path,
) -> StatusDoc | None:
    """The control plane's status once every model serves and the router lists them all;
    None (after saying why) if a process exits or that takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2, verify=trust) as client:
        while time.monotonic() < deadline:
            for name, p in procs.items():
                if p.poll() is not None:
                    _report_exit(name, p, logs)
                    return None
            # DocumentError is a ValueError: an answer not yet the status, asked again.
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                status = from_json(client.get(f"{admin}/v1/admin/status").json(), StatusDoc)
                listed = {m["id"] for m in client.get(f"{url}/v1/models").json()["data"]}
                nodes = [name for name, _ in NODES]
                if all_serving(status, nodes) and listed >= {m.name for m in status.models}:
                    return status
            time.sleep(0.3)
    print(
        f"llmgw demo: not every model served after {READY_TIMEOUT_S:g} s; the server's log:\n"
        + _tail(logs / "server.log"),
        file=sys.stderr,
    )
    return None


def _report_exit(name: str, p: subprocess.Popen[bytes], logs: Path) -> None:
    # The logs go with the temporary directory: show the end of this one now.
    print(
        f"llmgw demo: the {name} process exited with status {p.returncode}; its log ends:\n"
        + _tail(logs / f"{name}.log"),
        file=sys.stderr,
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def _stop(work: Path, procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """Stop the server and agents, then the engines: agents leave engines serving when they
    stop (the next start adopts them), so the demo ends them by their shard records."""
    for p in reversed(list(procs.values())):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    engines = []
    for record in work.glob("*/shards/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            pid = int(json.loads(record.read_text())["pid"])
            os.killpg(pid, signal.SIGTERM)
            engines.append(pid)
    deadline = time.monotonic() + 5
    while engines and time.monotonic() < deadline:
        engines = [pid for pid in engines if _alive(pid)]
        time.sleep(0.1)
    for pid in engines:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(main())
