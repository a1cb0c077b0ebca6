"""The router's index of the KV-cache blocks each replica holds
(llmgw_server.router.kv_index): fed by decoded events, asked for each replica's longest
cached prefix of a request."""

from __future__ import annotations

import array
import gc
import pathlib
import random
import tracemalloc
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hypothesis_profiles import profile_times
from llmgw_core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEvent,
    decode_message,
)
from llmgw_server.router.kv_index import (
    MAX_BLOCKS,
    MAX_BLOCKS_PER_REPLICA,
    SPECULATIVE_TTL_S,
    KvIndex,
    block_chain,
)

BS = 4
PROMPT = list(range(100, 124))  # six blocks of 4


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], bs: int = BS, **kw: Any
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=array.array("I", tokens),
        block_size=bs,
        **kw,
    )


def removed(hashes: list[int], **kw: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=tuple(hashes), **kw)


def batch(seq: int, *events: KvEvent, skipped: int = 0) -> KvBatch:
    return KvBatch(topic="kv", seq=seq, ts=0.0, dp_rank=0, events=events, skipped=skipped)


class Feed:
    """Sends each replica's batches with the next sequence number."""

    def __init__(self, index: KvIndex) -> None:
        self.index = index
        self.seq: dict[str, int] = defaultdict(int)

    def __call__(self, replica: str, *events: KvEvent, now: float = 0.0) -> Any:
        seq = self.seq[replica]
        self.seq[replica] += 1
        return self.index.apply(replica, batch(seq, *events), now)


@pytest.fixture
def index() -> KvIndex:
    return KvIndex()


@pytest.fixture
def feed(index: KvIndex) -> Feed:
    return Feed(index)


def blocks(n: int, start: int = 0) -> list[int]:
    return PROMPT[start * BS : (start + n) * BS]


# -- storing, removing, clearing ----------------------------------------------------------


def test_a_chain_over_several_events(index: KvIndex, feed: Feed) -> None:
    result = feed("a", stored([1, 2], None, blocks(2)))
    assert (result.applied, result.stored, result.orphaned) == (1, 2, 0)
    feed("a", stored([3], 2, blocks(1, 2)))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 3}
    assert index.lookup(PROMPT[:13], BS, None, 0.0) == {"a": 3}  # a partial block: not counted
    assert index.lookup(PROMPT[:11], BS, None, 0.0) == {"a": 2}
    assert index.lookup(PROMPT[:3], BS, None, 0.0) == {}
    other = [*PROMPT[:5], 0, *PROMPT[6:]]  # differs in block 1
    assert index.lookup(other, BS, None, 0.0) == {"a": 1}
    assert index.lookup([0, *PROMPT[1:]], BS, None, 0.0) == {}
    assert index.held("a") == len(index) == 3
    assert index.block_size("a") == BS


def test_own_hashes_do_not_depend_on_the_engines(index: KvIndex, feed: Feed) -> None:
    # two engines, two hash seeds: the same tokens under unrelated engine hashes
    feed("a", stored([1, 2, 3], None, blocks(3)))
    feed("b", stored([901, 902], None, blocks(2)))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 3, "b": 2}
    chain = block_chain(PROMPT, BS, None)
    assert len(chain) == 6 and len(set(chain)) == 6
    assert chain == block_chain(array.array("I", PROMPT), BS, None)
    assert index.lookup_chain(chain, 0.0) == {"a": 3, "b": 2}


def test_the_own_hash_is_pinned() -> None:
    """BLAKE2b-64 of the extra-key digest, the parent's hash and the tokens (uint32, all
    little-endian), the same in every process: written out, so a change shows."""
    assert block_chain([1, 2, 3, 4, 5], 4, None) == (0x7271513D2FBE3B7B,)
    assert block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, "sql") == (
        0x8195B4829A195E69,
        0x51F24A81BF714C30,
    )
    first = block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, None)
    assert block_chain([1, 2, 3, 4, 5, 6, 7, 8], 8, None)[0] not in first


def test_remove_cuts_the_prefix_where_it_falls(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1, 2, 3, 4], None, blocks(4)))
    result = feed("a", removed([3, 77]))  # 77: never stored
    assert result.removed == 1
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 2}
    feed("a", removed([1]))
    assert index.lookup(PROMPT, BS, None, 0.0) == {}
    assert index.held("a") == 2  # blocks 2 and 4, unreachable until evicted or removed


