"""Engine supervision with real processes: readiness, output tail, stop by process group."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import httpx
import trio

from llmgw_agent.supervisor import EngineProcess, Report, Transition, how_it_ended, read_tail
from procs import free_port


def LOG() -> Path:
    fd, name = tempfile.mkstemp(suffix=".log")
    os.close(fd)
    return Path(name)


def alive(pid: int) -> bool:
    """Running, not a zombie (in a container nobody may reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def gone(pid: int, within_s: float = 5.0) -> None:
    """Wait until the process has ended (an orphan's last SIGKILL lands asynchronously)."""
    with trio.fail_after(within_s):
        while alive(pid):
            await trio.sleep(0.02)


def recorder() -> tuple[list[Transition], Report]:
    seen: list[Transition] = []

    async def report(t: Transition) -> None:
        seen.append(t)

    return seen, report


async def test_ready_then_stopped_on_cancel() -> None:
    seen, report = recorder()
    port = free_port()
    argv = [sys.executable, "-m", "llmgw_mock_engine", "serve", "m", "--port", str(port)]
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=1) as client, trio.open_nursery() as nursery:
            engine = EngineProcess(
                argv, dict(os.environ), f"http://127.0.0.1:{port}/health", report, client,
                LOG(), stop_on_cancel=True,
            )
            pid = await nursery.start(engine.run)
            while not any(t.state == "ready" for t in seen):
                await trio.sleep(0.05)
            assert (await client.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 200
            nursery.cancel_scope.cancel()
    assert [t.state for t in seen] == ["starting", "ready", "stopped"]
    assert not alive(pid)


async def test_crash_is_reported_with_the_output_tail() -> None:
    seen, report = recorder()
    script = "import sys\nfor i in range(100): print('line', i)\nprint('CUDA out of memory', flush=True)\nsys.exit(3)"
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=1) as client:
            engine = EngineProcess(
                [sys.executable, "-c", script], dict(os.environ), None, report, client,
                LOG(), settle_s=30,
            )
            await engine.run()
    assert [t.state for t in seen] == ["starting", "failed"]
    failed = seen[-1]
    assert "status 3" in failed.detail
    assert failed.output_tail[-1] == "CUDA out of memory"
    assert len(failed.output_tail) == 40


async def test_an_engine_killed_by_a_signal_is_reported_as_killed_not_as_exited() -> None:
    seen, report = recorder()
    script = "import os, signal\nprint('about to go', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)"
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=1) as client:
            engine = EngineProcess(
                [sys.executable, "-c", script], dict(os.environ), None, report, client,
                LOG(), settle_s=30,
            )
            await engine.run()
    assert [t.state for t in seen] == ["starting", "failed"]
    assert seen[-1].detail == "the engine was killed by signal 9 (SIGKILL)"
    assert seen[-1].output_tail == ("about to go",)


def test_the_exit_text_for_each_kind_of_ending() -> None:
    assert how_it_ended(3) == "the engine exited with status 3"
    assert how_it_ended(-15) == "the engine was killed by signal 15 (SIGTERM)"
    assert how_it_ended(-40) == "the engine was killed by signal 40"  # a real-time signal: no name
    assert how_it_ended(137) == "the engine exited with status 137"  # no shell between: its own code
    assert how_it_ended(None) == "the engine exited"  # adopted: not our child, no status


async def test_stop_kills_the_whole_group_even_when_sigterm_is_ignored() -> None:
    seen, report = recorder()
    # The engine ignores SIGTERM and leaves a grandchild that ignores it too.
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=1) as client, trio.open_nursery() as nursery:
            engine = EngineProcess(
                [sys.executable, "-c", script],
                dict(os.environ),
                None,
                report,
                client,
                LOG(),
                stop_grace_s=0.5,
                settle_s=0.2,
                stop_on_cancel=True,
            )
            await nursery.start(engine.run)
            while not read_tail(engine.log_path):
                await trio.sleep(0.05)
            grandchild = int(read_tail(engine.log_path)[0])
            nursery.cancel_scope.cancel()
    assert seen[-1].state == "stopped"
    await gone(grandchild)


async def test_a_missing_binary_fails_cleanly() -> None:
    seen, report = recorder()
    async with httpx.AsyncClient(timeout=1) as client:
        await EngineProcess(["/nonexistent/vllm"], {}, None, report, client, LOG()).run()
    assert [t.state for t in seen] == ["failed"] and "cannot start" in seen[0].detail


