"""Engine logs in the agent's state directory are capped in size (copy and truncate under
a real engine that keeps writing) and in count (older starts, rotated copies, and the
logs of replicas gone)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

from llmgw_agent.supervisor import (
    EngineProcess,
    Transition,
    appends,
    open_fresh_log,
    prune_logs,
    read_tail,
    rotate_if_large,
)

# An engine that writes a numbered line every millisecond, forever, each in one write:
# print() under -u writes the text and its newline apart, and a truncation between the
# two starts the next copy with an empty line.
CHATTY = [
    sys.executable,
    "-u",
    "-c",
    "import sys, time\nfor i in range(10**9):\n    sys.stdout.write(f'line {i:09d} ' + 'x' * 80 + '\\n')\n"
    "    time.sleep(0.001)",
]


def test_each_start_keeps_older_logs_up_to_the_count(tmp_path: Path) -> None:
    log = tmp_path / "r.0.log"
    for start in range(4):
        with open_fresh_log(log, keep=2) as out:
            out.write(f"start {start}\n".encode())
    assert log.read_text() == "start 3\n"
    assert (tmp_path / "r.0.log.1").read_text() == "start 2\n"
    assert (tmp_path / "r.0.log.2").read_text() == "start 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.0.log", "r.0.log.1", "r.0.log.2"]
    assert (log.stat().st_mode & 0o777) == 0o600


def test_rotation_copies_then_truncates_and_keeps_the_count(tmp_path: Path) -> None:
    log = tmp_path / "r.0.log"
    log.write_bytes(b"a" * 100)
    assert not rotate_if_large(log, 100, keep=2)  # at the cap, not past it
    for fill in (b"b", b"c", b"d"):
        with log.open("ab") as f:
            f.write(fill * 101)
        assert rotate_if_large(log, 100, keep=2)
        assert log.stat().st_size == 0
    assert (tmp_path / "r.0.log.1").read_bytes() == b"d" * 101
    assert (tmp_path / "r.0.log.2").read_bytes() == b"c" * 101
    assert not (tmp_path / "r.0.log.3").exists()
    assert ((tmp_path / "r.0.log.1").stat().st_mode & 0o777) == 0o600


def test_a_chatty_engine_log_stays_under_its_cap(tmp_path: Path) -> None:
    """The engine writes to the file itself; the agent copies and truncates it under the
    engine, which goes on writing at the new end (append mode: no hole of zeros)."""
    log = tmp_path / "logs" / "r.0.log"
    seen: list[Transition] = []

    async def report(t: Transition) -> None:
        seen.append(t)

    async def main() -> None:
        with trio.fail_after(30):
            async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
                engine = EngineProcess(
                    CHATTY, dict(os.environ), None, report, client, log,
                    stop_on_cancel=True, log_max_bytes=20_000, log_keep=2, log_check_s=0.05,
                )  # fmt: skip
                pid = await nursery.start(engine.run)
                assert appends(pid)
                older = tmp_path / "logs" / "r.0.log.2"
                while not older.exists():  # rotated at least twice
                    await trio.sleep(0.05)
                for _ in range(5):  # a few more checks, each under the engine's writes
                    await trio.sleep(0.1)
                    assert log.stat().st_size < 200_000
                nursery.cancel_scope.cancel()

    trio.run(main)
    # Each write landed at the end, not at the old offset: no hole of zeros in the log or
    # in its copies (each holds what the engine wrote after a truncation, so a write at
    # the old offset shows there too). The log itself may be empty: truncated just
    # before the engine was stopped.
    for path in (log, log.with_name("r.0.log.1"), log.with_name("r.0.log.2")):
        assert b"\0" not in path.read_bytes(), path.name
    assert all(line.startswith("line ") for line in read_tail(log))
    # The copies are whole lines of the engine's output, in order, older in .2.
    newer = (tmp_path / "logs" / "r.0.log.1").read_text().splitlines()
    oldest = (tmp_path / "logs" / "r.0.log.2").read_text().splitlines()
    assert newer[0].startswith("line ") and oldest[0].startswith("line ")
    assert int(oldest[-1].split()[1]) < int(newer[0].split()[1])
    assert len(list((tmp_path / "logs").iterdir())) == 3
    assert [t.state for t in seen][:1] == ["starting"]


def test_append_mode_is_read_from_proc(tmp_path: Path) -> None:
    """An adopted engine's log is capped only when it writes in append mode (an engine an
    older agent started without it would leave a hole of zeros after a truncation)."""
    procs = []
    for flags in (os.O_WRONLY | os.O_CREAT, os.O_WRONLY | os.O_CREAT | os.O_APPEND):
        fd = os.open(tmp_path / f"{flags}.log", flags, 0o600)
        procs.append(
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=fd)
        )
        os.close(fd)
    try:
        assert [appends(p.pid) for p in procs] == [False, True]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not appends(procs[0].pid)  # gone: nothing to read


def test_old_logs_of_replicas_gone_are_pruned_oldest_first(tmp_path: Path) -> None:
    now = time.time()
    names = [f"m-a-{i}.0.log" for i in range(8)]
    for i, name in enumerate(names):
        path = tmp_path / name
        path.write_text(name)
        os.utime(path, (now - 100 + i, now - 100 + i))
    (tmp_path / "m-a-0.0.log.1").write_text("older start of a known shard")
    os.utime(tmp_path / "m-a-0.0.log.1", (now - 200, now - 200))
    # m-a-0 still runs (known to the agent): its logs stay, however old.
    removed = prune_logs(tmp_path, 5, {"m-a-0.0.log"})
    assert sorted(p.name for p in removed) == ["m-a-1.0.log", "m-a-2.0.log", "m-a-3.0.log", "m-a-4.0.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "m-a-0.0.log", "m-a-0.0.log.1", "m-a-5.0.log", "m-a-6.0.log", "m-a-7.0.log"
    ]  # fmt: skip
    assert prune_logs(tmp_path, 5, set()) == []
