from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from procs import Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def fleet(procs: Procs) -> Iterator[object]:
    import os
    import signal

    from fleet import Fleet

    f = Fleet(procs)
    try:
        yield f
    finally:
        pids = f.engine_pids()
        procs.stop_all()
        for pid in pids:  # engines orphaned by an agent killed with SIGKILL
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
