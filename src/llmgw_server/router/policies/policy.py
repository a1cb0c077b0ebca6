"""What a balancing policy is: the interface the balancer drives, what it answers, and
what its module declares (`PolicySpec`: its name, config section, decisions, needs).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.replica import Replica


@attrs.frozen(slots=True, eq=False)
class Decision:
    """Why a replica was chosen, as counted on /metrics: `value` is its `kind` label there,
    `help` what it means on the page's help. Each policy module declares its own (its
    spec's `decisions`); compared by identity."""

    value: str
    help: str


# The router's own, whatever the policy: a session header, a stored response.
SESSION = Decision("session", "the session header's rendezvous")
STORED_RESPONSE = Decision("stored_response", "the replica that stored the response it names")
ROUTER_DECISIONS = (SESSION, STORED_RESPONSE)


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


@attrs.frozen(slots=True)
class Given:
    """What a policy is built with, for one model's replicas."""

    section: Any  # its config section, as read (its spec's `section` class)
    rng: random.Random
    # Its per-process state (its needs' `shared()`, one for all the models), None where
    # it declares none.
    shared: Any = None


@attrs.frozen
class Needs:
    """What a policy needs from the router beyond the request, served generically.

    The prompt and the engines' load are asked per request of the policy itself
    (`Policy.reads_prompt`, `reads_engine_load`: the router hashes the prompt, health
    reads the engines' /metrics); the rest, declared here, is set up once a process.
    A service that does I/O is named as "module:attribute", imported by the router
    or the wiring that starts it, never by the policy's module: the decisions take no
    I/O (the lint contract on policies/).
    """

    # Its per-process state: made once, given to every model's policy (`Given.shared`),
    # to the feed and to `metrics`.
    shared: Callable[[], object] | None = None
    # The prompt's token ids (`PromptKey.tokens`) where `Policy.wants_tokens`: the class
    # the router asks them of, built as `cls(refused=Counter)` (its refusals, counted
    # in llmgw_tokenize_refused_total), with `async tokens(pool, model, body, chat,
    # prompt)`.
    tokens: str | None = None
    # A task the wiring starts beside the router: `await nursery.start(feed, shared,
    # endpoints)`, `endpoints()` every replica's endpoint now.
    feed: str | None = None
    # The policy's own families on /metrics: `metrics(shared, urls)` -> lines, `urls`
    # every replica's.
    metrics: Callable[[Any, Sequence[str]], list[str]] | None = None


@attrs.frozen
class PolicySpec:
    """A policy module's declaration, its module-level `POLICY`: what `[router]
    balancing` names, what it reads of the config, what it counts, what it needs, and
    how one is built. Every module of this package that has one is a policy
    (policies.registered)."""

    name: str  # `[router] balancing = "<name>"`
    build: Callable[[Given], Policy]
    # Its config section: the table `[router.<section_key>]` read into this attrs class
    # (every field defaulted: an absent table is `section()`). None: it reads none.
    section: type | None = None
    section_key: str | None = None  # default: `name`
    decisions: tuple[Decision, ...] = ()  # the ones its choices carry
    needs: Needs = Needs()

    @property
    def table(self) -> str | None:
        """The key of its table under `[router]`, None where it reads none."""
        if self.section is None:
            return None
        return self.section_key or self.name
