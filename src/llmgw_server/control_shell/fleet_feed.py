"""What the fleet page follows: a version bumped when the control plane's state changes,
and the recent node transitions and shard state changes.

The control plane's shell tells the feed each step it carries out; a heartbeat that
changes nothing is an empty step and bumps nothing, so a large quiet fleet wakes no
page. Readers wait for a version past the one they last showed (`wait_past`) and
coalesce on their side.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from llmgw_server.control.documents import RecentDoc

if TYPE_CHECKING:
    from llmgw_server.control.reconciler import Step

RECENT = 200  # transitions kept for the page


class FleetFeed:
    def __init__(self, keep: int = RECENT, wall_clock: Callable[[], float] = time.time) -> None:
        self.version = 0
        self._changed = trio.Event()
        self._wall_clock = wall_clock
        self.recent: deque[RecentDoc] = deque(maxlen=keep)  # newest last

    def bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_past(self, version: int) -> int:
        """Return the current version once it differs from `version`."""
        while self.version == version:
            await self._changed.wait()
        return self.version

    def stepped(self, step: Step) -> None:
        for t in step.transitions:
            change = str(t.new) if t.old is None else f"{t.old} -> {t.new}"
            self._note(f"node {t.node}", change, t.reason)
        if step.transitions or step.commands or step.placements or step.notes or step.reconciled:
            self.bump()

    def shard(self, node: str, replica_id: str, rank: int, state: str, detail: str) -> None:
        self._note(f"replica {replica_id} rank {rank} on {node}", state, detail)
        self.bump()

    def _note(self, subject: str, change: str, reason: str) -> None:
        self.recent.append(RecentDoc(self._wall_clock(), subject, change, reason))
