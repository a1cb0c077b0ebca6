"""A token bucket: refilled at `rate` a second up to `burst`, full at first. Pure: the
caller supplies the times (a clock that steps back refills nothing).

Spent two ways: `take` one token or refuse (an agent stream's messages, flooding closes
it), or `spent` after the fact, into debt, with `wait` saying how long until it is paid
off (a router's background feed, timed in seconds of the event loop).
"""

from __future__ import annotations

import attrs


@attrs.define
class TokenBucket:
    rate: float  # tokens added a second
    burst: float  # the most it holds
    balance: float = attrs.field(default=attrs.Factory(lambda self: self.burst, takes_self=True))
    at: float | None = None  # when the balance was last brought up to date

    def _refill(self, now: float) -> None:
        if self.at is not None and now > self.at:
            self.balance = min(self.burst, self.balance + (now - self.at) * self.rate)
        self.at = now if self.at is None else max(self.at, now)

    def take(self, now: float) -> bool:
        """One token, if the bucket holds one."""
        self._refill(now)
        if self.balance < 1:
            return False
        self.balance -= 1
        return True

    def spent(self, amount: float, now: float) -> None:
        """`amount` was used, ending at `now`: the balance may go below 0 (owed)."""
        self._refill(now)
        self.balance -= amount

    def wait(self, now: float) -> float:
        """How long until the balance is above 0 again (0: it is now)."""
        self._refill(now)
        return 0.0 if self.balance > 0 else -self.balance / self.rate
