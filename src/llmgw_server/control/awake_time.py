"""The control plane's clock: time it was awake to hear its nodes.

A node is silent when the control plane could have heard from it and did not. When the
control plane's own process stalls (a paused VM, a starved CPU, a long GC), the nodes'
heartbeats wait unread in its sockets; counted on the wall clock, that stall would turn
its nodes unreachable at the first step after it, before a single waiting heartbeat is
read: a minority would have their streams closed and register again, a majority would
hold the mass-loss guard for nothing. So every time the reconciler is given
(heartbeats, ticks, deadlines) is awake time: the monotonic clock less the stalls.

A stall is what the shell's watch task sees: it asks to wake every `tick_s`, and a wake
later than `slack_s` past that is a stall of the whole lateness beyond the slack. Between
the watch's wakes the stall in progress is already taken off (`awake`), so a step that
runs after a stall and before the watch does sees no time pass; awake time never goes
back (but for float rounding, which the reconciler's clock absorbs: it never steps
back). While the control plane is busy (its loop late by more than the slack at every
turn) awake time runs slower than the wall clock: a silent node is declared later by as
much, never sooner. Pure: the shell passes the monotonic time in.
"""

from __future__ import annotations

import attrs


@attrs.define
class AwakeTime:
    last_watch: float  # the monotonic time of the watch's last wake
    tick_s: float = 0.5
    slack_s: float = 0.25  # loop lag under this is not a stall
    asleep_s: float = 0.0  # the stalls so far, folded in by `watched`

    def _frozen_at(self) -> float:
        # Past this without a wake, the loop is stalled: awake time stands still.
        return self.last_watch + self.tick_s + self.slack_s

    def awake(self, now: float) -> float:
        """Awake time at monotonic `now`."""
        return min(now, self._frozen_at()) - self.asleep_s

    def monotonic(self, awake_at: float, now: float) -> float:
        """The monotonic time at which awake time reaches `awake_at`, if nothing stalls."""
        return awake_at + self.asleep_s + max(0.0, now - self._frozen_at())

    def watched(self, now: float) -> float:
        """The watch woke at `now`: fold in the stall it ended, and return its length."""
        stall = max(0.0, now - self._frozen_at())
        self.asleep_s += stall
        self.last_watch = now
        return stall
