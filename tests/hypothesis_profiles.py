"""Hypothesis's profiles, chosen by the environment, and per-test example counts relative
to the chosen one.

- `ci`: the counts CI has always run (Hypothesis's default of 100 examples per test, and
  each test's own multiple of it). A `CI` variable selects it, and `make test-long` runs
  every property test again with it (after `make test`, in CI).
- `quarter`: a quarter of that, `make test`'s: its property tests took 90 of its 630 s of
  CPU with `ci`. CI runs both stages, so it runs every example it ran before, and a
  quarter again.
- `dev`: a fifth of `ci`, for a quick run while working on the code.

`HYPOTHESIS_PROFILE` names one explicitly (`HYPOTHESIS_PROFILE=ci pytest tests/test_wire.py`
runs what CI runs), and pytest's `--hypothesis-profile` overrides both. conftest loads
the profile before any test module is imported, so that `profile_times` below, called
while a module is imported, sees it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis import HealthCheck, settings

CI = "ci"
QUARTER = "quarter"
DEV = "dev"

# No wall-clock limits: an example's time or a strategy's speed measured on a machine
# whose cores the other test workers share says how busy it was, not whether the code
# is right (a strategy's "too slow" check failed CI once, at the start of a run); speed
# is for the benchmarks.
for _name, _examples in ((CI, 100), (QUARTER, 25), (DEV, 20)):
    settings.register_profile(
        _name, max_examples=_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def chosen(environ: Mapping[str, str]) -> str:
    """The profile an environment asks for: `HYPOTHESIS_PROFILE`, else `ci` under CI
    (the `CI` variable most CI services set), else `dev`."""
    named = environ.get("HYPOTHESIS_PROFILE", "")
    if named:
        return named
    return CI if environ.get("CI", "") not in ("", "0", "false") else DEV


def load(environ: Mapping[str, str] = os.environ) -> str:
    """Loads the profile `environ` asks for; an unknown name fails at once (Hypothesis
    raises InvalidArgument, naming it)."""
    name = chosen(environ)
    settings.load_profile(name)
    return name


def profile_times(factor: float) -> int:
    """`factor` times the loaded profile's examples per test, at least one: a test whose
    input space needs more (or is too slow for as many) says so relative to the profile,
    so that `dev` and `quarter` stay quick and `ci` keeps every test's count."""
    loaded = settings.default
    assert loaded is not None  # None only while Hypothesis itself is being imported
    return max(1, round(loaded.max_examples * factor))
