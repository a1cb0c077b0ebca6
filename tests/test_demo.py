"""`make demo` as a user runs it: the banner tells what runs where (checked against the
control plane's own status), its command lines work as printed, it stops on SIGTERM and
leaves nothing behind; ports in use stop it before anything starts."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from procs import free_port

END_OF_BANNER = "Ctrl-C stops it all"


def free_pair() -> int:
    """A free port whose next port is free too (the demo takes both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free ports in a row")


def start_demo(port: int | str, tmp: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw_server.demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LLMGW_DEMO_PORT": str(port), "TMPDIR": str(tmp)},
        start_new_session=True,
    )


def read_banner(demo: subprocess.Popen[str], timeout: float = 30) -> str:
    """The demo's output up to the banner's last line (a thread reads: a pipe's buffered
    lines cannot be waited for with select)."""
    assert demo.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in demo.stdout or ():
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while not seen or not seen[-1].startswith(END_OF_BANNER):
        try:
            seen.append(lines.get(timeout=max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            stderr = demo.stderr.read() if demo.poll() is not None and demo.stderr else ""
            raise AssertionError(
                f"no banner within {timeout} s:\n{''.join(seen)}\n{stderr}"
            ) from None
    return "".join(seen)


def found(pattern: str, text: str) -> str:
    """The first group of `pattern`'s first match in `text`, which has one."""
    match = re.search(pattern, text)
    assert match is not None, (pattern, text)
    return match[1]


def test_demo_banner_is_the_control_planes_placement_and_it_cleans_up(tmp_path: Path) -> None:
    port = free_pair()
    demo = start_demo(port, tmp_path)
    try:
        banner = read_banner(demo)
        work = Path(found(r"--config (\S+)/server\.toml status", banner))
        assert work.parent == tmp_path and (work / "certs" / "ca.key").is_file()
        assert f"the router is at http://127.0.0.1:{port}/v1" in banner
        assert f"the control plane at https://127.0.0.1:{port + 1}" in banner

        # The CLI line as printed, --json added: the control plane's own view.
        cli_line = next(x.strip() for x in banner.splitlines() if x.strip().endswith(" status"))
        done = subprocess.run(
            [*cli_line.split(), "--json"], capture_output=True, text=True, timeout=20
        )
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        table = subprocess.run(cli_line.split(), capture_output=True, text=True, timeout=20)
        assert table.returncode == 0 and "demo-big" in table.stdout, table.stderr
        # The explain and drain lines, and the fleet page's address, are there too.
        explain_line = next(x.strip() for x in banner.splitlines() if " explain " in x)
        assert explain_line == cli_line.replace(" status", " explain demo-big")
        explained = subprocess.run(explain_line.split(), capture_output=True, text=True, timeout=20)
        assert explained.returncode == 0 and "nodes fit" in explained.stdout, explained.stderr
        drain_line = cli_line.replace(" status", " drain sim-node-1")
        assert drain_line in banner
        page = f"https://127.0.0.1:{port + 1}/ui"
        assert (
            f"The fleet page, live: {page} (" in banner and str(work / "certs" / "ca.crt") in banner
        )

        # Each replica's line names the nodes and GPUs the control plane placed it on.
        assert len(status["replicas"]) == 3
        for replica in status["replicas"]:
            line = next(x for x in banner.splitlines() if f" {replica['replica_id']} " in x)
            nodes = {s["node"] for s in replica["shards"]}
            assert ("on one node" if len(nodes) == 1 else f"across {len(nodes)} nodes") in line
            for shard in replica["shards"]:
                gpus = ",".join(str(g) for g in shard["gpus"])
                assert f"{shard['node']} GPU" in line and gpus in line, (line, shard)
            assert line.endswith("serving")
        for node in status["nodes"]:
            assert f"node {node['name']}: {len(node['gpus'])} x " in banner

        # The curl line, as printed.
        curl = banner[banner.index("  curl") : banner.index("}'") + 2]
        if shutil.which("curl"):
            sent = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=20)
            assert sent.returncode == 0, sent.stderr
            answer = sent.stdout
        else:  # the same request, as the line spells it
            url = found(r"curl -N (\S+)", curl)
            body = json.loads(found(r"-d '(.*)'", curl))
            answer = httpx.post(url, json=body, timeout=20).text
        assert answer.rstrip().endswith("data: [DONE]"), answer
        # /v1/models carries what the engines say of their models: the context length
        # clients size prompts from.
        cards = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=20).json()["data"]
        assert {c["id"]: c.get("max_model_len") for c in cards} == {
            "demo-model": 4096,
            "demo-big": 4096,
        }

        # The drain the banner suggests is a make-before-break move: sim-node-1's replicas
        # start on sim-node-2 before they stop, and demo-model answers all along.
        assert {r["model"] for r in status["replicas"] if _on(r, "sim-node-1")} == {"demo-model"}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        answers = _ask_while(
            url,
            lambda: subprocess.run(drain_line.split(), capture_output=True, text=True, timeout=90),
        )
        drained, codes = answers
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert codes and set(codes) == {200}, codes
        after = json.loads(
            subprocess.run(
                [*cli_line.split(), "--json"], capture_output=True, text=True, timeout=20
            ).stdout
        )
        moved = [r for r in after["replicas"] if r["model"] == "demo-model"]
        assert len(moved) == 2 and all(r["serving"] and _on(r, "sim-node-2") for r in moved)
        assert not any(_on(r, "sim-node-1") for r in after["replicas"])

        engines = [json.loads(record.read_text())["pid"] for record in work.glob("*/shards/*.json")]
        assert len(engines) == 3
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) == 0
        assert not work.exists()
        assert list(tmp_path.iterdir()) == []
        for pid in engines:
            assert not _alive(pid), pid
    finally:
        if demo.poll() is None:  # a failed check: the demo still stops what it started
            demo.send_signal(signal.SIGTERM)
            try:
                demo.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()


