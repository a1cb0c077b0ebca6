"""Crashes leave nothing behind: when an engine's main process is SIGKILLed, the rest of
its group gets SIGTERM, a grace, then SIGKILL, and what its processes left in /dev/shm
that nobody holds is removed; what an unrelated live process holds stays."""

from __future__ import annotations

import os
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from llmgw_agent import procinfo
from llmgw_agent import shard_records as records
from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_agent.shm_leftovers import Entry, Holders, holders, leftovers, remove_leftovers, snapshot
from llmgw_agent.supervisor import EngineProcess, Transition
from llmgw_core.inventory import Inventory, LaunchSpec, ShardState
from procs import free_port

FILE = stat.S_IFREG
ME = os.getuid()


def entry(name: str, ino: int, *, uid: int = ME, mode: int = FILE | 0o600) -> Entry:
    return Entry(name, uid, mode, 4096, (7, ino))


def test_only_new_plain_files_of_the_engines_user_that_nobody_holds_are_leftovers() -> None:
    found = [
        entry("old", 1),  # there before the launch
        entry("theirs", 2, uid=ME + 1),
        entry("a-directory", 3, mode=stat.S_IFDIR | 0o700),
        entry("held", 4),
        entry("psm_left", 5),
        entry("sem.mp-left", 6),
    ]
    # Held is by device and inode: a holder's path for it may be another mount's.
    held = Holders(frozenset({(7, 4), (8, 5)}), complete=True)
    assert [e.name for e in leftovers(found, frozenset({"old"}), ME, held)] == [
        "psm_left",
        "sem.mp-left",
    ]


def test_a_file_others_may_open_is_kept_when_some_process_could_not_be_looked_at() -> None:
    found = [entry("private", 1), entry("shared", 2, mode=FILE | 0o666)]
    unsure = Holders(frozenset(), complete=False)
    assert [e.name for e in leftovers(found, frozenset(), ME, unsure)] == ["private"]
    sure = Holders(frozenset(), complete=True)
    assert len(leftovers(found, frozenset(), ME, sure)) == 2


def ident(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


HOLD = """\
import mmap, os, sys, time
open_path, mapped_path, ready = sys.argv[1:4]
held = open(open_path, "wb")  # held by its descriptor
with open(mapped_path, "r+b") as f:  # held by a mapping alone, as a semaphore is
    view = mmap.mmap(f.fileno(), 4096)
open(ready, "w").close()
time.sleep(600)
"""


async def test_holders_sees_open_and_mapped_files_of_live_processes(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "mapped").write_bytes(b"\0" * 4096)
    (shm / "loose").write_bytes(b"x")
    # Private, as Python's shared memory and semaphores are: here /proc/1/maps may be
    # unreadable, and a file others may open is then kept.
    for name in ("mapped", "loose"):
        (shm / name).chmod(0o600)
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(shm / "open"), str(shm / "mapped"), str(ready)])
    try:
        with trio.fail_after(20):
            while not ready.exists():
                await trio.sleep(0.02)
        seen = holders(shm.stat().st_dev)
        assert {ident(shm / "open"), ident(shm / "mapped")} <= seen.files
        assert ident(shm / "loose") not in seen.files
        assert [e.name for e in remove_leftovers(frozenset(), shm)] == ["loose"]
        assert sorted(os.listdir(shm)) == ["mapped", "open"]
    finally:
        holder.kill()
        holder.wait()
    (shm / "open").chmod(0o600)
    assert not {ident(shm / "open"), ident(shm / "mapped")} & holders(shm.stat().st_dev).files
    assert sorted(e.name for e in remove_leftovers(frozenset({"open"}), shm)) == ["mapped"]


# -- a fake engine SIGKILLed under the supervisor, in the real /dev/shm ----------------------

