"""What a router process serves its balancing policy with, as the policy's module
declares it (policies.policy.Needs): its per-process state, the service that tokenizes
prompts, the feed the wiring starts, its families on /metrics.

Made once a process (front.Router); nothing here runs per request. A service named
"module:attribute" is imported here, by the router, when the configured policy needs
it: never by the policy's module, whose decisions take no I/O, and never for a policy
that does not.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from llmgw_server.router.policies import PolicySpec
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.upstream import Pool


class TokenSource(Protocol):
    """Where the router gets a prompt's token ids (precise's: router.tokenizer)."""

    async def tokens(
        self, pool: Pool, model: str, body: dict[str, Any], chat: bool, prompt: PromptKey
    ) -> Sequence[int] | None: ...


Feed = Callable[..., Awaitable[None]]


def named(ref: str) -> Any:
    """The attribute "module:attribute" names, its module imported."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


class PolicyNeeds:
    def __init__(self, spec: PolicySpec, refused: Counter[str]) -> None:
        """`refused`: the router's count of /tokenize answers refused, by engine."""
        needs = spec.needs
        self.spec = spec
        self.shared: object = None if needs.shared is None else needs.shared()
        self.tokens: TokenSource | None = (
            None if needs.tokens is None else named(needs.tokens)(refused=refused)
        )

    def feed(self) -> Feed | None:
        """The task the wiring starts beside the router, as `nursery.start(feed, shared,
        endpoints)` (its module imported now); None: the policy has none."""
        ref = self.spec.needs.feed
        return None if ref is None else named(ref)

    def metrics(self) -> Callable[[Sequence[str]], list[str]] | None:
        """Its families on /metrics, given every replica's URL; None: it has none."""
        render, shared = self.spec.needs.metrics, self.shared
        if render is None:
            return None
        return lambda urls: render(shared, urls)
