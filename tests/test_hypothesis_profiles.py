"""Hypothesis's profile is chosen by the environment, and per-test counts follow it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

from hypothesis_profiles import CI, DEV, QUARTER, chosen, profile_times

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("environ", "profile"),
    [
        ({}, DEV),
        ({"CI": "true"}, CI),
        ({"CI": "1"}, CI),
        ({"CI": ""}, DEV),
        ({"CI": "false"}, DEV),
        ({"CI": "0"}, DEV),
        ({"HYPOTHESIS_PROFILE": "ci"}, CI),
        ({"HYPOTHESIS_PROFILE": "dev", "CI": "true"}, DEV),
        ({"HYPOTHESIS_PROFILE": "", "CI": "true"}, CI),
    ],
)
def test_the_environment_chooses_the_profile(environ: dict[str, str], profile: str) -> None:
    assert chosen(environ) == profile


def test_ci_runs_todays_counts_quarter_a_quarter_and_dev_fewer() -> None:
    assert settings.get_profile(CI).max_examples == 100  # Hypothesis's default, as before
    assert settings.get_profile(QUARTER).max_examples == 25
    assert settings.get_profile(DEV).max_examples < settings.get_profile(QUARTER).max_examples


def test_counts_are_relative_to_the_loaded_profile() -> None:
    # The session's profile, whichever it is, comes back afterwards.
    settings.register_profile("before-this-test", parent=settings.default)
    try:
        for name in (CI, QUARTER, DEV):
            settings.load_profile(name)
            base = settings.get_profile(name).max_examples
            assert profile_times(1) == base
            assert profile_times(3) == 3 * base
            assert profile_times(0.5) == round(base / 2)
            assert profile_times(0.001) == 1  # never none
    finally:
        settings.load_profile("before-this-test")


def test_make_test_runs_a_quarter_of_the_counts_and_the_long_stage_all_of_them() -> None:
    """`make -n test` prints the command: `make test` selects the quarter profile unless
    told otherwise, and `make test-long` runs every property test with CI's counts."""
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is not installed: the project is built with it")

    def dry_run(*args: str, target: str = "test") -> str:
        return subprocess.run(
            [make, "-n", "--no-print-directory", "-C", str(REPO), "-o", "venv",
             "-o", "real-engine", "-o", "real-vllm", "-o", "browser", *args, target],
            capture_output=True, text=True, timeout=30, check=True,
            env={"PATH": "/usr/bin:/bin"},
        ).stdout

    assert "HYPOTHESIS_PROFILE=quarter " in dry_run()
    assert "HYPOTHESIS_PROFILE=dev " in dry_run("HYPOTHESIS_PROFILE=dev")
    long_stage = dry_run(target="test-long")
    assert "HYPOTHESIS_PROFILE=ci " in long_stage and '-m "long or hypothesis"' in long_stage
