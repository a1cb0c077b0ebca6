"""What a balancing policy is: the interface the balancer drives, and what it answers."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs

from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.replica import Replica


class Decision(enum.Enum):
    """Why a replica was chosen, as counted on /metrics."""

    CACHE_HIT = "cache_hit"  # it holds the conversation so far
    LOAD_OVERRIDE = "load_override"  # another held it but was loaded beyond the bound
    FALLBACK = "fallback"  # nobody held it: rendezvous, or load for a shared prefix
    SESSION = "session"  # the session header's rendezvous
    STORED_RESPONSE = "stored_response"  # the replica that stored the response it names
    LEAST_OUTSTANDING = "least_outstanding"
    PRECISE_HIT = "precise_hit"  # its engine says it holds the longest prefix
    PRECISE_LOAD_OVERRIDE = "precise_load_override"  # a holder was loaded beyond the bound
    PRECISE_SPREAD = "precise_spread"  # a hot prefix: one more replica takes it
    PRECISE_MISS = "precise_miss"  # no engine holds a block of it: placed as cache_aware
    ROUND_ROBIN = "round_robin"


@attrs.frozen(slots=True)
class Choice:
    replica: Replica
    decision: Decision
    matched_bytes: int = 0  # how much of the prompt this router believes the replica holds
    # The prompt tokens its engine should find cached, as its KV-cache events say (precise;
    # None where no policy read them): the access log's `cached_predicted`.
    matched_tokens: int | None = None


class Policy(Protocol):
    """How one model's balancer chooses among its available replicas, with the state it
    needs (one instance per model). The balancer filters the candidates (available, not
    excluded, rested) and handles sessions; the policy sees every choice made."""

    # Whether it reads the prompt (the router hashes it only then) and the engines' own
    # load (the router reads their /metrics only then).
    reads_prompt: bool
    reads_engine_load: bool

    def prompt_key(self, body: dict[str, object], chat: bool) -> PromptKey | None:
        """The key of a request's prompt, as this policy reads it (asked only if it does)."""
        ...

    def wants_tokens(self, candidates: Sequence[Replica]) -> bool:
        """Whether it would read the prompt's token ids (`PromptKey.tokens`) to choose
        among `candidates`: the router then asks an engine's /tokenize first."""
        ...

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        """One of `candidates` (never empty) and why. What it remembers of requests is
        changed by `chosen` alone (a rotation may turn here)."""
        ...

    def chosen(self, replica: Replica, prompt: PromptKey | None, now: float | None) -> None:
        """A request goes to `replica`, by this policy's choice or a session's."""
        ...

    def follow(self, replicas: Sequence[Replica]) -> None:
        """The model's replicas are now `replicas`: known ones keep their state."""
        ...

    def forget(self, replica: Replica) -> None:
        """It failed, and may come back as a fresh engine: what it held is not counted on."""
        ...

    def remembered(self, replica: Replica) -> int | None:
        """How many entries it remembers for the replica, for /metrics; None: it keeps none."""
        ...


class Oblivious:
    """What a policy that reads no prompt and keeps nothing per replica does with the
    hooks it has no use for (round_robin, least_outstanding)."""

    reads_prompt = False
    reads_engine_load = False

    def prompt_key(self, body: dict[str, object], chat: bool) -> PromptKey | None:
        return None

    def chosen(self, replica: Replica, prompt: PromptKey | None, now: float | None) -> None:
        pass

    def wants_tokens(self, candidates: Sequence[Replica]) -> bool:
        return False

    def follow(self, replicas: Sequence[Replica]) -> None:
        pass

    def forget(self, replica: Replica) -> None:
        pass

    def remembered(self, replica: Replica) -> int | None:
        return None
