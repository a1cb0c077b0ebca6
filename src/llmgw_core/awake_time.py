"""Awake time: the monotonic clock less this process's own stalls.

When a daemon's process stalls (a paused VM, a starved CPU, a long GC), what its peers
sent meanwhile waits unread in its sockets, and every timer it runs expires at once when
it resumes. Counted on the wall clock, the stall is blamed on the peers:
- the control plane (control_shell/controlplane.py) would turn its nodes unreachable at
  the first step after the stall, before a single waiting heartbeat is read: a minority
  would have their streams closed and register again, a majority would hold the
  mass-loss guard for nothing. Every time its reconciler is given is awake time.
- a router (router/health.py) would mark healthy engines down for a health probe that
  timed out while the router itself was not running, and answer 503 until the next
  probe. A probe that timed out across such a stall is not judged.

A stall is what the owner's watch task sees: it asks to wake every `tick_s`, and a wake
later than `slack_s` past that is a stall of the whole lateness beyond the slack. Between
the watch's wakes the stall in progress is already taken off (`awake`), so a step that
runs after a stall and before the watch does sees no time pass; awake time never goes
back (but for float rounding, which the reconciler's clock absorbs: it never steps
back). While a process is busy (its loop late by more than the slack at every turn)
awake time runs slower than the wall clock: a silent peer is judged later by as much,
never sooner. Pure: the owner passes the monotonic time in.
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