def test_all_blocks_cleared(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1, 2], None, blocks(2)))
    feed("b", stored([1, 2], None, blocks(2)))
    result = feed("a", AllBlocksCleared(), stored([5], None, blocks(1)))
    assert result.cleared and result.stored == 1
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1, "b": 2}
    assert len(index) == 3


def test_a_parent_unknown_to_the_index_drops_the_blocks(index: KvIndex, feed: Feed) -> None:
    result = feed("a", stored([2, 3], 1, blocks(2, 1)))
    assert (result.stored, result.orphaned) == (0, 2)
    assert index.held("a") == 0
    # nor can its children be placed
    assert feed("a", stored([4], 3, blocks(1, 3))).orphaned == 1
    # a chain start is placed whatever came before
    feed("a", stored([1], None, blocks(1)))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1}


def test_events_whose_shape_does_not_add_up_are_dropped(index: KvIndex, feed: Feed) -> None:
    result = feed(
        "a",
        stored([1, 2], None, blocks(1)),  # 4 tokens for 2 blocks
        stored([1], None, blocks(1), extra_keys=(None, None)),  # 2 extra keys for 1 block
        stored([], None, []),  # no blocks: nothing to do
    )
    assert (result.malformed, result.stored) == (2, 0)
    assert index.held("a") == 0


def test_skipped_events_are_counted(index: KvIndex) -> None:
    assert index.apply("a", batch(0, skipped=3), 0.0).skipped == 3
    assert index.apply("a", batch(5, skipped=2), 0.0).skipped == 0  # buffered, not applied
    assert index.replay_done("a", 0.0).skipped == 2


def test_an_event_reusing_an_engine_hash_within_itself(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([3, 3], None, blocks(2)))
    assert index.held("a") == 1
    assert index.lookup(PROMPT, BS, None, 0.0) == {}  # block 0 lost its name to block 1


def test_the_engine_reusing_a_hash_for_other_tokens(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1], None, blocks(1)))
    feed("a", stored([1], None, blocks(1, 3)))  # hash 1 now names other tokens
    assert index.lookup(PROMPT, BS, None, 0.0) == {}
    assert index.lookup(blocks(1, 3), BS, None, 0.0) == {"a": 1}
    assert index.held("a") == 1
    feed("a", removed([1]))
    assert index.held("a") == 0


def test_a_block_is_held_while_any_medium_holds_it(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1, 2], None, blocks(2), medium="GPU"))
    feed("a", stored([2], 1, blocks(1, 1), medium="CPU"))  # offloaded; parent is on the GPU
    feed("a", stored([3], 2, blocks(1, 2), medium="CPU"))  # parent resolved on the CPU
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 3}
    assert index.held("a") == 3
    feed("a", removed([2], medium="GPU"))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 3}
    feed("a", removed([2], medium="CPU"))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1}
    feed("a", removed([2], medium=None))  # None is the GPU: already gone
    assert index.held("a") == 2


def test_one_replicas_events_never_touch_anothers(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1, 2, 3], None, blocks(3)))
    feed("b", stored([1, 2, 3], None, blocks(3)))  # the same engine hashes, by chance
    feed("a", removed([2]))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1, "b": 3}
    feed("a", AllBlocksCleared())
    assert index.lookup(PROMPT, BS, None, 0.0) == {"b": 3}
    index.forget("b")
    assert (index.lookup(PROMPT, BS, None, 0.0), len(index), index.held("b")) == ({}, 0, 0)


# -- LoRA and extra keys ----------------------------------------------------------------


def test_lora_blocks_are_apart_from_the_base_models(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1, 2], None, blocks(2), lora_id=1, lora_name="sql"))
    feed("b", stored([1, 2, 3], None, blocks(3)))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"b": 3}
    assert index.lookup(PROMPT, BS, "sql", 0.0) == {"a": 2}
    assert index.lookup(PROMPT, BS, "other", 0.0) == {}


