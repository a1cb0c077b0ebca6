"""How much of the event loop's time one background feed may take (router.kv_feed).

A token bucket of seconds: a feed may spend `share` of each second on the loop, and up to
`burst_s` at once after it was idle. The shell times each slice of work it runs (a
synchronous piece between two checkpoints) and reports it with `spent`; before the next
slice it waits `wait` seconds, so that an engine sending more than its share is read at
its share and no faster: the rest waits in a bounded queue, then is dropped. Pure: the
shell supplies the times.
"""

from __future__ import annotations

import attrs


@attrs.define
class LoopShare:
    share: float  # of each second of the loop, 0 to 1
    burst_s: float  # what may be spent at once after idling
    # Seconds that may be spent now (below 0: owed); a full burst at first.
    balance: float = attrs.field(
        default=attrs.Factory(lambda self: self.burst_s, takes_self=True)
    )
    at: float | None = None  # when the balance was last brought up to date

    def __attrs_post_init__(self) -> None:
        if not 0 < self.share <= 1 or self.burst_s <= 0:
            raise ValueError(f"a loop share is in (0, 1] with a positive burst: {self}")

    def _refill(self, now: float) -> None:
        if self.at is not None and now > self.at:
            self.balance = min(self.burst_s, self.balance + (now - self.at) * self.share)
        self.at = now if self.at is None else max(self.at, now)

    def wait(self, now: float) -> float:
        """Seconds to wait before the next slice may run (0: now)."""
        self._refill(now)
        return 0.0 if self.balance > 0 else -self.balance / self.share

    def spent(self, seconds: float, now: float) -> None:
        """A slice took `seconds` of the loop, ending at `now`."""
        self._refill(now)
        self.balance -= seconds
