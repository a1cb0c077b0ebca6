"""The cache-aware choice: pure, with time passed in."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.catalog import Endpoint
from llmgw_core.config import CacheAwareSection
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.load_signals import LoadSignal
from llmgw_server.router.policies.cache_aware import (
    CACHE_HIT,
    FALLBACK,
    LOAD_OVERRIDE,
    CacheAware,
    load_of,
)
from llmgw_server.router.policies.policy import SESSION
from llmgw_server.router.prefix import PromptKey, prompt_key

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(n))


def balancer(n: int, **tuning: Any) -> Balancer:
    replicas = [Replica(Endpoint(f"10.0.0.{i}", 8000)) for i in range(n)]
    return Balancer(
        replicas, balancing="cache_aware", tuning=attrs.evolve(CacheAwareSection(), **tuning)
    )


def policy(b: Balancer) -> CacheAware:
    """The balancer's cache-aware policy, which holds what each replica was sent."""
    assert isinstance(b.policy, CacheAware)
    return b.policy


def key(messages: list[dict[str, str]]) -> PromptKey:
    k = prompt_key({"messages": messages}, True, 256)
    assert k is not None
    return k


class Conversation:
    def __init__(self, rng: random.Random, context_words: int = 400) -> None:
        self.rng = rng
        self.messages = [
            {"role": "system", "content": words(rng, context_words)},
            {"role": "user", "content": words(rng, 20)},
        ]

    def key(self) -> PromptKey:
        return key(self.messages)

    def answered(self) -> None:
        self.messages += [
            {"role": "assistant", "content": words(self.rng, 30)},
            {"role": "user", "content": words(self.rng, 15)},
        ]


def test_a_conversation_stays_on_its_replica() -> None:
    rng = random.Random(1)
    b = balancer(4)
    conversation = Conversation(rng)
    first = b.choose(prompt=conversation.key(), now=0)
    assert first is not None and first.decision is FALLBACK
    for turn in range(1, 8):
        conversation.answered()
        choice = b.choose(prompt=conversation.key(), now=turn)
        assert choice is not None and choice.replica is first.replica
        assert choice.decision is CACHE_HIT and choice.matched_bytes > 0


def test_a_loaded_holder_is_overridden_then_the_conversation_follows() -> None:
    rng = random.Random(2)
    b = balancer(3, load_slack=2.0, max_load_ratio=1.5)
    conversation = Conversation(rng)
    home = b.pick(prompt=conversation.key(), now=0)
    assert home is not None
    home.outstanding = 2  # within least + 2 of the others' 0: still home
    conversation.answered()
    choice = b.choose(prompt=conversation.key(), now=1)
    assert choice is not None and choice.replica is home
    home.outstanding = 3  # beyond max(0 * 1.5, 0 + 2)
    conversation.answered()
    moved = b.choose(prompt=conversation.key(), now=2)
    assert moved is not None and moved.replica is not home
    assert moved.decision is LOAD_OVERRIDE
    # The new replica now holds the longer history: the next turn goes there.
    conversation.answered()
    after = b.choose(prompt=conversation.key(), now=3)
    assert after is not None and after.replica is moved.replica
    assert after.decision is CACHE_HIT


def test_a_replica_that_fails_is_not_counted_on_for_its_cache() -> None:
    rng = random.Random(12)
    b = balancer(2)
    conversation = Conversation(rng)
    home = b.pick(prompt=conversation.key(), now=0)
    assert home is not None and len(policy(b).index(home))
    b.probed(home, ok=False, now=1)  # it may come back as a fresh engine
    assert len(policy(b).index(home)) == 0
    other = b.replicas[1] if home is b.replicas[0] else b.replicas[0]
    b.pick(prompt=conversation.key(), now=2)
    assert len(policy(b).index(other))
    for now in (3, 4, 5):
        b.failed(other, now=now)
    assert other.ejected and len(policy(b).index(other)) == 0


def test_the_engines_reading_counts_with_what_was_sent_since() -> None:
    tuning = CacheAwareSection(waiting_weight=1.0, kv_usage_weight=2.0, metrics_max_age_s=3.0)
    r = Replica(Endpoint("10.0.0.1", 8000))
    b = Balancer([r])
    b.sent(r)
    assert load_of(r, tuning, now=4.0) == 1  # no reading: the router's own count
    r.took_reading(LoadSignal("vllm", running=6, waiting=2, kv_usage=0.5), 4.0)
    assert r.outstanding_at_load == 1
    b.sent(r)
    # 8 requests in the engine (other routers' too) + 1 sent since, + 2 waiting, + 2 * 0.5.
    assert load_of(r, tuning, now=5.0) == 9 + 2 + 1.0
    assert load_of(r, tuning, now=7.5) == 2  # older than metrics_max_age_s: not used
    r.took_reading(LoadSignal("llamacpp", running=0, waiting=0), 7.0)
    b.finished(r)
    assert load_of(r, tuning, now=7.5) == 1  # finished since: counted out of the reading
    b.sent(r)
    b.sent(r)
    assert load_of(r, tuning, now=7.5) == 3  # the engine has not seen ours yet: never less