def test_the_lora_name_in_extra_keys_is_the_same_key(index: KvIndex, feed: Feed) -> None:
    # vLLM 0.32.0 repeats the adapter's name first in each block's extra keys
    feed("a", stored([1, 2], None, blocks(2), lora_name="sql", extra_keys=(("sql",), ("sql",))))
    feed("b", stored([1, 2], None, blocks(2), lora_name="sql"))
    assert index.lookup(PROMPT, BS, "sql", 0.0) == {"a": 2, "b": 2}


def test_other_extra_keys_are_never_matched_by_text(index: KvIndex, feed: Feed) -> None:
    # an image in block 1, a cache salt on block 0: held, but not for a plain prompt
    feed("a", stored([1, 2, 3], None, blocks(3), extra_keys=(None, (("mm", 0),), None)))
    feed("b", stored([1, 2], None, blocks(2), extra_keys=(("salt",), None)))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1}
    assert index.held("a") == 3 and index.held("b") == 2


def test_a_lora_id_without_a_name_is_never_matched(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1], None, blocks(1), lora_id=4))  # vLLM before lora_name
    assert index.lookup(PROMPT, BS, None, 0.0) == {}
    assert index.held("a") == 1


# -- sequence numbers -------------------------------------------------------------------


def test_a_gap_asks_for_a_replay_and_the_replay_fills_it(index: KvIndex) -> None:
    assert index.apply("a", batch(0, stored([1], None, blocks(1))), 0.0).applied == 1
    gap = index.apply("a", batch(3, stored([4], 3, blocks(1, 3))), 0.0)
    assert (gap.replay_from, gap.buffered, gap.applied) == (1, True, 0)
    later = index.apply("a", batch(4, stored([5], 4, blocks(1, 4))), 0.0)
    assert (later.replay_from, later.buffered) == (None, True)  # asked once
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1}
    assert index.last_seq("a") == 0
    # the replay: 1, 2, then 3 and 4 again (it sends all it has from 1 on)
    assert index.apply("a", batch(1, stored([2], 1, blocks(1, 1))), 0.0, replayed=True).applied == 1
    filled = index.apply("a", batch(2, stored([3], 2, blocks(1, 2))), 0.0, replayed=True)
    assert filled.applied == 3  # 2, and the buffered 3 and 4
    assert index.apply("a", batch(3), 0.0, replayed=True).duplicate
    assert index.apply("a", batch(4), 0.0, replayed=True).duplicate
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 5}
    assert index.last_seq("a") == 4
    assert index.replay_done("a", 0.0).cleared is False  # nothing open
    assert index.apply("a", batch(5, stored([6], 5, blocks(1, 5))), 0.0).applied == 1
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 6}


def test_a_gap_the_replay_cannot_fill(index: KvIndex) -> None:
    index.apply("a", batch(0, stored([1, 2], None, blocks(2))), 0.0)
    assert index.apply("a", batch(5, stored([7], None, blocks(1, 5))), 0.0).replay_from == 1
    assert index.apply("a", batch(6), 0.0).buffered
    # the replay ends without the missing batches (the engine's buffer moved on)
    done = index.replay_done("a", 0.0)
    assert (done.resynced, done.cleared, done.applied) == (True, True, 2)
    assert index.lookup(PROMPT, BS, None, 0.0) == {}  # block 0 and 1 dropped: unknowable
    assert index.lookup(blocks(1, 5), BS, None, 0.0) == {"a": 1}
    assert index.last_seq("a") == 6
    assert index.apply("a", batch(7), 0.0).applied == 1


def test_a_replay_that_starts_past_the_hole(index: KvIndex) -> None:
    index.apply("a", batch(0, stored([1], None, blocks(1))), 0.0)
    index.apply("a", batch(4), 0.0)
    result = index.apply("a", batch(3), 0.0, replayed=True)
    assert (result.resynced, result.cleared, result.applied) == (True, True, 2)
    assert index.last_seq("a") == 4 and index.held("a") == 0


