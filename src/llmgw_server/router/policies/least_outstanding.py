"""`balancing = "least_outstanding"`: the replica with the fewest of this router's requests
in flight; with many replicas, the lighter of two sampled at random (power of two choices)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from llmgw_server.router.policies.policy import Choice, Decision
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.replica import Replica

_P2C_ABOVE = 4  # below this many candidates a full scan is as cheap as sampling


class LeastOutstanding:
    reads_prompt = False
    reads_engine_load = False

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._turn = 0

    def prompt_key(self, body: dict[str, object], chat: bool) -> PromptKey | None:
        return None

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        if len(candidates) > _P2C_ABOVE:
            a, b = self._rng.sample(candidates, 2)
            return Choice(a if a.outstanding <= b.outstanding else b, Decision.LEAST_OUTSTANDING)
        # Rotate the starting point so ties do not always land on the first replica.
        self._turn = (self._turn + 1) % len(candidates)
        rotated = [*candidates[self._turn :], *candidates[: self._turn]]
        return Choice(min(rotated, key=lambda r: r.outstanding), Decision.LEAST_OUTSTANDING)

    def chosen(self, replica: Replica, prompt: PromptKey | None, now: float | None) -> None:
        pass

    def follow(self, replicas: Sequence[Replica]) -> None:
        pass

    def forget(self, replica: Replica) -> None:
        pass

    def remembered(self, replica: Replica) -> int | None:
        return None
