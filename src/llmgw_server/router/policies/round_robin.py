"""`balancing = "round_robin"`: each request to the next available replica in turn."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw_server.router.policies.policy import Choice, Decision
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.replica import Replica


class RoundRobin:
    reads_prompt = False
    reads_engine_load = False

    def __init__(self) -> None:
        self._turn = 0

    def prompt_key(self, body: dict[str, object], chat: bool) -> PromptKey | None:
        return None

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        self._turn = (self._turn + 1) % len(candidates)
        return Choice(candidates[self._turn], Decision.ROUND_ROBIN)

    def chosen(self, replica: Replica, prompt: PromptKey | None, now: float | None) -> None:
        pass

    def follow(self, replicas: Sequence[Replica]) -> None:
        pass

    def forget(self, replica: Replica) -> None:
        pass

    def remembered(self, replica: Replica) -> int | None:
        return None
