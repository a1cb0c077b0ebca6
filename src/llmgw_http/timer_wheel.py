"""Expiry times kept to a tick: arming, moving and disarming are a dict operation each.

The pure half of `coarse_timeouts`: no trio, no clock of its own. A key armed for time
`at` falls due at the first tick boundary at or after `at` (never before it), so a
timeout measured with it is late by less than one tick and never early.
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

K = TypeVar("K")  # used as a dict key


class TimerWheel(Generic[K]):
    __slots__ = ("_order", "_queued", "_slots", "_where", "tick_s")

    def __init__(self, tick_s: float) -> None:
        if not tick_s > 0:
            raise ValueError(f"tick_s must be positive, not {tick_s!r}")
        self.tick_s = tick_s
        self._slots: dict[int, dict[K, None]] = {}  # slot -> its keys, in arming order
        self._where: dict[K, int] = {}  # key -> its slot
        self._order: list[int] = []  # a heap of slots; emptied ones are dropped lazily
        self._queued: set[int] = set()  # the slots in _order, each there once

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def arm(self, key: K, at: float) -> bool:
        """`key` falls due at `at` (rounded up to a tick), instead of whenever it did.

        True when that makes it the earliest slot: whoever sleeps until the next due
        time must wake sooner. An infinite `at` disarms it."""
        if at == math.inf:
            self.disarm(key)
            return False
        slot = math.ceil(at / self.tick_s)
        old = self._where.get(key)
        if old == slot:
            return False
        if old is not None:
            keys = self._slots[old]
            del keys[key]
            if not keys:
                del self._slots[old]
        self._where[key] = slot
        same = self._slots.get(slot)
        if same is not None:
            same[key] = None
            return False
        self._slots[slot] = {key: None}
        if slot in self._queued:  # emptied and filled again: still in the heap
            return False
        earliest = self._earliest()
        heapq.heappush(self._order, slot)
        self._queued.add(slot)
        return earliest is None or slot < earliest

    def disarm(self, key: K) -> None:
        """`key` no longer falls due (nothing happens if it was not armed)."""
        slot = self._where.pop(key, None)
        if slot is not None:
            keys = self._slots[slot]
            del keys[key]
            if not keys:
                del self._slots[slot]

    def _earliest(self) -> int | None:
        order = self._order
        while order and order[0] not in self._slots:
            self._queued.discard(heapq.heappop(order))
        return order[0] if order else None

    def next_due(self) -> float | None:
        """When the earliest armed key falls due; None when none is armed."""
        slot = self._earliest()
        return None if slot is None else slot * self.tick_s

    def pop_due(self, now: float) -> list[K]:
        """The keys due at `now`, earliest first, disarmed."""
        due: list[K] = []
        order = self._order
        while order and order[0] * self.tick_s <= now:
            slot = heapq.heappop(order)
            self._queued.discard(slot)
            keys = self._slots.pop(slot, None)
            if keys:
                for key in keys:
                    del self._where[key]
                due.extend(keys)
        return due
