"""Deadlines by key: at most one time per key, and the earliest of all of them."""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """O(log n) to set, O(1) amortized to read: an entry replaced or cleared is left in
    the heap and skipped when it comes up."""

    def __init__(self) -> None:
        self._when: dict[K, float] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = 0  # ties break by arrival: keys need not be comparable

    def set(self, key: K, when: float | None) -> None:
        if when is None:
            self._when.pop(key, None)
        elif self._when.get(key) != when:
            self._when[key] = when
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, key))

    def next(self) -> float | None:
        heap = self._heap
        while heap and self._when.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[K]:
        """The keys whose time has come, cleared."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            if self._when.get(key) == when:
                del self._when[key]
                out.append(key)
        return out
