"""Awake time (llmgw_core/awake_time.py): the monotonic clock less the stalls its watch
saw, taken off from the moment they happen."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_core.awake_time import AwakeTime


def test_a_stall_is_taken_off_before_and_after_the_watch_sees_it() -> None:
    clock = AwakeTime(last_watch=100.0, tick_s=0.1)
    assert clock.awake(100.05) == 100.05  # a wake not yet due
    clock.watched(100.1)
    # The loop stalls 3 s: a step right after it, before the watch runs, sees no time pass.
    assert clock.awake(103.1) == clock.awake(100.1 + clock.tick_s + clock.slack_s)
    assert clock.watched(103.1) == pytest.approx(3.0 - clock.tick_s - clock.slack_s)
    assert clock.awake(103.2) - clock.awake(103.1) == pytest.approx(0.1)  # then 1:1 again
    # A deadline 5 s of awake time ahead, in monotonic time.
    deadline = clock.awake(103.1) + 5.0
    assert clock.monotonic(deadline, 103.1) == pytest.approx(108.1)
    # Asked during a stall the watch has not seen yet: the stall so far is added.
    assert clock.monotonic(deadline, 105.1) == pytest.approx(108.1 + 2.0 - 0.35)


@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 1.0)),  # a watch's lateness, a query
        max_size=40,
    )
)
def test_awake_time_never_goes_back_and_loses_only_lateness_past_the_slack(
    turns: list[tuple[float, float]],
) -> None:
    clock = AwakeTime(last_watch=0.0)
    now, last, lost = 0.0, clock.awake(0.0), 0.0
    for late, query in turns:
        asked = now + min(query, clock.tick_s + late)  # a step between two wakes
        assert clock.awake(asked) >= last - 1e-9  # float rounding at most
        last = clock.awake(asked)
        now += clock.tick_s + late
        assert clock.awake(now) >= last - 1e-9
        lost += max(0.0, late - clock.slack_s)
        clock.watched(now)
        last = clock.awake(now)
        assert abs(now - last - lost) < 1e-6
