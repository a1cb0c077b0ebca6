"""Coarse timeouts: scopes and connections cancelled by the run's ticker, never early."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw_http import coarse_timeouts
from llmgw_http.coarse_timeouts import TICK_S


async def test_move_on_after_cancels_within_a_tick_and_never_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for seconds in (0.0, 0.01, 0.3, 7.0, 600.0):
        started = trio.current_time()
        with coarse_timeouts.move_on_after(seconds) as scope:
            await trio.sleep_forever()
        waited = trio.current_time() - started
        assert scope.cancelled_caught
        assert seconds <= waited <= seconds + TICK_S + 1e-9, (seconds, waited)


async def test_a_scope_left_before_its_time_is_not_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with coarse_timeouts.move_on_after(1.0) as early:
        await trio.sleep(0.5)
    with coarse_timeouts.move_on_after(2.0) as later:
        await trio.sleep(1.0)  # past the first scope's time: it was disarmed on leaving
    assert not early.cancelled_caught and not later.cancelled_caught
    with coarse_timeouts.move_on_after(float("inf")) as never:
        await trio.sleep(10_000)
    assert not never.cancelled_caught


async def test_a_sooner_expiry_wakes_the_ticker_sleeping_for_a_later_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    results: dict[str, float] = {}

    async def wait(name: str, seconds: float) -> None:
        started = trio.current_time()
        with coarse_timeouts.move_on_after(seconds):
            await trio.sleep_forever()
        results[name] = trio.current_time() - started

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "late", 100.0)
        await trio.sleep(1.0)  # the ticker now sleeps until the late one's time
        nursery.start_soon(wait, "soon", 2.0)
    assert results["soon"] == pytest.approx(2.0, abs=TICK_S)
    assert results["late"] == pytest.approx(100.0, abs=TICK_S)


async def test_an_armed_scope_is_moved_and_disarmed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.CancelScope() as scope:
        for _ in range(5):  # each arming replaces the last: armed 1 s ahead, five times
            coarse_timeouts.arm(scope, trio.current_time() + 1.0)
            await trio.sleep(0.9)
        coarse_timeouts.disarm(scope)
        await trio.sleep(5.0)
    assert not scope.cancelled_caught
    started = trio.current_time()
    with trio.CancelScope() as scope:
        coarse_timeouts.arm(scope, trio.current_time() + 1.0)
        await trio.sleep_forever()
    assert scope.cancelled_caught and trio.current_time() - started >= 1.0


async def test_anything_with_cancel_can_be_armed(autojump_clock: trio.testing.MockClock) -> None:
    class Closer:
        def __init__(self) -> None:
            self.when: float | None = None

        def cancel(self) -> None:
            self.when = trio.current_time()

    closer = Closer()
    coarse_timeouts.arm(closer, trio.current_time() + 3.0)
    await trio.sleep(10)
    assert closer.when is not None and 3.0 <= closer.when <= 3.0 + TICK_S + 1e-9


def test_a_negative_or_nan_timeout_is_refused() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="timeout must be"):
            coarse_timeouts.move_on_after(bad)