def test_too_much_behind_a_gap_gives_up(index: KvIndex) -> None:
    small = KvIndex(max_pending_batches=2)
    small.apply("a", batch(0, stored([1], None, blocks(1))), 0.0)
    assert small.apply("a", batch(2), 0.0).buffered
    assert small.apply("a", batch(3), 0.0).buffered
    over = small.apply("a", batch(4), 0.0)
    assert (over.resynced, over.buffered, over.applied) == (True, False, 3)
    assert small.last_seq("a") == 4 and small.held("a") == 0
    few_tokens = KvIndex(max_pending_tokens=8)
    few_tokens.apply("a", batch(0), 0.0)
    assert few_tokens.apply("a", batch(2, stored([1, 2], None, blocks(2))), 0.0).buffered
    assert few_tokens.apply("a", batch(3, stored([3], 2, blocks(1, 2))), 0.0).resynced
    assert few_tokens.lookup(PROMPT, BS, None, 0.0) == {"a": 3}


def test_a_restart_clears(index: KvIndex) -> None:
    for seq in range(3):
        index.apply("a", batch(seq, stored([seq + 1], seq or None, blocks(1, seq))), 0.0)
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 3}
    result = index.apply("a", batch(0, stored([9], None, blocks(1))), 0.0)
    assert (result.restarted, result.cleared, result.applied) == (True, True, 1)
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 1}
    assert index.last_seq("a") == 0
    # a restart while a gap was open drops what was buffered
    index.apply("a", batch(5), 0.0)
    assert index.apply("a", batch(0), 0.0).restarted
    assert index.apply("a", batch(1), 0.0).applied == 1
    assert index.replay_done("a", 0.0).resynced is False


def test_the_first_batch_seen_may_have_any_number(index: KvIndex) -> None:
    result = index.apply("a", batch(1234, stored([1], None, blocks(1))), 0.0)
    assert (result.applied, result.replay_from) == (1, None)
    assert index.last_seq("a") == 1234


# -- hybrid models ----------------------------------------------------------------------


def test_more_than_one_kv_cache_group_makes_a_replica_unusable(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1, 2], None, blocks(2), group_idx=0))
    feed("b", stored([1, 2], None, blocks(2), group_idx=0))
    assert feed("a", stored([3], 2, blocks(1, 2), group_idx=0)).unusable is None
    result = feed("a", stored([1], None, blocks(1), group_idx=1))
    assert result.unusable is not None and "hybrid" in result.unusable
    assert result.cleared
    assert index.unusable("a") == result.unusable
    assert index.held("a") == 0
    # later events are ignored, speculation too
    later = feed("a", stored([1], None, blocks(1), group_idx=0))
    assert (later.applied, later.unusable) == (0, result.unusable)
    assert index.speculate("a", PROMPT, BS, None, 0.0) == 0
    assert index.lookup(PROMPT, BS, None, 0.0) == {"b": 2}
    # a removal's group counts too
    assert feed("b", removed([9], group_idx=2)).unusable is not None
    index.forget("a")
    assert index.unusable("a") is None


# -- caps and LRU -----------------------------------------------------------------------


def test_the_defaults() -> None:
    assert (MAX_BLOCKS_PER_REPLICA, MAX_BLOCKS, SPECULATIVE_TTL_S) == (200_000, 1_000_000, 2.0)
    index = KvIndex()
    assert (index.max_blocks_per_replica, index.max_blocks) == (200_000, 1_000_000)
    with pytest.raises(ValueError, match="caps must be positive"):
        KvIndex(max_blocks=0)


def test_a_replicas_cap_evicts_the_least_recently_used() -> None:
    index = KvIndex(max_blocks_per_replica=4)
    feed = Feed(index)
    other = list(range(1000, 1008))
    feed("a", stored([1, 2], None, blocks(2)))
    feed("a", stored([11, 12], None, other))
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 2}  # the prompt's blocks: newest
    result = feed("a", stored([3], 2, blocks(1, 2)))
    assert (result.evicted, index.held("a")) == (1, 4)
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 3}
    # the other chain lost its tail, not its start: touched deepest first
    assert index.lookup(other, BS, None, 0.0) == {"a": 1}
    # a removal of an evicted block is ignored
    assert feed("a", removed([12])).removed == 0


def test_an_event_longer_than_the_cap_keeps_its_start() -> None:
    index = KvIndex(max_blocks_per_replica=2)
    result = Feed(index)("a", stored([1, 2, 3, 4, 5], None, PROMPT[:20]))
    assert result.evicted == 3
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 2}