ENGINE = """\
import mmap, os, signal, subprocess, sys, time
tag, out = sys.argv[1], sys.argv[2]
CHILD = '''
import mmap, signal, sys, time
kind, tag, out = sys.argv[1:4]
if kind == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    def stop(*_):
        open(out + "/sigterm", "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
# Each child holds the engine's files as vLLM's processes do: the buffer open, the
# semaphore mapped.
buf = open("/dev/shm/llmgw-test-" + tag + "-buf", "rb")
with open("/dev/shm/sem.llmgw-test-" + tag, "r+b") as f:
    sem = mmap.mmap(f.fileno(), 32)
open(out + "/" + kind, "w").close()
time.sleep(600)
'''
# Created and held, as vLLM's creator holds its segments while its processes open them:
# written and closed, the files were nobody's until the children opened them, so another
# test's agent cleaning up after its own killed engine could take them for leftovers
# (the likely cause of one failure in make test with six workers: both children found
# no file).
held = [open("/dev/shm/llmgw-test-" + tag + "-buf", "wb"), open("/dev/shm/sem.llmgw-test-" + tag, "wb")]
held[0].write(b"\\0" * 1024 * 1024)
held[1].write(b"\\0" * 32)
for f in held:
    f.flush()
os.chmod("/dev/shm/llmgw-test-" + tag + "-buf", 0o600)
os.chmod("/dev/shm/sem.llmgw-test-" + tag, 0o600)
children = [subprocess.Popen([sys.executable, "-c", CHILD, kind, tag, out]) for kind in ("polite", "stubborn")]
with open(out + "/children", "w") as f:
    f.write(" ".join(str(c.pid) for c in children))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def tag() -> Iterator[str]:
    tag = secrets.token_hex(6)
    yield tag
    for path in Path("/dev/shm").glob(f"*llmgw-test-{tag}*"):
        path.unlink()


@pytest.mark.parametrize("how", ["launched", "adopted"])
async def test_a_sigkilled_engine_leaves_no_process_and_no_shared_memory(
    tmp_path: Path, tag: str, how: str
) -> None:
    """Launched by this supervisor, or adopted after an agent restart (the snapshot of
    /dev/shm then comes from the shard's record)."""
    out = tmp_path / "out"
    out.mkdir()
    engine_py = tmp_path / "engine.py"
    engine_py.write_text(ENGINE)
    buf, sem = Path(f"/dev/shm/llmgw-test-{tag}-buf"), Path(f"/dev/shm/sem.llmgw-test-{tag}")
    other = Path(f"/dev/shm/llmgw-test-{tag}-unrelated")
    argv = [sys.executable, str(engine_py), tag, str(out)]
    seen: list[Transition] = []

    async def report(t: Transition) -> None:
        seen.append(t)

    with tempfile.NamedTemporaryFile(suffix=".log") as logfile, trio.fail_after(30):
        async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
            engine = EngineProcess(
                argv, dict(os.environ), None, report, client, Path(logfile.name),
                stop_grace_s=1.0, settle_s=0.1,
            )  # fmt: skip
            if how == "launched":
                pid = await nursery.start(engine.run)
            else:
                before = snapshot()
                earlier = subprocess.Popen(argv, start_new_session=True)
                pid = earlier.pid
                started = procinfo.start_time(pid)
                assert started is not None
                nursery.start_soon(engine.adopt, pid, started, before)
            while not ((out / "polite").exists() and (out / "stubborn").exists()):
                await trio.sleep(0.02)
            children = [int(p) for p in (out / "children").read_text().split()]
            # An unrelated process (its own group) makes and holds a file after the launch.
            unrelated = subprocess.Popen(
                [sys.executable, "-c", f"import time; f = open({str(other)!r}, 'wb'); time.sleep(600)"],
                start_new_session=True,
            )
            try:
                while not other.exists() or ident(other) not in holders(other.stat().st_dev).files:
                    await trio.sleep(0.02)
                assert buf.exists() and sem.exists()
                os.kill(pid, signal.SIGKILL)
                while not any(t.state == "failed" for t in seen):
                    await trio.sleep(0.02)
                # Reported once the group is gone and its files removed.
                assert not any(alive(c) for c in children)
                assert (out / "sigterm").exists()  # SIGTERM came first; the stubborn one got SIGKILL
                assert not buf.exists() and not sem.exists()
                assert other.exists() and alive(unrelated.pid)
            finally:
                unrelated.kill()
                unrelated.wait()
    failed = next(t for t in seen if t.state == "failed")
    if how == "launched":
        assert failed.detail == "the engine was killed by signal 9 (SIGKILL)"
    else:
        earlier.wait()
        assert failed.detail == "the engine exited"  # not its child: no status to read


async def test_an_engine_that_died_while_the_agent_was_away_leaves_nothing_either(
    tmp_path: Path, tag: str
) -> None:
    """Its record kept /dev/shm's names from before the launch: what appeared since and
    nobody holds goes when the new agent finds the engine dead."""
    state = tmp_path / "state"
    before = snapshot()
    left = Path(f"/dev/shm/llmgw-test-{tag}-left")
    left.write_bytes(b"\0" * 4096)
    left.chmod(0o600)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    spec = LaunchSpec(
        replica_id="r-1", model_name="m", engine="vllm", hf_model="org/m", args=(), env={},
        tensor_parallel=1, pipeline_parallel=1, rank=0, nodes=("n1",), gpu_indices=(0,),
        head_address="127.0.0.1", port=free_port(), dist_port=0,
    )  # fmt: skip
    record = records.ShardRecord(spec, dead.pid, 1, ("x",), str(tmp_path / "log"), "id", tuple(sorted(before)))
    records.save(state, record)
    config = parse_agent_config(
        {"name": "n1", "server": f"ws://127.0.0.1:{free_port()}/v1/agent", "insecure": True, "state_dir": str(state)},
        "<test>",
    )
    agent = Agent(config, Inventory(name="n1"))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(agent.run)  # started: the engines it found are dealt with
            nursery.cancel_scope.cancel()
    assert not left.exists()
    assert agent.engines.shards[("r-1", 0)].state is ShardState.FAILED
    assert records.load(state) == []
