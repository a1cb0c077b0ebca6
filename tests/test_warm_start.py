"""A daemon started warm (forked from the test process's fork server, tests/warm_start.py)
behaves as `python -m` started: its exit status and output, its own session, its own
environment, a signal's end."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

import warm_start
from procs import Proc, Procs, answers, free_port


def run_to_exit(procs: Procs, argv: list[str], env: dict[str, str] | None = None) -> Proc:
    proc = Proc(argv, 0, env)
    procs.all.append(proc)
    proc.popen.wait(30)
    return proc


@pytest.mark.parametrize("cold", [False, True])
def test_a_bad_config_ends_a_warm_start_as_it_ends_python_m(
    procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool
) -> None:
    if cold:
        monkeypatch.setenv("LLMGW_TEST_COLD", "1")
    config = tmp_path / "bad.toml"
    config.write_text('[server]\nlisten = "127.0.0.1:0"\nno_such_key = 1\n')
    proc = run_to_exit(procs, [sys.executable, "-m", "llmgw_server", "--config", str(config)])
    assert isinstance(proc.popen, warm_start.WarmPopen) is not cold
    assert proc.popen.returncode == 2
    assert "no_such_key" in proc.output() and "Traceback" not in proc.output()


@pytest.mark.parametrize("cold", [False, True])
def test_a_warm_start_has_its_own_session_environment_and_directory(
    procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cold: bool
) -> None:
    if cold:
        monkeypatch.setenv("LLMGW_TEST_COLD", "1")
    # The mock engine takes its API key from $VLLM_API_KEY: given to the child alone, it
    # shows in the child's answers.
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "llmgw_mock_engine", "serve", "m", "--port", str(port)],
        port,
        env={"VLLM_API_KEY": "child-only"},
    )
    procs.all.append(proc)
    proc.wait_http("/health")
    assert isinstance(proc.popen, warm_start.WarmPopen) is not cold
    pid = proc.popen.pid
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    assert Path(f"/proc/{pid}/cwd").resolve() == tmp_path.resolve()
    assert answers(port, "/v1/models") == 401
    proc.signal(signal.SIGTERM)  # the mock engine leaves SIGTERM's default: it dies of it
    assert proc.popen.wait(10) == -signal.SIGTERM
    assert proc.popen.poll() == -signal.SIGTERM
