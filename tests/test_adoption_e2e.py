"""A restarted agent adopts its engines whatever launches them: a console script (as
vLLM's `vllm`), a shell wrapper that forks the engine or execs it, or a direct
`python -m`, as a binary would be (tests/test_llamacpp_managed.py adopts the real
llama-server binary); what is left of an engine it cannot adopt is stopped, never left
holding its GPU and port beside its replacement. Real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from fleet import MOCK, Fleet, wait_until
from llmgw_agent import procinfo

MODEL = (
    '\n[[models]]\nname = "chat"\nreplicas = 2\n[models.profile]\nengine = "vllm"\n'
    'model = "org/chat"\ntensor_parallel = 1\ngpu_memory_gib = 20\n'
)


def forking_wrapper(directory: Path) -> list[str]:
    """A shell script that runs the engine as its child (no exec): the recorded PID is
    the shell's."""
    script = directory / "engine.sh"
    script.write_text(f'#!/bin/sh\n"{sys.executable}" -m llmgw_mock_engine "$@"\n')
    script.chmod(0o755)
    return [str(script)]


def console_script() -> list[str]:
    """The virtualenv's `llmgw-mock-engine`: the kernel's command line starts with the
    interpreter."""
    return [str(Path(sys.executable).parent / "llmgw-mock-engine")]


def alive(pid: int) -> bool:
    return procinfo.running(pid)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


# `sh -c 'exec ...'`: the shell becomes the engine, whose command line is not the argv run.
EXEC_WRAPPER = ["sh", "-c", 'exec "$0" -m llmgw_mock_engine "$@"', sys.executable]


@pytest.mark.parametrize(
    "kind", ["console script", "forking shell wrapper", "sh -c exec wrapper", "python -m"]
)
def test_a_restarted_agent_adopts_two_engines_across_a_control_plane_restart(fleet: Fleet, kind: str) -> None:
    command = {
        "console script": console_script(),
        "forking shell wrapper": forking_wrapper(fleet.procs.tmp),
        "sh -c exec wrapper": EXEC_WRAPPER,
        "python -m": MOCK,
    }[kind]
    fleet.server(MODEL)
    agent = fleet.agent("gpu-1", "node-2xl4.toml", command=command)
    before = wait_until(lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None, what="two replicas")
    pids = sorted(fleet.engine_pids())
    assert len(pids) == 2
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(10) == 0
    # The control plane restarts while the agent is away.
    assert fleet.server_proc is not None
    fleet.server_proc.signal(signal.SIGTERM)
    assert fleet.server_proc.popen.wait(10) == 0
    fleet.server(MODEL)
    assert all(alive(pid) for pid in pids)  # the engines serve on without either
    agent = fleet.agent("gpu-1", "node-2xl4.toml", command=command)
    after = wait_until(lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None, what="both adopted")
    output = agent.output()
    for pid in pids:
        assert f"adopting engine pid {pid}" in output, output
    assert ": starting pid" not in output and "ended while the agent was away" not in output, output
    assert {r["replica_id"] for r in after} == {r["replica_id"] for r in before}
    assert all(r["attempt"] == 0 for r in after)
    answer = wait_until(
        lambda: httpx.post(fleet.url + "/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]}, timeout=10),
        what="traffic",
    )
    assert answer.status_code == 200


def test_what_is_left_of_an_engine_that_cannot_be_adopted_is_stopped_before_its_replacement(fleet: Fleet) -> None:
    fleet.server(MODEL.replace("replicas = 2", "replicas = 1"))
    agent = fleet.agent("gpu-1", "node-2xl4.toml", command=forking_wrapper(fleet.procs.tmp))
    replica = wait_until(lambda: fleet.serving("chat"), what="a replica")[0]
    (wrapper,) = fleet.engine_pids()
    (engine,) = children(wrapper)
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(10) == 0
    # The wrapper dies while the agent is away; the engine it forked runs on, in its group,
    # holding the GPU and the port.
    os.kill(wrapper, signal.SIGKILL)
    wait_until(lambda: not alive(wrapper), what="the wrapper gone")
    assert alive(engine)
    agent = fleet.agent("gpu-1", "node-2xl4.toml", command=forking_wrapper(fleet.procs.tmp))
    wait_until(lambda: f"its process group (pids {engine}) is stopped" in agent.output(), what="the report")
    wait_until(lambda: not alive(engine), timeout=5, what="the leftover engine stopped")
    restarted = wait_until(lambda: [r for r in fleet.serving("chat") if r["attempt"] >= 1], what="a replacement")[0]
    assert restarted["replica_id"] == replica["replica_id"]
    started = [int(line.rsplit(" ", 1)[1]) for line in agent.output().splitlines() if ": starting pid " in line]
    assert started and engine not in started


async def test_what_is_left_ignoring_sigterm_is_killed_and_a_group_not_proven_ours_is_not_touched(
    tmp_path: Path,
) -> None:
    """stop_leftovers: SIGTERM to the group, the grace, then SIGKILL, the whole group (a
    child that scrubbed its environment too: only the engine's session is in it); a
    group in which no process carries the launch's marker is never signalled."""
    import subprocess

    import trio

    from llmgw_agent.adoption import MARKER, Identity
    from llmgw_agent.supervisor import stop_leftovers

    launch = "r-1.0.0123456789abcdef"
    # The leader starts a child that ignores SIGTERM (the engine left behind) and one
    # with its environment scrubbed, then is killed.
    script = 'trap "" TERM; sleep 60 & env -u LLMGW_LAUNCH_ID sleep 60 & echo "$!" > scrubbed; wait'
    leader = subprocess.Popen(
        ["sh", "-c", script], cwd=tmp_path, env={**os.environ, MARKER: launch}, start_new_session=True
    )
    started = procinfo.start_time(leader.pid)
    assert started is not None
    try:
        with trio.fail_after(20):
            while not (tmp_path / "scrubbed").exists() or len(children(leader.pid)) < 2:
                await trio.sleep(0.05)
            scrubbed = int((tmp_path / "scrubbed").read_text())
            (ignoring,) = [p for p in children(leader.pid) if p != scrubbed]
            leader.kill()
            leader.wait()
            # Another launch's record for this group: nothing in it carries its marker.
            assert await stop_leftovers(Identity(leader.pid, started, "r-1.0.ffffffffffffffff"), 0.5)
            assert alive(ignoring) and alive(scrubbed)
            assert await stop_leftovers(Identity(leader.pid, started, launch), grace_s=0.5)
            assert not alive(ignoring)  # it ignored SIGTERM: SIGKILL after the grace
            assert not alive(scrubbed)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
