"""The mock engine's scheduler model: the paged prefix cache and FIFO admission (pure)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from hypothesis_profiles import profile_times
from llmgw_mock_engine.scheduler import (
    Admission,
    BlockCache,
    EngineModel,
    PromptTooLong,
    Scheduler,
    block_hashes,
    prompt_tokens,
)


def words(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(count)]


# --------------------------------------------------------------------------- rendering, hashing


def test_a_conversation_turn_starts_with_the_previous_prompt_and_answer() -> None:
    first = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]}
    answer = "hello to you"
    second = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "and then?"},
        ]
    }
    before = prompt_tokens(first) + answer.split()
    assert prompt_tokens(first) == ["<|system|>", "be", "brief", "<|user|>", "hi", "there", "<|assistant|>"]
    assert prompt_tokens(second)[: len(before)] == before
    assert prompt_tokens({"prompt": "a b  c"}) == ["a", "b", "c"]
    assert prompt_tokens({"prompt": [1, 2]}) == ["[1,", "2]"]
    assert prompt_tokens({"messages": ["not a message"]})[0] == "<|unknown|>"


def test_block_hashes_cover_full_blocks_and_chain_the_prefix() -> None:
    a = block_hashes(words("t", 10), 4)
    assert len(a) == 2  # the last 2 tokens make no full block
    b = block_hashes([*words("t", 8), "other", "tail"], 4)
    assert a == b
    changed = block_hashes(["x", *words("t", 10)[1:]], 4)
    assert changed[0] != a[0] and changed[1] != a[1]  # a changed block changes all after it
    # The same block content after a different prefix is a different block.
    assert block_hashes(["a"] * 4 + ["b"] * 4, 4)[1] != block_hashes(["c"] * 4 + ["b"] * 4, 4)[1]


# --------------------------------------------------------------------------- the block cache


def test_lru_evicts_the_least_recently_released_block_and_a_hit_refreshes_it() -> None:
    cache = BlockCache(3)
    for block in (1, 2, 3):  # three sequences of one block each, released in this order
        cache.acquire([], 1)
        assert cache.commit(block)
        cache.release([block], 0)
    assert cache.evictable() == [1, 2, 3]
    cache.acquire([1], 0)  # a hit on 1 takes it out of the queue...
    cache.release([1], 0)  # ...and it comes back as the most recently used
    assert cache.evictable() == [2, 3, 1]
    cache.acquire([], 1)  # a fresh block evicts 2
    assert cache.evictable() == [3, 1] and not cache.contains(2) and cache.evictions == 1
    assert cache.match([3, 1]) == 2 and cache.match([2, 3]) == 0


def test_a_sequence_releases_its_tail_first() -> None:
    cache = BlockCache(4)
    cache.acquire([], 3)
    for block in (10, 11, 12):
        assert cache.commit(block)
    cache.release([10, 11, 12], 0)
    assert cache.evictable() == [12, 11, 10]  # the head of the prefix survives longest


def test_referenced_blocks_are_never_evicted_and_a_full_cache_refuses() -> None:
    cache = BlockCache(2)
    cache.acquire([], 1)
    assert cache.commit(7)
    assert not cache.fits([], 2)
    with pytest.raises(ValueError):
        cache.acquire([], 2)
    cache.acquire([], 1)
    assert cache.used == 2 and cache.free_blocks == 0 and cache.contains(7)
    assert not cache.commit(7)  # a duplicate stays anonymous


# --------------------------------------------------------------------------- the scheduler


def test_a_repeated_prompt_hits_its_full_blocks_and_at_least_one_token_is_computed() -> None:
    model = EngineModel(kv_blocks=100, block_size=4, prefill_tps=100.0, decode_tps=10.0)
    scheduler = Scheduler(model)
    prompt = words("p", 10)
    (first,) = scheduler.submit(1, prompt, 3, now=0.0)
    assert (first.cached_tokens, first.prefill_tokens, first.first_token_at) == (0, 10, 0.1)
    scheduler.prefilled(1)
    assert scheduler.finish(1, ["a", "b", "c"], now=1.0) == []
    (again,) = scheduler.submit(2, prompt, 3, now=2.0)
    assert (again.cached_tokens, again.prefill_tokens) == (8, 2)
    assert again.first_token_at == pytest.approx(2.02)
    scheduler.prefilled(2)
    scheduler.finish(2, [], now=3.0)
    # A prompt of exactly two blocks: the last block is computed again.
    (exact,) = scheduler.submit(3, prompt[:8], 1, now=4.0)
    assert (exact.cached_tokens, exact.prefill_tokens) == (4, 4)
    assert (scheduler.queried_tokens, scheduler.hit_tokens) == (28, 12)


def test_the_next_turn_hits_the_previous_answer() -> None:
    scheduler = Scheduler(EngineModel(kv_blocks=100, block_size=4))
    first = words("p", 6)
    answer = words("a", 6)
    scheduler.submit(1, first, 6, now=0.0)
    scheduler.prefilled(1)
    scheduler.finish(1, answer, now=1.0)
    (turn,) = scheduler.submit(2, [*first, *answer, "q", "r", "s"], 4, now=2.0)
    assert turn.cached_tokens == 12  # three full blocks of prompt + answer


def test_waiting_is_first_come_first_served_and_prefill_is_shared() -> None:
    model = EngineModel(kv_blocks=100, block_size=4, prefill_tps=10.0, max_seqs=2)
    scheduler = Scheduler(model)
    (a,) = scheduler.submit(1, words("a", 10), 1, now=0.0)
    (b,) = scheduler.submit(2, words("b", 5), 1, now=0.5)
    assert (a.first_token_at, b.first_token_at) == (1.0, 1.5)  # b prefills after a
    assert scheduler.submit(3, words("c", 5), 1, now=0.6) == []
    assert scheduler.submit(4, words("d", 5), 1, now=0.7) == []
    assert (scheduler.running, scheduler.waiting) == (2, 2)
    scheduler.prefilled(1)
    (c,) = scheduler.finish(1, ["x"], now=2.0)
    assert (c.seq_id, c.admitted_at, c.first_token_at) == (3, 2.0, 2.5)
    (d,) = scheduler.finish(3, [], now=2.1)  # a sequence gone during its prefill frees its slot
    assert d.seq_id == 4
    assert scheduler.finish(4, [], now=2.2) == [] and scheduler.running == 1


def test_a_waiting_sequence_that_leaves_is_forgotten() -> None:
    scheduler = Scheduler(EngineModel(kv_blocks=100, max_seqs=1))
    scheduler.submit(1, ["x"], 1, now=0.0)
    scheduler.submit(2, ["y"], 1, now=0.0)
    assert scheduler.finish(2, [], now=0.1) == []
    assert (scheduler.running, scheduler.waiting) == (1, 0)


def test_a_head_that_does_not_fit_holds_back_the_queue() -> None:
    scheduler = Scheduler(EngineModel(kv_blocks=4, block_size=4, max_seqs=8))
    scheduler.submit(1, words("a", 8), 0, now=0.0)  # 2 blocks
    assert scheduler.submit(2, words("b", 12), 0, now=0.0) == []  # 3 blocks: waits
    assert scheduler.submit(3, words("c", 5), 0, now=0.0) == []  # would fit, but FIFO
    admitted = scheduler.finish(1, [], now=1.0)
    assert [a.seq_id for a in admitted] == [2]
    assert scheduler.kv_usage == 0.75


def test_a_request_larger_than_the_cache_is_refused() -> None:
    scheduler = Scheduler(EngineModel(kv_blocks=2, block_size=4))
    with pytest.raises(PromptTooLong, match="maximum context length is 8 tokens"):
        scheduler.submit(1, words("a", 7), 2, now=0.0)
    with pytest.raises(ValueError):
        scheduler.submit(2, [], 2, now=0.0)
    assert (scheduler.running, scheduler.waiting) == (0, 0)


def test_model_parameters_are_checked() -> None:
    for bad in (
        {"kv_blocks": 0},
        {"kv_blocks": 1, "block_size": 0},
        {"kv_blocks": 1, "prefill_tps": 0.0},
        {"kv_blocks": 1, "decode_tps": math.nan},
        {"kv_blocks": 1, "max_seqs": 0},
    ):
        with pytest.raises(ValueError):
            EngineModel(**bad)


@settings(max_examples=profile_times(2), deadline=None)
@given(
    length=st.integers(1, 200),
    block_size=st.integers(1, 32),
    answer=st.integers(0, 50),
)
def test_a_prompt_alone_in_an_ample_cache_hits_every_block_but_the_last_token(
    length: int, block_size: int, answer: int
) -> None:
    model = EngineModel(kv_blocks=64, block_size=block_size)
    scheduler = Scheduler(model)
    prompt = words("w", length)
    if scheduler.blocks_for(length + answer) > model.kv_blocks:
        with pytest.raises(PromptTooLong):
            scheduler.submit(1, prompt, answer, now=0.0)
        return
    scheduler.submit(1, prompt, answer, now=0.0)
    scheduler.prefilled(1)
    scheduler.finish(1, words("out", answer), now=1.0)
    (again,) = scheduler.submit(2, prompt, answer, now=2.0)
    assert again.cached_tokens == (length - 1) // block_size * block_size
    assert again.prefill_tokens == length - again.cached_tokens >= 1


# --------------------------------------------------------------------------- property machines


class ReferenceCache:
    """The same cache rules written the slow, obvious way: stamps instead of an ordered dict."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[int, int] = {}  # cached hash -> references (0: evictable)
        self.stamp: dict[int, int] = {}  # evictable hash -> when it was released
        self.anonymous = 0
        self.clock = 0

    def used(self) -> int:
        return sum(1 for r in self.refs.values() if r > 0) + self.anonymous

    def match(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.refs:
            n += 1
        return n

    def fits(self, hits: list[int], fresh: int) -> bool:
        reclaimed = sum(1 for h in hits if self.refs.get(h) == 0)
        return fresh <= self.capacity - self.used() - reclaimed

    def acquire(self, hits: list[int], fresh: int) -> None:
        for h in hits:
            self.refs[h] += 1
            self.stamp.pop(h, None)
        for _ in range(fresh):
            if len(self.refs) + self.anonymous >= self.capacity:
                oldest = min(self.stamp, key=self.stamp.__getitem__)
                del self.stamp[oldest], self.refs[oldest]
            self.anonymous += 1

    def commit(self, h: int) -> bool:
        if h in self.refs:
            return False
        self.anonymous -= 1
        self.refs[h] = 1
        return True

    def release(self, hashes: list[int], anonymous: int) -> None:
        self.anonymous -= anonymous
        for h in reversed(hashes):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.clock += 1
                self.stamp[h] = self.clock

    def evictable(self) -> list[int]:
        return sorted(self.stamp, key=self.stamp.__getitem__)


class CacheMachine(RuleBasedStateMachine):
    """BlockCache against ReferenceCache: the same contents, order and answers."""

    owners = Bundle("owners")

    @initialize(capacity=st.integers(1, 12))
    def start(self, capacity: int) -> None:
        self.cache = BlockCache(capacity)
        self.ref = ReferenceCache(capacity)
        self.live: dict[int, tuple[list[int], int]] = {}  # owner -> (hashes held, anonymous)
        self.next_owner = 0

    @rule(target=owners, chain=st.lists(st.integers(0, 15), max_size=6), fresh=st.integers(0, 4))
    def acquire(self, chain: list[int], fresh: int) -> int:
        hits = chain[: self.cache.match(chain)]
        assert len(hits) == self.ref.match(chain)
        fits = self.cache.fits(hits, fresh)
        assert fits == self.ref.fits(hits, fresh)
        owner = self.next_owner
        self.next_owner += 1
        if fits:
            self.cache.acquire(hits, fresh)
            self.ref.acquire(hits, fresh)
            self.live[owner] = (list(hits), fresh)
        else:
            with pytest.raises(ValueError):
                self.cache.acquire(hits, fresh)
        return owner

    @rule(owner=owners, block=st.integers(0, 15))
    def commit(self, owner: int, block: int) -> None:
        if owner not in self.live or self.live[owner][1] == 0:
            return
        held, anonymous = self.live[owner]
        done = self.cache.commit(block)
        assert done == self.ref.commit(block)
        if done:
            self.live[owner] = ([*held, block], anonymous - 1)

    @rule(owner=consumes(owners))
    def release(self, owner: int) -> None:
        if owner not in self.live:
            return
        held, anonymous = self.live.pop(owner)
        self.cache.release(held, anonymous)
        self.ref.release(held, anonymous)

    @invariant()
    def same_as_the_reference(self) -> None:
        if not hasattr(self, "cache"):
            return
        assert self.cache.evictable() == self.ref.evictable()
        assert self.cache.used == self.ref.used()
        assert self.cache.cached == len(self.ref.refs)

    @invariant()
    def never_beyond_capacity(self) -> None:
        if not hasattr(self, "cache"):
            return
        assert self.cache.used + len(self.cache.evictable()) <= self.cache.capacity
        shared = {block for held, _ in self.live.values() for block in held}
        assert self.cache.used == len(shared) + sum(a for _, a in self.live.values())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=profile_times(1.5), stateful_step_count=40, deadline=None)


