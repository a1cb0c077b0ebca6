"""`balancing = "round_robin"`: each request to the next available replica in turn."""

from __future__ import annotations

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

ROUND_ROBIN = Decision("round_robin", "the next replica in turn")


class RoundRobin(Oblivious):
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        self._turn = (self._turn + 1) % len(candidates)
        return Choice(candidates[self._turn], ROUND_ROBIN)


def _build(given: Given) -> Policy:
    return RoundRobin()


POLICY = PolicySpec("round_robin", _build, decisions=(ROUND_ROBIN,))
