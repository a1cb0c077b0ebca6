"""`balancing = "precise"`: the replica whose engine says it holds the prompt's blocks.

Like cache_aware, but what each replica holds comes from its engine's own KV-cache
events (router.kv_feed feeds the process's `KvIndex`), not from what this router sent:
another router's or a direct client's traffic counts, an eviction counts, a restarted
router knows what the engines hold as soon as their replay came in. The request's prompt
is tokenized as the engine will see it (the router asks the engine's own `/tokenize`,
router.tokenizer) and its full blocks are looked up by the router's own chained hash.

1. The replicas holding the longest prefix, within the load bound cache_aware uses
   (`max(least * max_load_ratio, least + load_slack)`), the least loaded of them (then
   the one that took fewest of the model's last requests): `precise_hit`. A holder may
   pass the bound by its held tokens / `held_tokens_per_load` (256: a 3,000-token prefix
   is worth 11.7 more requests of load), since any other replica would prefill them all
   again, and that prefill delays every request queued behind it there. (At the bound
   alone, 4% of the requests left their team's holder on the routing bench's evicting
   workload at 64 req/s: each was a 3,000-token miss, slowing those behind it, and TTFT
   p90 was 250-450 ms; with the allowance 0-0.2% left, and it was 22 ms.) A holder past
   its allowance loses to the replica within the bound holding the most
   (`precise_load_override`).
   A hot prefix is spread, not collapsed onto its holder: when more of the model's last
   requests (8 a replica) found the same longest held prefix than its holders' share of
   them, the least loaded replica without it takes the request (`precise_spread`) and
   caches it. Requested one at a time, a hot system prompt is thus held by every replica
   after a few more requests, then shared evenly; a prefix only some requests share (one
   team's system prompt among many, a conversation) stays where it is cached, so that
   oversubscribed caches hold it once, not on every replica as cache_aware's
   shared-prefix rule has it.
2. No replica holds a block of it: the approximate policy places it (cache_aware's own
   choice: the conversation's last replica within the load bound, a shared prefix by
   load, a new conversation by rendezvous of its opening), counted `precise_miss`.
3. The prompt could not be tokenized, or no candidate's engine has published events yet
   (llama.cpp publishes none; a feed that never started): cache_aware decides alone, and
   its own decisions are counted (`cache_hit`, `fallback`, ...).

A request sent to a replica counts as held there for `speculative_ttl_s` (2 s), until the
engine's events say so (KvIndex.speculate). The approximate policy keeps its own state
throughout, so that it decides well when the events are missing.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from llmgw_core.config import CacheAwareSection
from llmgw_core.prometheus import family, labels
from llmgw_server.router.kv_index import KvIndex, block_chain
from llmgw_server.router.policies.cache_aware import (
    SHARE_WINDOW_PER_REPLICA,
    CacheAware,
    load_of,
)
from llmgw_server.router.policies.policy import (
    Choice,
    Decision,
    Given,
    Needs,
    Policy,
    PolicySpec,
)
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.replica import Replica

PRECISE_HIT = Decision("precise_hit", "its engine says it holds the longest prefix")
PRECISE_LOAD_OVERRIDE = Decision(
    "precise_load_override", "a holder was loaded beyond the bound: the one within it"
)
PRECISE_SPREAD = Decision("precise_spread", "a hot prefix given one more replica")
PRECISE_MISS = Decision("precise_miss", "no engine held a block of it: placed as cache_aware would")


class Precise:
    reads_prompt = True
    reads_engine_load = True

    def __init__(self, tuning: CacheAwareSection, index: KvIndex) -> None:
        self.tuning = tuning
        self.index = index
        self.approximate = CacheAware(tuning)
        # The chains `held` hashed for the request being chosen, by block size.
        self._chains: dict[int, tuple[int, ...]] = {}
        self._chains_of: PromptKey | None = None
        # The longest held prefix `choose` found for the request being chosen (the hash
        # of its last block), None for a miss.
        self._prefix: int | None = None
        # The model's last requests (SHARE_WINDOW_PER_REPLICA a replica): each one's
        # held prefix and replica, and how many of them each prefix and replica had.
        self._window: deque[tuple[int | None, Replica]] = deque()
        self._prefixes: Counter[int | None] = Counter()
        self._recent: Counter[Replica] = Counter()

    def prompt_key(self, body: dict[str, object], chat: bool) -> PromptKey | None:
        return self.approximate.prompt_key(body, chat)

    def wants_tokens(self, candidates: Sequence[Replica]) -> bool:
        """Only where an engine's events can route: no /tokenize call is spent otherwise
        (llama.cpp, which publishes none, or a feed not started yet)."""
        return any(self.fed(r) for r in candidates)

    def fed(self, replica: Replica) -> bool:
        """Whether the replica's engine events route it: some came, none unusable."""
        name = replica.endpoint.url
        index = self.index
        return index.last_seq(name) is not None and index.unusable(name) is None

    def choose(
        self, candidates: Sequence[Replica], prompt: PromptKey | None, now: float | None
    ) -> Choice:
        tokens = None if prompt is None else prompt.tokens
        fed = [r for r in candidates if self.fed(r)]
        if prompt is None or tokens is None or not fed:
            return self.approximate.choose(candidates, prompt, now)
        at = 0.0 if now is None else now
        held = self.held(fed, prompt, tokens, at)
        if not any(held.values()):
            # The engines say nobody holds it: where cache_aware would place it, so that
            # where the events tell nothing precise does as cache_aware does (misses placed
            # by load alone measured 0.88-0.94x cache_aware's TTFT p90 on the saturated
            # evicting stage over three runs; this way 0.98x in one).
            chosen = self.approximate.choose(candidates, prompt, now).replica
            return Choice(chosen, PRECISE_MISS, 0, 0)
        tuning = self.tuning
        loads = {r: load_of(r, tuning, now) for r in candidates}
        least = min(loads.values())
        bound = max(least * tuning.max_load_ratio, least + tuning.load_slack)
        # A holder's prefix would be prefilled again elsewhere: it may carry more load.
        per = tuning.held_tokens_per_load
        within = [r for r in candidates if loads[r] <= bound + held.get(r, 0) / per]
        recent = self._recent
        top = max(held.values())
        # The longest held prefix, named by the hash of its last block (`held` hashed the
        # chain of each block size it met; a holder's size is one of them).
        prefix = self._prefix = next(
            chain[top // size - 1]
            for size, chain in self._chains.items()
            if top % size == 0 and len(chain) >= top // size
        )
        others = [r for r in within if not held.get(r, 0)]
        if others and self.hot(prefix, len(within) - len(others), len(candidates)):
            # More of the model's last requests wanted this prefix than its holders'
            # share: one more replica takes it (and caches it), the least loaded without.
            chosen = min(others, key=lambda r: (loads[r], recent[r]))
            return Choice(chosen, PRECISE_SPREAD, 0, 0)
        best = max((held.get(r, 0) for r in within), default=0)
        pool = [r for r in within if held.get(r, 0) == best]
        chosen = min(pool, key=lambda r: (loads[r], recent[r]))
        decision = PRECISE_HIT if best == top else PRECISE_LOAD_OVERRIDE
        # The metrics count bytes of the prompt: its cached tokens' share of them.
        matched = prompt.size * held.get(chosen, 0) // max(len(tokens), 1)
        return Choice(chosen, decision, matched, held.get(chosen, 0))

    def hot(self, prefix: int, holders: int, replicas: int) -> bool:
        """Whether the prefix (the hash of its last block) deserves more holders than
        `holders`: its share of the model's last requests, in replicas' worth (a
        replica's worth: 1 / replicas of them), is more than the replicas holding it.
        Over fewer than `replicas` requests each counts as a replica's worth, so that a
        prefix requested one at a time spreads from the start."""
        seen = self._prefixes[prefix]
        return seen * replicas > holders * max(len(self._window), replicas)

    def held(
        self, replicas: Sequence[Replica], prompt: PromptKey, tokens: Sequence[int], now: float
    ) -> dict[Replica, int]:
        """The tokens of the prompt's leading full blocks each replica holds, as its
        engine will count them cached: never the prompt's last token (an engine always
        computes at least one, as vLLM does)."""
        index = self.index
        out: dict[Replica, int] = {}
        by_size: dict[int, list[Replica]] = {}
        for r in replicas:
            size = index.block_size(r.endpoint.url)
            if size:
                by_size.setdefault(size, []).append(r)
        self._chains, self._chains_of, self._prefix = {}, prompt, None
        for size, group in by_size.items():
            # Hashed once: the lookup's, and the speculation's once a replica is chosen.
            chain = self._chains[size] = block_chain(tokens, size, prompt.lora)
            depths = index.lookup_chain(chain, now)
            most = (len(tokens) - 1) // size
            for r in group:
                out[r] = min(depths.get(r.endpoint.url, 0), most) * size
        return out

    def chosen(self, replica: Replica, prompt: PromptKey | None, now: float | None) -> None:
        self.approximate.chosen(replica, prompt, now)
        window, recent, prefixes = self._window, self._recent, self._prefixes
        prefix = self._prefix if prompt is not None and prompt is self._chains_of else None
        window.append((prefix, replica))
        prefixes[prefix] += 1
        recent[replica] += 1
        if len(window) > SHARE_WINDOW_PER_REPLICA * max(len(recent), 1):
            gone, went = window.popleft()
            recent[went] -= 1
            prefixes[gone] -= 1
            if not prefixes[gone]:
                del prefixes[gone]
        if prompt is None or prompt.tokens is None or now is None:
            return
        size = self.index.block_size(replica.endpoint.url)
        if size:
            chain = self._chains.get(size) if prompt is self._chains_of else None
            if chain is None:  # chosen by another rule (a session): hashed here
                chain = block_chain(prompt.tokens, size, prompt.lora)
            self.index.speculate_chain(replica.endpoint.url, chain, now)
        self._chains = {}

    def follow(self, replicas: Sequence[Replica]) -> None:
        self.approximate.follow(replicas)
        kept = set(replicas)
        self._window = deque((a, r) for a, r in self._window if r in kept)
        self._recent = Counter({r: 0 for r in replicas})
        self._recent.update(r for _, r in self._window)
        self._prefixes = Counter(p for p, _ in self._window)

    def forget(self, replica: Replica) -> None:
        self.approximate.forget(replica)

    def remembered(self, replica: Replica) -> int | None:
        return self.index.held(replica.endpoint.url)


def kv_metrics(index: KvIndex, urls: Sequence[str]) -> list[str]:
    """Its families on /metrics: the event batches applied, the messages dropped."""
    out: list[str] = []
    out += family(
        "llmgw_kv_event_batches_total",
        "counter",
        "KV-cache event batches applied from each engine (balancing = precise).",
    )
    for url in sorted(set(urls)):
        out.append(f"llmgw_kv_event_batches_total{labels(endpoint=url)} {index.batches(url)}")
    out += family(
        "llmgw_kv_events_dropped_total",
        "counter",
        "KV-cache event messages dropped unapplied, by engine and reason: backlog "
        "(more waited than the engine's share of the router's loop could apply), "
        "replay (a replay past what an engine buffers); the engine's index entries "
        "were cleared and rebuilt from the next message.",
    )
    for url, why, n in index.drops():
        out.append(f"llmgw_kv_events_dropped_total{labels(endpoint=url, reason=why)} {n}")
    return out


def _build(given: Given) -> Policy:
    return Precise(given.section, given.shared)


# Its section is cache_aware's: it places as cache_aware where the events tell nothing.
POLICY = PolicySpec(
    "precise",
    _build,
    section=CacheAwareSection,
    section_key="cache_aware",
    decisions=(PRECISE_HIT, PRECISE_LOAD_OVERRIDE, PRECISE_SPREAD, PRECISE_MISS),
    needs=Needs(
        # What every engine holds, by its own events: one index a router process.
        shared=KvIndex,
        # The engine's own /tokenize (router.tokenizer), asked by the router.
        tokens="llmgw_server.router.tokenizer:Tokenizer",
        # Each engine's KV-cache events into the index (router.kv_feed: pyzmq is
        # imported by such a router alone).
        feed="llmgw_server.router.kv_feed:follow_kv_events",
        metrics=kv_metrics,
    ),
)
