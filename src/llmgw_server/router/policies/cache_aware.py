"""`balancing = "cache_aware"`: the replica that holds the prompt, within load bounds.

Its choice is pure, time passed in; what it remembers of each replica (what was sent
there, its recent share of requests) is its own state, kept here.

Each replica's load is its engine's own count of running and waiting requests (read
from its /metrics, see load_signals), corrected by what this router sent or finished
since the reading, plus weights for the waiting queue and the KV cache's use; with no
reading younger than `metrics_max_age_s`, the router's own count of requests outstanding.

Then, with the prompt's cuts (see prefix) and each replica's index:

1. Continuation: a replica whose deepest cut held is the end of a prompt sent to it
   before (the conversation's previous turn) holds this conversation. The one holding
   the most wins, unless its load exceeds `max(least * max_load_ratio, least + load_slack)`
   (least: the least loaded replica's load); then the load override sends the request
   to the replica within that bound holding the most of the prompt.
2. A shared prefix: when no replica holds the conversation but one holds at least
   `shared_prefix_ratio` of the prompt, that part is shared with other conversations
   (a system prompt): every replica can cache it, so the request goes to the least
   loaded, and among equals the one with the smallest recent share of requests. A hot
   prefix is thus spread over every replica, even one request at a time.
3. Otherwise (a new conversation): rendezvous hashing of the anchor (the conversation's
   opening) over the replicas whose load is within `new_load_slack` of the least loaded
   and which hold fewer than `ceil(max_share * (conversations + 1) / replicas) + 1` of
   the conversations sent within the index's TTL (consistent hashing with bounded loads).
   Every router process ranks the replicas the same way for the same conversation, so
   processes that never saw each other's traffic still send its next turns to the same
   replica; the bound keeps any replica from collecting far more than its share.

A replica's recent share, the last tie-breaker, is an exponential average of the requests
assigned to it, over about 8 requests per replica: among equals, requests rotate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from llmgw_core.config import CacheAwareSection
from llmgw_server.router.policies.policy import Choice, Decision, Given, Policy, PolicySpec
from llmgw_server.router.prefix import PrefixIndex, PromptKey, prompt_key, rendezvous
from llmgw_server.router.replica import Replica

SHARE_WINDOW_PER_REPLICA = 8

CACHE_HIT = Decision("cache_hit", "it holds the conversation so far")
LOAD_OVERRIDE = Decision("load_override", "the holder was loaded beyond the bound")
FALLBACK = Decision("fallback", "nobody held it: rendezvous, or load for a shared prefix")


def load_of(replica: Replica, tuning: CacheAwareSection, now: float | None) -> float:
    own = replica.outstanding
    signal = replica.engine_load
    if signal is None or now is None or now - replica.engine_load_at > tuning.metrics_max_age_s:
        return float(own)
    # The engine's count includes other routers' requests; what this router sent or
    # finished since the reading is not in it yet.
    estimate = max(own, signal.requests + own - replica.outstanding_at_load)
    load = estimate + tuning.waiting_weight * signal.waiting
    if signal.kv_usage is not None:
        load += tuning.kv_usage_weight * signal.kv_usage
    return load


@attrs.define(slots=True)
class _Held:
    """What the policy remembers of one replica."""

    prefixes: PrefixIndex  # what was sent there
    share: float  # the recent share of the model's requests sent there


class CacheAware:
    reads_prompt = True
    reads_engine_load = True

    def __init__(self, tuning: CacheAwareSection) -> None:
        self.tuning = tuning
        self._held: dict[Replica, _Held] = {}

    def index(self, replica: Replica) -> PrefixIndex:
        """What this router sent to `replica`, as far as it remembers."""
        return self._held[replica].prefixes

    def prompt_key(self, body: dict[str, object], chat: bool) -> PromptKey | None:
        return prompt_key(body, chat, self.tuning.block_bytes)

    def wants_tokens(self, candidates: Sequence[Replica]) -> bool:
        return False

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        """The replica for a request, why, and how many bytes of its prompt it holds."""
        tuning, held = self.tuning, self._held
        loads = {r: load_of(r, tuning, now) for r in candidates}
        least = min(loads.values())
        if prompt is None:
            return Choice(self._least_loaded(candidates, loads), FALLBACK)
        key = prompt
        at = 0.0 if now is None else now
        depths = {r: held[r].prefixes.depth(key, at) for r in candidates}
        bound = max(least * tuning.max_load_ratio, least + tuning.load_slack)

        holders = [r for r in candidates if held[r].prefixes.continues(key, depths[r], at)]
        if holders:
            top = max(depths[r] for r in holders)
            best = [r for r in holders if depths[r] == top and loads[r] <= bound]
            if best:
                chosen = self._least_loaded(best, loads)
                return Choice(chosen, CACHE_HIT, key.ends[top - 1])
            within = [r for r in candidates if loads[r] <= bound]
            deepest = max(depths[r] for r in within)
            chosen = self._least_loaded([r for r in within if depths[r] == deepest], loads)
            return Choice(chosen, LOAD_OVERRIDE, _matched(key, deepest))

        deepest = max(depths.values())
        if deepest and key.ends[deepest - 1] >= tuning.shared_prefix_ratio * key.size:
            chosen = self._least_loaded(candidates, loads)
            return Choice(chosen, FALLBACK, _matched(key, depths[chosen]))

        counts = {r: held[r].prefixes.conversations(at) for r in candidates}
        cap = math.ceil(tuning.max_share * (sum(counts.values()) + 1) / len(candidates)) + 1
        near = least + tuning.new_load_slack
        within = [r for r in candidates if loads[r] <= near and counts[r] < cap]
        if not within:
            within = [r for r in candidates if loads[r] <= near]
        anchor = key.anchor_hash
        chosen = max(within, key=lambda r: rendezvous(anchor, r.rid))
        return Choice(chosen, FALLBACK, _matched(key, depths[chosen]))

    def _least_loaded(self, replicas: Sequence[Replica], loads: dict[Replica, float]) -> Replica:
        """The least loaded; among equals the one with the smallest recent share."""
        held = self._held
        return min(replicas, key=lambda r: (loads[r], held[r].share))

    def chosen(self, replica: Replica, prompt: PromptKey | None, now: float | None) -> None:
        """Move every replica's recent share towards this assignment; remember the prompt."""
        held = self._held
        alpha = 1.0 / (SHARE_WINDOW_PER_REPLICA * max(len(held), 1))
        keep = 1.0 - alpha
        for h in held.values():
            h.share *= keep
        mine = held[replica]
        mine.share += alpha
        if prompt is not None:
            mine.prefixes.record(prompt, 0.0 if now is None else now)

    def follow(self, replicas: Sequence[Replica]) -> None:
        # A replica new to the model starts with an even share and an empty index.
        old, tuning, even = self._held, self.tuning, 1.0 / max(len(replicas), 1)
        self._held = {
            r: old.get(r) or _Held(PrefixIndex(tuning.index_blocks, tuning.index_ttl_s), even)
            for r in replicas
        }

    def forget(self, replica: Replica) -> None:
        held = self._held.get(replica)
        if held is not None:
            held.prefixes.clear()

    def remembered(self, replica: Replica) -> int | None:
        held = self._held.get(replica)
        return None if held is None else len(held.prefixes)


def _matched(key: PromptKey, depth: int) -> int:
    return key.ends[depth - 1] if depth else 0


def _build(given: Given) -> Policy:
    return CacheAware(given.section)


# Its section, [router.cache_aware], is also RouterSection's own: its engine-load
# settings are read by health and the metrics whatever the policy.
POLICY = PolicySpec(
    "cache_aware",
    _build,
    section=CacheAwareSection,
    decisions=(CACHE_HIT, LOAD_OVERRIDE, FALLBACK),
)