def test_engine_load_moves_new_conversations_away_from_a_queue() -> None:
    rng = random.Random(3)
    b = balancer(2)
    queued, idle = b.replicas
    queued.took_reading(LoadSignal("vllm", running=16, waiting=10, kv_usage=1.0), 10.0)
    for _ in range(10):
        chosen = b.pick(prompt=Conversation(rng).key(), now=10.5)
        assert chosen is idle


def test_a_hot_prefix_spreads_one_request_at_a_time() -> None:
    """The known failure: a shared system prompt pinned to one replica (354:0)."""
    for n, requests in ((2, 40), (8, 48), (3, 100)):
        rng = random.Random(n)
        b = balancer(n)
        system = words(rng, 2000)
        seen: Counter[int] = Counter()
        for i in range(requests):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": words(rng, 30)},
            ]
            chosen = b.pick(prompt=key(messages), now=float(i))
            assert chosen is not None
            seen[id(chosen)] += 1
        assert len(seen) == n and max(seen.values()) <= 1.5 * requests / n, (n, seen)


def test_completion_prompts_stick_by_conversation_and_a_hot_header_spreads() -> None:
    rng = random.Random(6)
    b = balancer(4)
    header = words(rng, 300)
    prompts = [f"{header}\nQ: {words(rng, 8)}" for _ in range(4)]
    homes = [b.pick(prompt=prompt_key({"prompt": p}, False, 256), now=0) for p in prompts]
    for turn in range(1, 5):
        for i, p in enumerate(prompts):
            prompts[i] = p = f"{p}\nA: {words(rng, 5)}\nQ: {words(rng, 4)}"
            choice = b.choose(prompt=prompt_key({"prompt": p}, False, 256), now=float(turn))
            assert choice is not None and choice.replica is homes[i]
            assert choice.decision is CACHE_HIT
    seen = Counter(
        id(b.pick(prompt=prompt_key({"prompt": f"{header}\nQ: {words(rng, 8)}"}, False, 256)))
        for _ in range(40)
    )
    assert len(seen) == 4 and max(seen.values()) <= 15


def test_the_same_prompt_over_and_over_spreads_too() -> None:
    b = balancer(2)
    same = key([{"role": "user", "content": "hello there"}])
    seen = Counter(id(b.pick(prompt=same, now=float(i))) for i in range(20))
    assert sorted(seen.values()) == [10, 10]


def test_new_conversations_spread_within_the_bound() -> None:
    rng = random.Random(4)
    b = balancer(8)
    homes = Counter(id(b.pick(prompt=Conversation(rng).key(), now=0)) for _ in range(200))
    # At most ceil(1.4 * 200 / 8) + 1 = 36 each, where hashing alone would give ~25 +- 5.
    assert len(homes) == 8 and max(homes.values()) <= 36


def test_no_prompt_goes_to_the_least_loaded() -> None:
    b = balancer(3)
    b.replicas[0].outstanding, b.replicas[1].outstanding, b.replicas[2].outstanding = 2, 0, 1
    choice = b.choose(prompt=None, now=0)
    assert choice is not None and choice.replica is b.replicas[1]
    assert choice.decision is FALLBACK


def test_sessions_use_rendezvous_and_keep_recording_nothing() -> None:
    b = balancer(3)
    rng = random.Random(5)
    choice = b.choose(session="alice", prompt=Conversation(rng).key(), now=0)
    assert choice is not None and choice.decision is SESSION
    choice.replica.outstanding = 50  # a session stays, however loaded
    assert b.pick(session="alice", now=1) is choice.replica


