"""Rate limits for log lines that a flood of requests could repeat."""

from __future__ import annotations

from collections.abc import Hashable

_MAX_KEYS = 10_000


class RateLimit:
    """At most one event per key and period; tells how many were held back meanwhile."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable, now: float) -> int | None:
        """None: hold this one back. Otherwise the count held back since the last allowed."""
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if last is None and len(self._last) >= _MAX_KEYS:  # keys from endless new replicas
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)
