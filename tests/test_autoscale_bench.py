"""The autoscaling benchmark runs (a short day): every policy, both models, and checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_autoscale_bench_runs_every_policy_on_a_short_day() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "autoscale_bench.py"), "--hour-s", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "%" in line]
    policies = {row.split(" | ")[0].strip("| ") for row in rows}
    assert len(rows) == 8 and len(policies) == 4, done.stdout
    assert "llmgw autoscale" in policies and "llm-d saturation rule" in policies
    assert sum(line.startswith(("PASS ", "FAIL ")) for line in done.stdout.splitlines()) == 5