def _on(replica: dict[str, Any], node: str) -> bool:
    return any(s["node"] == node for s in replica["shards"])


def _ask_while(
    url: str, work: Callable[[], subprocess.CompletedProcess[str]]
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """`work`'s result, and the status of each request to demo-model sent one after
    another while it ran."""
    codes: list[int] = []
    done = threading.Event()
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}

    def ask() -> None:
        with httpx.Client(timeout=20) as client:
            while not done.is_set():
                codes.append(client.post(url, json=body).status_code)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        return work(), codes
    finally:
        done.set()
        asker.join(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie not yet reaped by init has ended too.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_demo_refuses_ports_in_use_before_starting_anything(tmp_path: Path) -> None:
    for taken, what in ((0, "the router"), (1, "the control plane")):
        port = free_pair()
        with socket.socket() as holder:
            # free_port hands out ports in TIME_WAIT (servers bind with SO_REUSEADDR): so must this.
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", port + taken))
            holder.listen()
            demo = start_demo(port, tmp_path)
            out, err = demo.communicate(timeout=20)
        assert demo.returncode == 1
        assert out == ""
        assert err.strip() == (
            f"llmgw demo: port {port + taken} ({what}) on 127.0.0.1: in use: stop what listens "
            "there, or run the demo on other ports with LLMGW_DEMO_PORT=PORT (it takes PORT and "
            "PORT+1)"
        )
        assert list(tmp_path.iterdir()) == []  # no directory, no CA key


def test_demo_port_must_be_a_port(tmp_path: Path) -> None:
    for bad in ("0", "http", "65500"):
        demo = start_demo(bad, tmp_path)
        _, err = demo.communicate(timeout=20)
        assert demo.returncode == 2
        assert (
            err.strip() == f"llmgw demo: LLMGW_DEMO_PORT={bad!r} must be a port from 1024 to 65434"
        )


def test_demo_keeps_its_directory_on_request_and_its_configs_check(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    port = free_pair()
    demo = subprocess.Popen(
        [sys.executable, "-m", "llmgw_server.demo", "--keep", str(fleet)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LLMGW_DEMO_PORT": str(port)},
        start_new_session=True,
    )
    try:
        banner = read_banner(demo)
        assert f"Ctrl-C stops it all and keeps {fleet} (" in banner
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) == 0
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.stderr is not None
    said = demo.stderr.read()
    assert f"llmgw demo: kept {fleet}: run it again by hand with " in said, said
    assert (fleet / "certs" / "ca.crt").is_file() and (fleet / "logs" / "server.log").is_file()
    # The configs the docs' local-fleet recipe starts by hand are sound as kept.
    checks = [("llmgw_server", "server.toml")] + [
        ("llmgw_agent", f"{n}.toml") for n in ("sim-node-1", "sim-node-2")
    ]
    for package, config in checks:
        assert f"-m {package} --config {fleet / config}" in said, said
        done = subprocess.run(
            [sys.executable, "-m", package, "check-config", str(fleet / config)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, (config, done.stdout, done.stderr)


def test_demo_keeps_only_a_new_or_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "something").write_text("mine")
    for argv in (["--keep", str(tmp_path)], ["--keep"], ["--kept", "x"]):
        demo = subprocess.run(
            [sys.executable, "-m", "llmgw_server.demo", *argv],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "LLMGW_DEMO_PORT": str(free_pair())},
        )
        assert demo.returncode == 2 and demo.stdout == ""
        assert demo.stderr.startswith("llmgw demo: "), demo.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["something"]
