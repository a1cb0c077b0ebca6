"""The leader's writes to its store, queued by each step and flushed by one task.

A step of the reconciler is synchronous and its commands go out at once; what it changed
of the stored state (control.persisted.Keeper) is queued here, the latest value of each
key winning, and written by `flush_forever` in transactions guarded by the leadership's
epoch (Election.write) as fast as the store takes them. Bounded by the stored state
itself: one pending value a key.

A leader that dies between a command and its write leaves the store behind what runs;
the agents report what they run when they register with the next leader, which adopts
it (a replica its store did not know is judged like any other: kept, or retired if it
is one too many).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import trio

from llmgw_server.control_shell.election import Election
from llmgw_server.store.etcd import StoreError

log = logging.getLogger("llmgw.control")

_RETRY_S = 0.2  # the store did not answer: the next try (the lease bounds them all)


class StoreWrites:
    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self._pending: dict[str, bytes | None] = {}  # relative key -> value, None: delete
        self._wake = trio.Event()
        self.written = 0  # values written (or deleted) in this leadership

    def add(self, writes: tuple[Mapping[str, bytes], Iterable[str]]) -> None:
        puts, deletes = writes
        for key in deletes:
            self._pending[key] = None
        self._pending.update(puts)
        if self._pending:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush_forever(self, election: Election) -> None:
        """Write what is queued until the leadership ends (a guard refused a write)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            taken, self._pending = self._pending, {}
            puts = {self.prefix + k.encode(): v for k, v in taken.items() if v is not None}
            deletes = [self.prefix + k.encode() for k, v in taken.items() if v is None]
            try:
                written = await election.write(puts, deletes)
            except StoreError as exc:
                log.warning("the store did not take %d values: %s (retrying)", len(taken), exc)
                self._pending = {**taken, **self._pending}  # newer values win
                self._wake.set()
                await trio.sleep(_RETRY_S)
                continue
            if not written:
                return  # this leadership ended: the election says so
            self.written += len(taken)
