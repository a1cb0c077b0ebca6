"""The timer wheel against a plain model: nothing falls due early, nothing a tick late."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_http.timer_wheel import TimerWheel

TICK = 0.05
times = st.floats(min_value=0, max_value=100, allow_nan=False)
keys = st.integers(min_value=0, max_value=7)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("arm"), keys, times),
        st.tuples(st.just("disarm"), keys, st.just(0.0)),
        st.tuples(st.just("advance"), st.just(0), st.floats(min_value=0, max_value=5)),
    ),
    max_size=60,
)


@given(steps)
def test_keys_fall_due_at_their_tick_and_only_once(plan: list[tuple[str, int, float]]) -> None:
    wheel: TimerWheel[int] = TimerWheel(TICK)
    armed: dict[int, float] = {}  # the model: key -> the time it was armed for
    now = 0.0
    for action, key, value in plan:
        if action == "arm":
            wheel.arm(key, value)
            armed[key] = value
        elif action == "disarm":
            wheel.disarm(key)
            armed.pop(key, None)
        else:
            now += value
            due = wheel.pop_due(now)
            assert len(due) == len(set(due))
            for k in due:
                assert armed[k] <= now + 1e-9  # never early
            late = {k for k, at in armed.items() if math.ceil(at / TICK) * TICK <= now}
            assert set(due) == late  # everything due comes out, at its tick
            for k in due:
                del armed[k]
        assert len(wheel) == len(armed)
        assert all(k in wheel for k in armed)
        expected = min((math.ceil(at / TICK) * TICK for at in armed.values()), default=None)
        assert wheel.next_due() == expected


def test_arming_reports_a_new_earliest_slot() -> None:
    wheel: TimerWheel[str] = TimerWheel(TICK)
    assert wheel.arm("a", 10.0) is True  # the first
    assert wheel.arm("b", 20.0) is False  # later than what is due first
    assert wheel.arm("c", 10.01) is False  # the same tick as "a"
    assert wheel.arm("d", 5.0) is True
    assert wheel.next_due() == pytest.approx(5.0)
    wheel.disarm("d")
    assert wheel.next_due() == pytest.approx(10.0)
    assert wheel.arm("a", math.inf) is False  # disarmed
    assert "a" not in wheel and len(wheel) == 2
    assert wheel.pop_due(10.5) == ["c"]
    assert wheel.pop_due(100.0) == ["b"] and wheel.next_due() is None


def test_a_tick_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tick_s must be positive"):
        TimerWheel(0.0)
