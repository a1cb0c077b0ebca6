"""`balancing = "least_outstanding"`: the replica with the fewest of this router's requests
in flight; with many replicas, the lighter of two sampled at random (power of two choices)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from llmgw_server.router.policies.policy import (
    Choice,
    Decision,
    Given,
    Oblivious,
    Policy,
    PolicySpec,
)
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.replica import Replica

LEAST_OUTSTANDING = Decision(
    "least_outstanding", "the fewest of this router's requests in flight, of two sampled if many"
)
_P2C_ABOVE = 4  # below this many candidates a full scan is as cheap as sampling


class LeastOutstanding(Oblivious):
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._turn = 0

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        if len(candidates) > _P2C_ABOVE:
            a, b = self._rng.sample(candidates, 2)
            return Choice(a if a.outstanding <= b.outstanding else b, LEAST_OUTSTANDING)
        # Rotate the starting point so ties do not always land on the first replica.
        self._turn = (self._turn + 1) % len(candidates)
        rotated = [*candidates[self._turn :], *candidates[: self._turn]]
        return Choice(min(rotated, key=lambda r: r.outstanding), LEAST_OUTSTANDING)


def _build(given: Given) -> Policy:
    return LeastOutstanding(given.rng)


POLICY = PolicySpec("least_outstanding", _build, decisions=(LEAST_OUTSTANDING,))