async def test_cancelled_without_a_stop_command_the_engine_keeps_running() -> None:
    """An agent that shuts down leaves its engines serving; a later agent adopts them."""
    seen, report = recorder()
    port = free_port()
    argv = [sys.executable, "-m", "llmgw_mock_engine", "serve", "m", "--port", str(port)]
    url = f"http://127.0.0.1:{port}/health"
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=1) as client:
            async with trio.open_nursery() as nursery:
                engine = EngineProcess(argv, dict(os.environ), url, report, client, LOG())
                pid = await nursery.start(engine.run)
                while not any(t.state == "ready" for t in seen):
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            assert alive(pid) and [t.state for t in seen] == ["starting", "ready"]
            from llmgw_agent import procinfo

            adopted, report2 = recorder()
            async with trio.open_nursery() as nursery:
                again = EngineProcess(argv, {}, url, report2, client, engine.log_path, stop_on_cancel=True)
                started = procinfo.start_time(pid)
                assert started is not None
                nursery.start_soon(again.adopt, pid, started)
                while not any(t.state == "ready" for t in adopted):
                    await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
    assert [t.state for t in adopted] == ["ready", "stopped"]
    await gone(pid)


async def test_an_engine_that_never_becomes_healthy_is_stopped_and_reported() -> None:
    seen, report = recorder()
    port = free_port()
    # The tail must hold what the engine printed: a line at once, from the shell that
    # then becomes the engine. (The mock's own first line comes after its imports, which
    # may take longer than the 1 s limit on a busy machine.)
    argv = [
        "sh", "-c", 'echo "engine launching"; exec "$0" "$@"',
        sys.executable, "-m", "llmgw_mock_engine", "serve", "m", "--port", str(port), "--mock-startup-delay", "60",
    ]  # fmt: skip
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=1) as client:
            engine = EngineProcess(
                argv, dict(os.environ), f"http://127.0.0.1:{port}/health", report, client,
                LOG(), start_timeout_s=1.0, stop_grace_s=1.0,
            )
            await engine.run()
    assert [t.state for t in seen] == ["starting", "failed"]
    assert seen[-1].detail == "the engine did not become healthy within 1 s"
    assert any("engine launching" in line for line in seen[-1].output_tail)


async def test_each_start_writes_a_fresh_log(tmp_path: Path) -> None:
    """The failure tail is this attempt's; the previous attempt's log is kept as .1."""
    log = tmp_path / "r-1.0.log"
    log.write_text("".join(f"earlier attempt {i}\n" for i in range(100)))
    seen, report = recorder()
    async with httpx.AsyncClient(timeout=1) as client:
        engine = EngineProcess(
            [sys.executable, "-c", "print('this attempt'); raise SystemExit(1)"],
            dict(os.environ), None, report, client, log, settle_s=30,
        )
        with trio.fail_after(20):
            await engine.run()
    assert seen[-1].state == "failed" and seen[-1].output_tail == ("this attempt",)
    assert log.read_text() == "this attempt\n"
    assert (tmp_path / "r-1.0.log.1").read_text().startswith("earlier attempt 0\n")
    assert log.stat().st_mode & 0o777 == 0o600


# An engine that requires its key: on /health only with it, reads its key file, and
# prints the key in its log as SGLang prints its arguments; it exits once probed.
KEYED_ENGINE = """
import http.server, os, stat, sys, threading
port, key_file = int(sys.argv[1]), sys.argv[2]
key = open(key_file).read().split(": ", 1)[1].strip().strip('"')
print("key file mode", oct(stat.S_IMODE(os.stat(key_file).st_mode)), flush=True)
print("server_args={'api_key': '%s'}" % key, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer " + key
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", "0")
        self.end_headers()
        if ok:
            threading.Timer(0.2, os._exit, (3,)).start()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


async def test_the_key_file_is_private_probes_carry_the_key_and_the_tail_masks_it(
    tmp_path: Path,
) -> None:
    seen, report = recorder()
    port = free_port()
    key = "k-7d1e0c9b"
    key_file = tmp_path / "shards" / "r-1.0.key.yaml"
    async with httpx.AsyncClient(timeout=1) as client:
        engine = EngineProcess(
            [sys.executable, "-c", KEYED_ENGINE, str(port), str(key_file)],
            dict(os.environ), f"http://127.0.0.1:{port}/health", report, client,
            tmp_path / "r-1.0.log", api_key=key, files=((str(key_file), f'api-key: "{key}"\n'),),
        )
        with trio.fail_after(20):
            await engine.run()
    assert [t.state for t in seen] == ["starting", "ready", "failed"]
    assert seen[-1].output_tail == ("key file mode 0o600", "server_args={'api_key': '****'}")
    assert key not in repr(engine)
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700


def test_a_key_cut_by_the_tail_window_is_not_left_half_shown(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    key = "k" * 20 + "SECRET" + "k" * 20
    # The 64 KiB window begins inside the key: its second half must not come out.
    filler = b"x" * (64 * 1024 - 23)
    log.write_bytes(b"args: --api-key " + key.encode() + b"\n" + filler + b"\nlast line\n")
    tail = read_tail(log, secret=key)
    assert tail[-1] == "last line"
    assert not any("SECRET" in line or "kkkk" in line for line in tail)
