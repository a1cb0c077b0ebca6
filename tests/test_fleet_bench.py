"""bench/fleet_bench.py's arithmetic: a quantile of a Prometheus histogram is the upper
bound of the first bucket whose cumulative count reaches it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fleet_bench as bench

NAME = "llmgw_control_reconcile_seconds"


def page(counts: list[tuple[str, int]]) -> str:
    lines = ["# HELP x", f"# TYPE {NAME} histogram", "other_bucket{le=\"1\"} 99"]
    lines += [f'{NAME}_bucket{{le="{bound}"}} {count}' for bound, count in counts]
    return "\n".join([*lines, f"{NAME}_sum 1.5", f"{NAME}_count {counts[-1][1]}"])


def test_quantiles_are_bucket_bounds() -> None:
    text = page([("0.005", 50), ("0.01", 98), ("0.025", 99), ("0.05", 100), ("+Inf", 100)])
    assert bench.histogram_bounds(text, NAME, (0.5, 0.98, 0.99, 1.0)) == (
        100,
        [0.005, 0.01, 0.025, 0.05],
    )


def test_a_quantile_past_every_finite_bound_is_infinite() -> None:
    text = page([("0.005", 10), ("+Inf", 100)])
    assert bench.histogram_bounds(text, NAME, (0.05, 0.5)) == (100, [0.005, math.inf])


def test_no_histogram_means_no_steps() -> None:
    assert bench.histogram_bounds("nothing here", NAME, (0.99,)) == (0, [math.inf])
