"""A test run leaves no process logs in the system's temporary directory."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from procs import Proc, Procs


def test_a_process_log_goes_under_pytests_temporary_directory(
    procs: Procs, tmp_path_factory: pytest.TempPathFactory
) -> None:
    started = Proc([sys.executable, "-c", "print('logged')"], 0)
    procs.all.append(started)
    started.popen.wait(10)
    assert started.output().strip() == "logged"
    # pytest's base directory, whose old sessions pytest removes; not the system's.
    assert started.log.is_relative_to(tmp_path_factory.getbasetemp())
    assert started.log.parent != Path(tempfile.gettempdir())