def test_the_total_cap_evicts_from_the_largest_replica() -> None:
    index = KvIndex(max_blocks=5)
    feed = Feed(index)
    feed("a", stored([1, 2, 3], None, blocks(3)))
    feed("b", stored([1], None, blocks(1)))
    result = feed("b", stored([2, 3], 1, blocks(2, 1)))
    assert (result.evicted, len(index)) == (1, 5)
    assert (index.held("a"), index.held("b")) == (2, 3)
    assert index.lookup(PROMPT, BS, None, 0.0) == {"a": 2, "b": 3}


# -- speculation ------------------------------------------------------------------------


def test_speculative_entries_expire(index: KvIndex, feed: Feed) -> None:
    assert index.speculate("a", PROMPT[:10], BS, None, 100.0) == 2
    assert index.lookup(PROMPT, BS, None, 101.9) == {"a": 2}
    assert index.lookup(PROMPT, BS, None, 102.0) == {}  # not counted once expired
    assert index.held("a") == 2
    index.expire(102.0)
    assert index.held("a") == len(index) == 0


def test_events_confirm_speculation(index: KvIndex, feed: Feed) -> None:
    chain = block_chain(PROMPT, BS, "sql")
    assert index.speculate_chain("a", chain[:3], 10.0) == 3
    feed("a", stored([1, 2], None, blocks(2), lora_name="sql"), now=11.0)
    assert index.lookup(PROMPT, BS, "sql", 11.0) == {"a": 3}
    assert index.lookup(PROMPT, BS, "sql", 20.0) == {"a": 2}  # confirmed ones stay
    feed("a", removed([1]), now=20.0)  # a real removal beats speculation
    assert index.lookup(PROMPT, BS, "sql", 20.0) == {}
    assert index.held("a") == 1  # block 1 (confirmed, unreachable); block 2 expired, dropped


def test_speculation_extends_and_touches(index: KvIndex) -> None:
    index.speculate("a", PROMPT[:8], BS, None, 0.0)
    index.speculate("a", PROMPT[:4], BS, None, 1.5)
    assert index.lookup(PROMPT, BS, None, 2.5) == {"a": 1}  # block 0 renewed until 3.5
    index.expire(2.5)
    assert index.held("a") == 1
    index.expire(3.5)
    assert index.held("a") == 0
    assert index.speculate("a", PROMPT[:3], BS, None, 0.0) == 0  # no full block


def test_speculation_under_the_cap() -> None:
    index = KvIndex(max_blocks_per_replica=3)
    index.speculate("a", PROMPT, BS, None, 0.0)
    assert index.held("a") == 3
    assert index.lookup(PROMPT, BS, None, 1.0) == {"a": 3}  # the chain's start kept


def test_lookups_refuse_bad_input(index: KvIndex, feed: Feed) -> None:
    feed("a", stored([1], None, blocks(1)))
    with pytest.raises(ValueError, match="block_size must be positive"):
        index.lookup(PROMPT, 0, None, 0.0)
    with pytest.raises(ValueError, match="token ids must be ints"):
        index.lookup([-1, 2, 3, 4], BS, None, 0.0)
    with pytest.raises(ValueError, match="token ids must be ints"):
        block_chain([1 << 32, 2, 3, 4], BS, None)
    assert KvIndex().lookup(PROMPT, BS, None, 0.0) == {}


# -- the fixtures vLLM's encoder wrote ----------------------------------------------------


def test_the_engines_payloads_drive_the_index() -> None:
    here = pathlib.Path(__file__).parent / "kv_events"
    index = KvIndex()
    payload = (here / "positional-v1.msgpack").read_bytes()
    message = decode_message([b"kv", bytes(8), payload])
    events = message.events[:2]  # the root chain and its child, not the removal
    result = index.apply("a", batch(0, *events), 0.0)
    assert (result.stored, result.orphaned) == (3, 0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 128000, 65536, 255, 0]
    assert index.lookup(prompt, 4, None, 0.0) == {"a": 2}  # the child is LoRA id 7's
    real = decode_message([b"kv", bytes(8), (here / "vllm-0.32.0.msgpack").read_bytes()])
    result = index.apply("b", batch(0, *real.events[:3]), 0.0)
    assert (result.stored, result.orphaned) == (3, 1)  # the CPU block's parent is unknown
    assert index.lookup(prompt, 4, None, 0.0) == {"a": 2, "b": 2}
    assert index.lookup(prompt, 4, "adapter", 0.0) == {}  # the salt keeps it apart