@settings(max_examples=profile_times(2), deadline=None)
@given(
    available=st.lists(st.booleans(), min_size=1, max_size=8),
    loads=st.lists(st.integers(0, 30), min_size=8, max_size=8),
    conversation=st.integers(0, 5),
    turns=st.integers(0, 3),
    excluded=st.sets(st.integers(0, 7), max_size=3),
)
def test_never_an_unavailable_or_excluded_replica(
    available: list[bool], loads: list[int], conversation: int, turns: int, excluded: set[int]
) -> None:
    rng = random.Random(conversation)
    b = balancer(len(available))
    # History first, with every replica up, so that holders may be down now.
    c = Conversation(rng, context_words=100)
    for t in range(turns):
        b.pick(prompt=c.key(), now=float(t))
        c.answered()
    for r, up, load in zip(b.replicas, available, loads, strict=False):
        r.healthy = up
        r.outstanding = load
    exclude = [b.replicas[i] for i in excluded if i < len(b.replicas)]
    choice = b.choose(prompt=c.key(), exclude=exclude, now=10.0)
    allowed = [r for r in b.replicas if r.available and r not in exclude]
    if not allowed:
        assert choice is None
    else:
        assert choice is not None and choice.replica in allowed


def test_choose_alone_needs_a_candidate() -> None:
    b = balancer(2)
    choice = policy(b).choose(b.replicas, None, 0.0)
    assert choice.replica in b.replicas and choice.decision is FALLBACK
    assert choice.matched_bytes == 0


@settings(max_examples=profile_times(0.2), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), replicas=st.integers(2, 8))
def test_two_routers_that_each_saw_half_the_traffic_agree(seed: int, replicas: int) -> None:
    """Each request of a multi-turn workload goes to one of two router processes (no shared
    memory); then both are asked where each conversation's next turn goes."""
    rng = random.Random(seed)
    mine, theirs = balancer(replicas), balancer(replicas)
    conversations = [Conversation(rng, context_words=rng.randint(50, 400)) for _ in range(200)]
    for turn in range(4):
        for c in rng.sample(conversations, len(conversations)):
            (mine if rng.random() < 0.5 else theirs).pick(prompt=c.key(), now=float(turn))
            c.answered()
    same = 0
    for c in conversations:
        k = c.key()
        a = policy(mine).choose(mine.replicas, k, 10.0).replica
        b = policy(theirs).choose(theirs.replicas, k, 10.0).replica
        same += a.endpoint == b.endpoint
    assert same >= 0.9 * len(conversations)


def router_config(text: str) -> Any:
    """As the server reads its config: with its balancing policies."""
    import tomllib

    from llmgw_core.config import parse_config
    from llmgw_server.router.policies import PolicyBook

    data = tomllib.loads(text + '\n[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:1"]\n')
    return parse_config(data, "r.toml", policies=PolicyBook())


def test_the_config_defaults_to_cache_aware() -> None:
    router = router_config("").router
    assert router.balancing == "cache_aware" and router.cache_aware == CacheAwareSection()
    tuned = router_config(
        '[router]\nbalancing = "round_robin"\n[router.cache_aware]\nblock_bytes = 128\n'
        "metrics_interval_s = 0\nmax_share = 2\n"
    ).router
    assert tuned.balancing == "round_robin"
    assert tuned.cache_aware == CacheAwareSection(
        block_bytes=128, metrics_interval_s=0.0, max_share=2.0
    )


def test_config_mistakes_name_the_key() -> None:
    import pytest

    from llmgw_core.tomlshape import ConfigError

    cases = {
        '[router]\nbalancing = "cache-aware"\n': "r.toml: router.balancing: must be one of "
        "cache_aware, least_outstanding, precise, round_robin, not 'cache-aware' (did you mean "
        "'cache_aware'?)",
        "[router.cache_aware]\nblock_byte = 128\n": "router.cache_aware.block_byte: is not a "
        "known key (did you mean 'block_bytes'?)",
        "[router.cache_aware]\nblock_bytes = 8\n": "router.cache_aware.block_bytes: must be at "
        "least 16, not 8",
        "[router.cache_aware]\nmax_share = 0.5\n": "router.cache_aware.max_share: must be at least 1",
        "[router.cache_aware]\nshared_prefix_ratio = 2\n": "shared_prefix_ratio: must be at most 1",
        "[router.cache_aware]\nmetrics_interval_s = 5\n": "router.cache_aware.metrics_max_age_s: "
        "must be at least metrics_interval_s (5.0)",
        "[router]\ncache_aware = 3\n": "router.cache_aware: must be a table, not an integer",
        # The policies' names (policies.registered), read as any text first: the same messages.
        "[router]\nbalancing = 3\n": "router.balancing: must be a string, not an integer",
        '[router]\nbalancing = " "\n': "router.balancing: must not be empty",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            router_config(text)
        assert message in str(caught.value), str(caught.value)
