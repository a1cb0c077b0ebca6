"""The engines' last output lines of failed shards, shown by the admin status: bounded.

A tail is kept while its replica is known to the reconciler (a failed replica keeps
it through its restarts, so the status still shows why it failed) and dropped once
the replica is gone. At most `MAX_TAILS` are kept, the oldest failure going first:
each tail is what one agent frame carried (at most `wire.MAX_FRAME_BYTES`), so a
fleet whose engines keep failing under ever new replica ids holds at most that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

MAX_TAILS = 1_000

ShardKey = tuple[str, str, int]  # node, replica id, rank


class OutputTails(Mapping[ShardKey, tuple[str, ...]]):
    def __init__(self, limit: int = MAX_TAILS) -> None:
        self.limit = limit
        self._tails: dict[ShardKey, tuple[str, ...]] = {}  # oldest failure first

    def record(self, key: ShardKey, tail: tuple[str, ...]) -> None:
        """A shard failed with these lines: they replace its earlier ones, as the newest."""
        tails = self._tails
        tails.pop(key, None)
        tails[key] = tail
        while len(tails) > self.limit:
            del tails[next(iter(tails))]

    def prune(self, known: Callable[[str], bool]) -> None:
        """Drop the tails of replicas no longer `known`. O(tails kept)."""
        gone = [key for key in self._tails if not known(key[1])]
        for key in gone:
            del self._tails[key]

    def __getitem__(self, key: ShardKey) -> tuple[str, ...]:
        return self._tails[key]

    def __iter__(self) -> Iterator[ShardKey]:
        return iter(self._tails)

    def __len__(self) -> int:
        return len(self._tails)
