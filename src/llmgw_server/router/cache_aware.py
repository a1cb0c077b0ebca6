"""The cache-aware choice of a replica: pure, time passed in.

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

import enum
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw_core.config import CacheAwareSection
from llmgw_server.router.prefix import PromptKey, rendezvous

if TYPE_CHECKING:
    from llmgw_server.router.balancer import Replica


class Decision(enum.Enum):
    """Why a replica was chosen, as counted on /metrics."""

    CACHE_HIT = "cache_hit"  # it holds the conversation so far
    LOAD_OVERRIDE = "load_override"  # another held it but was loaded beyond the bound
    FALLBACK = "fallback"  # nobody held it: rendezvous, or load for a shared prefix
    SESSION = "session"  # the session header's rendezvous
    LEAST_OUTSTANDING = "least_outstanding"
    ROUND_ROBIN = "round_robin"


SHARE_WINDOW_PER_REPLICA = 8


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


def choose(
    candidates: Sequence[Replica],
    key: PromptKey | None,
    tuning: CacheAwareSection,
    now: float | None,
) -> tuple[Replica, Decision, int]:
    """The replica for a request, why, and how many bytes of its prompt it holds."""
    loads = {r: load_of(r, tuning, now) for r in candidates}
    least = min(loads.values())
    if key is None:
        return _least_loaded(candidates, loads), Decision.FALLBACK, 0
    at = 0.0 if now is None else now
    depths = {r: r.prefixes.depth(key, at) if r.prefixes is not None else 0 for r in candidates}
    bound = max(least * tuning.max_load_ratio, least + tuning.load_slack)

    holders = [r for r in candidates if _continues(r, key, depths[r], at)]
    if holders:
        top = max(depths[r] for r in holders)
        best = [r for r in holders if depths[r] == top and loads[r] <= bound]
        if best:
            return _least_loaded(best, loads), Decision.CACHE_HIT, key.ends[top - 1]
        within = [r for r in candidates if loads[r] <= bound]
        deepest = max(depths[r] for r in within)
        chosen = _least_loaded([r for r in within if depths[r] == deepest], loads)
        return chosen, Decision.LOAD_OVERRIDE, _matched(key, deepest)

    deepest = max(depths.values())
    if deepest and key.ends[deepest - 1] >= tuning.shared_prefix_ratio * key.size:
        chosen = _least_loaded(candidates, loads)
        return chosen, Decision.FALLBACK, _matched(key, depths[chosen])

    counts = {r: r.prefixes.conversations(at) if r.prefixes is not None else 0 for r in candidates}
    cap = math.ceil(tuning.max_share * (sum(counts.values()) + 1) / len(candidates)) + 1
    near = least + tuning.new_load_slack
    within = [r for r in candidates if loads[r] <= near and counts[r] < cap]
    if not within:
        within = [r for r in candidates if loads[r] <= near]
    anchor = key.anchor_hash
    chosen = max(within, key=lambda r: rendezvous(anchor, r.rid))
    return chosen, Decision.FALLBACK, _matched(key, depths[chosen])


def _continues(replica: Replica, key: PromptKey, depth: int, now: float) -> bool:
    return replica.prefixes is not None and replica.prefixes.continues(key, depth, now)


def _matched(key: PromptKey, depth: int) -> int:
    return key.ends[depth - 1] if depth else 0


def _least_loaded(replicas: Sequence[Replica], loads: dict[Replica, float]) -> Replica:
    """The least loaded; among equals the one with the smallest recent share."""
    return min(replicas, key=lambda r: (loads[r], r.share))


def assigned(replicas: Sequence[Replica], chosen: Replica) -> None:
    """Move every replica's recent share towards this assignment."""
    alpha = 1.0 / (SHARE_WINDOW_PER_REPLICA * max(len(replicas), 1))
    keep = 1.0 - alpha
    for r in replicas:
        r.share *= keep
    chosen.share += alpha
