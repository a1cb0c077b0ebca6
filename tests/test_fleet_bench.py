"""bench/fleet_bench.py's arithmetic: a quantile of a Prometheus histogram is the upper
bound of the first bucket whose cumulative count reaches it; and the simulator's words
for why a session failed."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fleet_bench as bench
import fleet_sim
import trio

from llmgw_core.dial import ConnectFailed

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


# -- the simulator's words for a failed session -------------------------------------


def test_a_failure_is_named_by_its_cause_never_by_the_address() -> None:
    """The last 10,000-node run's table cut 'cannot connect to 127.0.0.1:34843: Error
    connecting to ('127' at 60 characters: the cause was lost."""
    cases = {
        "cannot connect to 127.0.0.1:34843: Error connecting to ('127.0.0.1', 34843): "
        "[Errno 104] Connection reset by peer": "cannot connect to [Errno 104] Connection reset by peer",
        "127.0.0.1:34843 closed the connection during the TLS handshake": (
            "closed the connection during the TLS handshake"
        ),
        "refused by the control plane: HTTP 503: busy registering others": (
            "refused by the control plane: HTTP 503"
        ),
        "connection refused by 127.0.0.1:5: nothing listens there": "refused",
        "no answer from the control plane at 127.0.0.1:3 within 45 s (timeout, during the "
        "TLS handshake)": "no answer (timeout, during the TLS handshake)",
    }
    for text, why in cases.items():
        assert fleet_sim.why_failed(ConnectFailed(text)) == why
        assert fleet_sim.why_failed(ExceptionGroup("x", [ConnectFailed(text)])) == why
    assert fleet_sim.why_failed(trio.TooSlowError()) == "TooSlowError"