class SchedulerMachine(RuleBasedStateMachine):
    """Any sequence of arrivals, prefills and departures keeps the scheduler's promises."""

    @initialize(
        blocks=st.integers(4, 40),
        block_size=st.integers(1, 6),
        max_seqs=st.integers(1, 4),
    )
    def start(self, blocks: int, block_size: int, max_seqs: int) -> None:
        self.model = EngineModel(kv_blocks=blocks, block_size=block_size, prefill_tps=10.0, max_seqs=max_seqs)
        self.scheduler = Scheduler(self.model)
        self.now = 0.0
        self.next_id = 0
        self.submitted: list[int] = []  # in arrival order
        self.admitted: list[int] = []  # in admission order
        self.running: dict[int, bool] = {}  # running sequence -> prefilled
        self.lengths: dict[int, int] = {}
        self.last_first_token = -math.inf
        self.queried = self.hits = 0

    def admit(self, admissions: list[Admission]) -> None:
        for a in admissions:
            assert a.admitted_at == self.now
            assert a.cached_tokens % self.model.block_size == 0
            assert a.cached_tokens + a.prefill_tokens == self.lengths[a.seq_id]
            assert a.prefill_tokens >= 1
            # Prefill is shared: each starts after the one before and takes its own time.
            start = max(self.now, self.last_first_token)
            assert a.first_token_at == pytest.approx(start + a.prefill_tokens / self.model.prefill_tps)
            self.last_first_token = a.first_token_at
            self.admitted.append(a.seq_id)
            self.running[a.seq_id] = False
            self.queried += self.lengths[a.seq_id]
            self.hits += a.cached_tokens

    @rule(family=st.integers(0, 2), length=st.integers(1, 30), answer=st.integers(0, 8), later=st.floats(0, 1))
    def arrive(self, family: int, length: int, answer: int, later: float) -> None:
        self.now += later
        seq_id = self.next_id
        self.next_id += 1
        prompt = words(f"f{family}-", length)  # prompts of a family share prefixes
        self.lengths[seq_id] = length
        try:
            admissions = self.scheduler.submit(seq_id, prompt, answer, self.now)
        except PromptTooLong:
            assert self.scheduler.blocks_for(length + answer) > self.model.kv_blocks
            return
        self.submitted.append(seq_id)
        self.admit(admissions)

    @precondition(lambda self: any(not done for done in self.running.values()))
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(s for s, done in self.running.items() if not done)))
        self.scheduler.prefilled(seq_id)
        self.running[seq_id] = True

    @precondition(lambda self: bool(self.running) or self.scheduler.waiting > 0)
    @rule(data=st.data(), later=st.floats(0, 1), output=st.integers(0, 8))
    def leave(self, data: st.DataObject, later: float, output: int) -> None:
        self.now += later
        waiting = [s for s in self.submitted if s not in self.admitted]
        seq_id = data.draw(st.sampled_from(sorted([*self.running, *waiting])))
        finished = self.running.pop(seq_id, False)
        self.admit(self.scheduler.finish(seq_id, words("o", output) if finished else [], self.now))
        self.submitted.remove(seq_id)
        if seq_id in self.admitted:
            self.admitted.remove(seq_id)

    @invariant()
    def promises(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        s = self.scheduler
        assert s.running == len(self.running) <= self.model.max_seqs
        assert s.cache.used + len(s.cache.evictable()) <= self.model.kv_blocks
        assert 0.0 <= s.kv_usage <= 1.0
        # First come, first served: the admitted are exactly the oldest arrivals.
        assert self.submitted[: len(self.admitted)] == self.admitted
        # Never stuck: something waits only while something runs.
        assert s.waiting == 0 or s.running > 0
        assert (s.queried_tokens, s.hit_tokens) == (self.queried, self.hits)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=profile_times(1.5), stateful_step_count=40, deadline=None)
