"""bench/dataplane_bench.py's arithmetic: a gateway's CPU is its whole process tree's, and
each llmgw figure is set against vllm-router's with the same policy."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import dataplane_bench as bench

# A parent that starts a child burning 0.4 s of CPU, waits for it (so its time moves into
# the parent's reaped-children counts), then a second child that burns as much and stays.
_BURN = (
    "import time\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.4: pass\n"
    "print('burnt', flush=True)\n"
    "time.sleep(60)\n"
)
_PARENT = (
    "import subprocess, sys\n"
    f"subprocess.run([sys.executable, '-c', {_BURN.replace('time.sleep(60)', '')!r}])\n"
    f"subprocess.Popen([sys.executable, '-c', {_BURN!r}])\n"
    "import time; time.sleep(60)\n"
)


def test_tree_cpu_counts_live_and_reaped_children() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        deadline = time.monotonic() + 60
        burnt = 0
        while burnt < 2 and time.monotonic() < deadline:
            if parent.stdout.readline().strip() == "burnt":
                burnt += 1
        assert burnt == 2
        tree = bench.process_tree(parent.pid)
        assert len(tree) == 2  # the parent and its live child; the first child was reaped
        assert bench.own_cpu_s(parent.pid) < 0.3  # the parent itself only waited
        assert bench.tree_cpu_s(parent.pid) >= 0.75  # both children's 0.4 s, less a tick each
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def _sample(round_no: int, gateway: str, kind: str, cpu_ms: float) -> bench.Sample:
    return bench.Sample(round_no, gateway, kind, cpu_ms, cpu_ms, 0.01, 1000, 500.0, 1.0, 2.0, {})


def test_ratios_are_to_the_same_policy_in_the_same_run() -> None:
    def gateway(name: str, product: str, policy: str) -> bench.Gateway:
        proc = argparse.Namespace(argv=[], pid=0)
        return bench.Gateway(name, product, policy, 1, [], proc)  # type: ignore[arg-type]  # a stand-in for its Popen

    gateways = [
        gateway("vr rr", "vllm-router", "round_robin"),
        gateway("vr ca", "vllm-router", "cache_aware"),
        gateway("llmgw rr", "llmgw", "round_robin"),
        gateway("llmgw ca", "llmgw", "cache_aware"),
    ]
    samples = []
    # vllm-router's own figure moves between rounds; llmgw's is 3x (rr) and 2x (ca) of it.
    for round_no, vr in enumerate([0.1, 0.2, 0.1, 0.15, 0.1], start=1):
        samples += [
            _sample(round_no, "vr rr", "plain", vr),
            _sample(round_no, "vr ca", "plain", 2 * vr),
            _sample(round_no, "llmgw rr", "plain", 3 * vr),
            _sample(round_no, "llmgw ca", "plain", 4 * vr),
        ]
    args = argparse.Namespace(kinds=["plain"], chunks=50)
    rows = {r["gateway"]: r for r in bench.summarize(gateways, samples, args)}
    assert rows["vr rr"]["cpu_ms_median"] == pytest.approx(0.1)
    assert rows["llmgw rr"]["ratio_to_vllm_router"] == pytest.approx(3.0)
    assert rows["llmgw rr"]["ratio_per_round_min"] == pytest.approx(3.0)
    assert rows["llmgw rr"]["ratio_per_round_max"] == pytest.approx(3.0)
    assert rows["llmgw ca"]["ratio_to_vllm_router"] == pytest.approx(2.0)
    assert rows["llmgw ca"]["ratio_per_round_median"] == pytest.approx(2.0)
    assert rows["vr ca"]["ratio_to_vllm_router"] == pytest.approx(1.0)
