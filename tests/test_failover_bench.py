"""bench/failover_bench.py's arithmetic: a sample read from a /metrics page by its whole
name, and the leadership changes that no injected fault explains."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import failover_bench as bench

PAGE = "\n".join(
    [
        "llmgw_control_leadership_changes_total 3",
        "# TYPE llmgw_control_leader gauge",
        "llmgw_control_leader 1",
        'llmgw_control_nodes{status="reachable"} 1002',
        'llmgw_control_nodes{status="lost"} 0',
    ]
)


def test_a_sample_is_read_by_its_whole_name() -> None:
    assert bench.metric(PAGE, "llmgw_control_leader") == 1
    assert bench.metric(PAGE, "llmgw_control_leadership_changes_total") == 3
    assert bench.metric(PAGE, 'llmgw_control_nodes{status="reachable"}') == 1002
    assert bench.metric(PAGE, "llmgw_control_epoch") is None


def _bench(kinds: list[str], changes: dict[tuple[int, int], int]) -> bench.Bench:
    run = bench.Bench(argparse.Namespace(), Path("/nonexistent"), Path("/nonexistent"))
    run.faults = [bench.Fault(kind, k, 0, 0.0) for k, kind in enumerate(kinds)]
    run.changes_seen = changes
    return run


def test_each_fault_explains_its_own_leadership_changes() -> None:
    """Plane 0 leads first and is killed (its count, 1, read before the kill); plane 1
    leads next and is black-holed (began, then ended when woken: 2); plane 2 leads last
    (1); the killed plane 0 came back as a standby (0)."""
    changes = {(0, 1): 1, (1, 1): 2, (2, 1): 1, (0, 2): 0}
    assert _bench(["kill", "black hole"], changes).unexplained_changes() == (4, 0)
    # A leader that stepped down and led again without a fault: two changes more.
    changes[(2, 1)] = 3
    assert _bench(["kill", "black hole"], changes).unexplained_changes() == (6, 2)
