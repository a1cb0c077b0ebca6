"""docs/control-plane.md names the tests that check each rule of the control core: each
one it names exists, so the specification cannot point at a test that went away."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SECTION = "## How the control core decides"
# The state machine's invariants and rules the section names (test_control_machine.py).
MACHINE = {
    "no_gpu_is_assigned_twice",
    "no_more_replicas_than_desired_run_on_reachable_nodes",
    "multi_node_replicas_stay_in_one_fabric_domain",
    "every_unplaced_replica_is_explained_node_by_node",
    "control_plane_restarts",
    "a_registration_withdraws_no_route",
    "agent_restarts",
}


def _defined() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        found |= set(re.findall(r"def (\w+)\(", path.read_text()))
    return found


def test_every_test_and_invariant_the_specification_names_exists() -> None:
    text = (ROOT / "docs" / "control-plane.md").read_text()
    assert SECTION in text
    section = text[text.index(SECTION) :]
    section = section.split("\n## ", 1)[0]
    named = set(re.findall(r"`(?:[\w/]+\.py)?(?:::)?(\w+)`", section))
    tests = {n for n in named if n.startswith("test_")}
    assert len(tests) >= 30 and named >= MACHINE, sorted(named)
    missing = sorted((tests | MACHINE) - _defined())
    assert not missing, missing
    files = set(re.findall(r"`((?:tests/)?(?:test_)?\w+\.py)", section))
    for name in files:
        if name.startswith("test_"):
            assert (ROOT / "tests" / name).exists() or (
                ROOT / "tests" / "control" / name
            ).exists(), name
        elif name.startswith("tests/"):
            assert (ROOT / name).exists(), name
