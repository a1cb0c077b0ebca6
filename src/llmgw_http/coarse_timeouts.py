"""Timeouts on the data plane's hot paths, kept to a tick of 50 ms.

Each trio deadline lives in the run's deadline heap, and entering, moving or leaving
a scope with one costs far more than the scope: on the router's path for a plain
request, its per-request deadlines (the client connection's keep-alive limit, the
engine's first byte) and scopes took 27 of 130 us of CPU per request (measured
on this repository's benchmark machine). Here an expiry is a key in a
`TimerWheel`, and one task per trio run wakes at each tick that has something due
and calls `cancel()` on what is due: a cancel scope without a trio deadline, or
anything else that can stop a wait, such as a connection that closes its socket
(which wakes its waiting reader at once, and costs no scope at all).

A scope cancelled here is cancelled as a deadline would cancel it (`cancelled_caught`
is set the same way), up to one tick late and never early. The task is a trio system
task, started by the first use in a run and ended with the run: like trio's own
deadlines, these belong to the run, not to whichever task happened to arm one first.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Protocol

import trio

from llmgw_http.timer_wheel import TimerWheel

TICK_S = 0.05


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class _Ticker:
    """The run's wheel, and the scope its task sleeps in until the next due time."""

    __slots__ = ("sleeping", "wheel")

    def __init__(self) -> None:
        self.wheel: TimerWheel[Cancellable] = TimerWheel(TICK_S)
        self.sleeping: trio.CancelScope | None = None

    def arm(self, key: Cancellable, at: float) -> None:
        if self.wheel.arm(key, at) and self.sleeping is not None:
            due = self.wheel.next_due()
            self.sleeping.deadline = math.inf if due is None else due

    async def run(self) -> None:
        wheel = self.wheel
        while True:
            due = wheel.next_due()
            with trio.CancelScope(deadline=math.inf if due is None else due) as sleeping:
                self.sleeping = sleeping
                await trio.sleep_forever()
            self.sleeping = None
            for key in wheel.pop_due(trio.current_time()):
                key.cancel()


_TICKER: trio.lowlevel.RunVar[_Ticker] = trio.lowlevel.RunVar("llmgw_coarse_timeouts")


def _ticker() -> _Ticker:
    try:
        return _TICKER.get()
    except LookupError:
        ticker = _Ticker()
        _TICKER.set(ticker)
        trio.lowlevel.spawn_system_task(ticker.run, name="llmgw coarse timeouts")
        return ticker


def arm(key: Cancellable, at: float) -> None:
    """Call `key.cancel()` at trio time `at` (up to a tick later), unless `key` is armed
    again or disarmed before."""
    _ticker().arm(key, at)


def disarm(key: Cancellable) -> None:
    """`key` is not cancelled when its time comes."""
    _ticker().wheel.disarm(key)


class move_on_after:  # named after the trio function it stands for
    """`trio.move_on_after(seconds)`, with the expiry kept here rather than in trio."""

    __slots__ = ("_scope", "_seconds")

    def __init__(self, seconds: float) -> None:
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, not {seconds!r}")
        self._seconds = seconds
        self._scope = trio.CancelScope()

    def __enter__(self) -> trio.CancelScope:
        scope = self._scope
        scope.__enter__()
        if self._seconds != math.inf:
            _ticker().arm(scope, trio.current_time() + self._seconds)
        return scope

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        _ticker().wheel.disarm(self._scope)
        return self._scope.__exit__(exc_type, exc, traceback)