# -- memory -------------------------------------------------------------------------------


def test_memory_per_block() -> None:
    """180 to 230 bytes a block (kv_index's docstring), the engine's hash ints included."""
    n, bs = 20_000, 16
    rng = random.Random(7)
    tokens = array.array("I", (rng.randrange(150_000) for _ in range(n * bs)))
    index = KvIndex()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        parent = None
        for seq, start in enumerate(range(0, n, 50)):
            # the engine's hashes made here, as decoding makes them: the index keeps them
            hashes = tuple(rng.getrandbits(64) | 1 << 63 for _ in range(50))
            event = BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens[start * bs : (start + 50) * bs],
                block_size=bs,
                medium="GPU",
                group_idx=0,
            )
            index.apply("a", batch(seq, event), 0.0)
            parent = hashes[-1]
        del event, hashes
        gc.collect()
        per_block = (tracemalloc.get_traced_memory()[0] - base) / len(index)
    finally:
        tracemalloc.stop()
    assert len(index) == n
    print(f"{per_block:.0f} bytes per block")
    assert 100 < per_block < 300


# -- against a model ----------------------------------------------------------------------

VOCAB = st.integers(0, 3)  # a small vocabulary: prompts share prefixes often
REPLICAS = ("r0", "r1")
MBS = 2  # the machine's block size


# A block as the model names it: the chain of (LoRA, tokens) from the chain's start.
Path = tuple[tuple[str | None, tuple[int, ...]], ...]
EngineKey = tuple[str, int]  # (medium, the engine's hash)


class IndexMachine(RuleBasedStateMachine):
    """Random stored, removed, cleared and restarted batches, checked against a simple
    model: each replica's engine hashes (per medium) mapped to the path each names; a
    replica holds a path while some engine hash names it (the set of the dict's values)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = KvIndex()
        self.seq = dict.fromkeys(REPLICAS, 0)
        self.model: dict[str, dict[EngineKey, Path]] = {r: {} for r in REPLICAS}
        self.prompts: list[tuple[tuple[int, ...], str | None]] = [((), None)]

    def send(self, replica: str, *events: KvEvent) -> None:
        self.index.apply(replica, batch(self.seq[replica], *events), 0.0)
        self.seq[replica] += 1

    @rule(
        replica=st.sampled_from(REPLICAS),
        hashes=st.lists(st.integers(0, 12), min_size=1, max_size=3),
        data=st.data(),
        lora=st.sampled_from([None, "x"]),
        medium=st.sampled_from(["GPU", "CPU"]),
    )
    def store(
        self,
        replica: str,
        hashes: list[int],
        data: st.DataObject,
        lora: str | None,
        medium: str,
    ) -> None:
        engine = self.model[replica]
        # a chain's start, a parent the replica holds (mostly), or any hash
        known = sorted(h for _, h in engine)
        parent = data.draw(
            st.one_of(st.none(), st.sampled_from(known) if known else st.none(), st.integers(0, 12))
        )
        tokens = data.draw(st.lists(VOCAB, min_size=MBS * len(hashes), max_size=MBS * len(hashes)))

        def event(hashes: list[int]) -> BlockStored:
            return stored(hashes, parent, tokens, bs=MBS, lora_name=lora, medium=medium)

        if parent is None:
            path: Path = ()
        else:
            # the parent on the event's medium, else on the GPU
            found = engine.get((medium, parent)) or engine.get(("GPU", parent))
            if found is None:  # cannot be placed
                self.send(replica, event(hashes))
                return
            path = found
        paths = []
        for i in range(len(hashes)):
            path = (*path, (lora, tuple(tokens[i * MBS : (i + 1) * MBS])))
            paths.append(path)
        hashes = [self.name(p, h) for p, h in zip(paths, hashes, strict=True)]
        self.send(replica, event(hashes))
        for p, h in zip(paths, hashes, strict=True):
            engine[(medium, h)] = p
        self.prompts.append((tuple(t for _, block in path for t in block), lora))

    def name(self, path: Path, drawn: int) -> int:
        """The engine's hash for a block: here any (engines reusing one for other tokens)."""
        return drawn

    @rule(
        replica=st.sampled_from(REPLICAS),
        data=st.data(),
        medium=st.sampled_from(["GPU", "CPU"]),
    )
    def remove(self, replica: str, data: st.DataObject, medium: str) -> None:
        known = sorted(h for _, h in self.model[replica])
        some = (
            st.one_of(st.sampled_from(known), st.integers(0, 12)) if known else st.integers(0, 12)
        )
        hashes = data.draw(st.lists(some, max_size=4))
        self.send(replica, removed(hashes, medium=medium))
        for h in hashes:
            self.model[replica].pop((medium, h), None)

    @rule(replica=st.sampled_from(REPLICAS))
    def clear(self, replica: str) -> None:
        self.send(replica, AllBlocksCleared())
        self.model[replica].clear()

    @precondition(lambda self: any(self.seq.values()))
    @rule(replica=st.sampled_from(REPLICAS))
    def restart(self, replica: str) -> None:
        self.seq[replica] = 0
        self.send(replica)
        self.model[replica].clear()

    def expected(self, prompt: tuple[int, ...], lora: str | None) -> dict[str, int]:
        out = {}
        for replica, engine in self.model.items():
            held = set(engine.values())
            path: Path = ()
            for i in range(len(prompt) // MBS):
                path = (*path, (lora, prompt[i * MBS : (i + 1) * MBS]))
                if path not in held:
                    break
                out[replica] = i + 1
        return out

    @staticmethod
    def query(data: st.DataObject, prompts: list[tuple[tuple[int, ...], str | None]]) -> Any:
        """A stored chain's tokens, cut short or run on, with its LoRA or the other."""
        recent = st.sampled_from(prompts[-3:])  # mostly the newest: most likely still held
        prompt, lora = data.draw(st.one_of(recent, recent, st.sampled_from(prompts)))
        prompt = prompt[: max(0, len(prompt) - data.draw(st.integers(0, 4)))]
        prompt += tuple(data.draw(st.lists(VOCAB, max_size=3)))
        if data.draw(st.integers(0, 3)) == 0:
            lora = "x" if lora is None else None
        return prompt, lora

    @precondition(lambda self: len(self.prompts) > 1)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        prompt, lora = self.query(data, self.prompts)
        assert self.index.lookup(prompt, MBS, lora, 0.0) == self.expected(prompt, lora)

    @invariant()
    def counts(self) -> None:
        # within the caps the index holds exactly the model's distinct paths
        held = {r: len(set(e.values())) for r, e in self.model.items()}
        assert {r: self.index.held(r) for r in REPLICAS} == held
        assert len(self.index) == sum(held.values())


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(
    max_examples=profile_times(1.0), stateful_step_count=40, deadline=None
)


class CappedMachine(IndexMachine):
    """The same with small caps: lookups never claim more than the model, and the caps
    hold. The engine's hashes name content here, as vLLM's do: an index that evicted a
    block could otherwise miss the event that gave its engine hash to other tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.index = KvIndex(max_blocks_per_replica=5, max_blocks=8)
        self.names: dict[Path, int] = {}

    def name(self, path: Path, drawn: int) -> int:
        return self.names.setdefault(path, 100 + len(self.names))

    @precondition(lambda self: len(self.prompts) > 1)
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        prompt, lora = self.query(data, self.prompts)
        got = self.index.lookup(prompt, MBS, lora, 0.0)
        want = self.expected(prompt, lora)
        assert all(got[r] <= want.get(r, 0) for r in got), (got, want)

    @invariant()
    def counts(self) -> None:
        assert all(self.index.held(r) <= 5 for r in REPLICAS)
        assert len(self.index) == sum(self.index.held(r) for r in REPLICAS) <= 8


TestCappedMachine = CappedMachine.TestCase
TestCappedMachine.settings = settings(
    max_examples=profile_times(0.5), stateful_step_count=40, deadline=None
)
