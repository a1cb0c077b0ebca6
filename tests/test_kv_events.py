"""Decoding vLLM's KV-cache event messages (llmgw_core.kv_events): both event encodings,
the payloads vLLM's own encoder wrote (tests/kv_events/), and every malformed or oversized
message refused with a clear error."""

from __future__ import annotations

import pathlib
from typing import Any

import msgpack
import pytest

from llmgw_core.kv_events import (
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED_FIELDS,
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEventError,
    decode_message,
    decode_replay,
)

FIXTURES = pathlib.Path(__file__).parent / "kv_events"
BIG = 0xFFFFFFFFFFFFFFF0


def frames(body: Any, seq: int = 6, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(body)]


def decode(body: Any, **kw: int) -> KvBatch:
    return decode_message(frames(body), **kw)


def stored_map(**over: Any) -> dict[str, Any]:
    """A BlockStored as vLLM 0.32.0 encodes it (msgspec, tag=True, omit_defaults)."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [13114575148833306375],
        "parent_block_hash": 2879005027887276479,
        "token_ids": list(range(28, 28 + 128)),
        "block_size": 128,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    event.update(over)
    return event


def stored_positional(*fields: Any) -> list[Any]:
    return ["BlockStored", *fields]


def tokens(event: object) -> list[int]:
    assert isinstance(event, BlockStored)
    return list(event.token_ids)


# -- the map encoding (vLLM 0.32.0) ------------------------------------------------------


def test_the_message_seen_from_vllm_0_32_0() -> None:
    batch = decode([1796283515.2, [stored_map()], 0])
    assert (batch.topic, batch.seq, batch.ts, batch.dp_rank, batch.skipped) == (
        "kv",
        6,
        1796283515.2,
        0,
        0,
    )
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (13114575148833306375,)
    assert event.parent_block_hash == 2879005027887276479
    assert tokens(event) == list(range(28, 156))
    assert (event.block_size, event.lora_id, event.lora_name, event.medium) == (
        128,
        None,
        None,
        "GPU",
    )
    assert event.extra_keys == (None,)
    assert (event.group_idx, event.kv_cache_spec_kind) == (0, "full_attention")


def test_map_events_of_every_type_and_defaults_omitted() -> None:
    batch = decode(
        [
            1.0,
            [
                # omit_defaults drops extra_keys, group_idx and the rest when unset
                {
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": None,
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 0},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored == BlockStored(
        block_hashes=(1, 2), parent_block_hash=None, token_ids=stored.token_ids, block_size=2
    )
    assert tokens(stored) == [1, 2, 3, 4]
    assert removed == BlockRemoved(block_hashes=(1,), medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()
    assert batch.dp_rank is None  # a two-element batch: no rank


def test_a_run_of_removals_from_one_medium_and_group_is_one_event() -> None:
    def removed(*hashes: int, medium: str | None = "GPU", group: int | None = 0) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group}

    batch = decode([1.0, [
        removed(1), removed(2, 3), removed(4),
        removed(5, medium="CPU"), removed(6, medium="CPU"),
        removed(7, group=1),
        stored_map(),
        removed(8), removed(9, medium=None, group=None), removed(10, medium=None, group=None),
        {"type": "AllBlocksCleared"},
        removed(11),
    ]])  # fmt: skip
    assert batch.events == (
        BlockRemoved(block_hashes=(1, 2, 3, 4), medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=(5, 6), medium="CPU", group_idx=0),
        BlockRemoved(block_hashes=(7,), medium="GPU", group_idx=1),
        batch.events[3],
        BlockRemoved(block_hashes=(8,), medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=(9, 10)),
        AllBlocksCleared(),
        BlockRemoved(block_hashes=(11,), medium="GPU", group_idx=0),
    )
    assert isinstance(batch.events[3], BlockStored)
    # A bad removal after a run still loses the message, as it did alone.
    with pytest.raises(KvEventError, match=r"event 2 \(BlockRemoved\): block_hashes holds a float"):
        decode([1.0, [removed(1), removed(2), {"type": "BlockRemoved", "block_hashes": [1.5]}]])


def test_unknown_fields_and_types_are_ignored() -> None:
    batch = decode(
        [
            1.0,
            [
                stored_map(session_id="s", locality="LOCAL", some_future_field=[1, {"a": 2}]),
                {"type": "BlockPinned", "block_hashes": [1]},
                ["BlockMoved", [1], "CPU"],
                {"type": "BlockRemoved", "block_hashes": [5], "ownership": "x"},
            ],
            0,
        ]
    )
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert batch.skipped == 2


def test_lora_and_extra_keys() -> None:
    (event,) = decode(
        [
            1.0,
            [
                stored_map(
                    lora_id=3,
                    lora_name="adapter",
                    block_hashes=[1, 2],
                    token_ids=list(range(256)),
                    extra_keys=[["adapter", ["mm-hash", 0], "salt"], None],
                )
            ],
        ]
    ).events
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name) == (3, "adapter")
    assert event.extra_keys == (("adapter", ("mm-hash", 0), "salt"), None)


def test_bytes_block_hashes() -> None:
    digest, parent = bytes(range(32)), bytes(range(100, 132))
    (event,) = decode([1.0, [stored_map(block_hashes=[digest], parent_block_hash=parent)]]).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (digest,)
    assert event.parent_block_hash == parent


def test_a_map_batch_is_read_too() -> None:
    batch = decode({"ts": 2.5, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1})
    assert (batch.ts, batch.dp_rank, batch.events) == (2.5, 1, (AllBlocksCleared(),))


# -- the positional encoding (vLLM before the map form) ----------------------------------


def test_positional_events_by_the_field_order() -> None:
    assert BLOCK_STORED_FIELDS[:10] == (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    )
    assert BLOCK_REMOVED_FIELDS[:3] == ("block_hashes", "medium", "group_idx")
    batch = decode(
        [
            3.0,
            [
                stored_positional([7], 9, [5, 6], 2, 4, "CPU", "ad", [["ad"]], 1, "full_attention"),
                ["BlockRemoved", [7], "CPU", 1],
                ["AllBlocksCleared"],
            ],
            2,
        ]
    )
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored == BlockStored(
        block_hashes=(7,),
        parent_block_hash=9,
        token_ids=stored.token_ids,
        block_size=2,
        lora_id=4,
        lora_name="ad",
        medium="CPU",
        extra_keys=(("ad",),),
        group_idx=1,
        kv_cache_spec_kind="full_attention",
    )
    assert tokens(stored) == [5, 6]
    assert removed == BlockRemoved(block_hashes=(7,), medium="CPU", group_idx=1)
    assert cleared == AllBlocksCleared()
    assert batch.dp_rank == 2


def test_positional_shorter_layouts_leave_later_fields_unset() -> None:
    # the first layout: five fields, BlockRemoved with one, the batch [ts, events]
    stored, removed = decode(
        [1.0, [stored_positional([1], None, [1, 2], 2, None), ["BlockRemoved", [1]]]]
    ).events
    assert isinstance(stored, BlockStored)
    assert (stored.medium, stored.lora_name, stored.extra_keys, stored.group_idx) == (
        None,
        None,
        None,
        None,
    )
    assert removed == BlockRemoved(block_hashes=(1,))


def test_positional_extra_trailing_fields_are_ignored() -> None:
    fields = [[1], None, [1, 2], 2, None, "GPU", None, None, 0, "full_attention", None]
    fields += ["LOCAL", "owner", "session", "a field from the future", 42]
    (stored,) = decode([1.0, [stored_positional(*fields)]]).events
    assert isinstance(stored, BlockStored)
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
    (removed,) = decode([1.0, [["BlockRemoved", [1], "GPU", 0, "LOCAL", "o", "future"]]]).events
    assert removed == BlockRemoved(block_hashes=(1,), medium="GPU", group_idx=0)


# -- what vLLM's own encoder wrote (tests/kv_events/make_fixtures.py) --------------------


def fixture(name: str, seq: int = 0) -> KvBatch:
    return decode_message([b"kv", seq.to_bytes(8, "big"), (FIXTURES / name).read_bytes()])


def test_vllm_0_32_0_own_encoder() -> None:
    batch = fixture("vllm-0.32.0.msgpack")
    assert (batch.ts, batch.dp_rank, batch.skipped) == (1796283515.25, 0, 0)
    root, child, on_cpu, removed, cleared = batch.events
    assert isinstance(root, BlockStored) and isinstance(child, BlockStored)
    assert root == BlockStored(
        block_hashes=(11, BIG),
        parent_block_hash=None,
        token_ids=root.token_ids,
        block_size=4,
        medium="GPU",
        extra_keys=(None, None),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert tokens(root) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert child == BlockStored(
        block_hashes=(12,),
        parent_block_hash=BIG,
        token_ids=child.token_ids,
        block_size=4,
        lora_id=3,
        lora_name="adapter",
        medium="GPU",
        extra_keys=(("adapter", "salt-1"),),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert tokens(child) == [128000, 65536, 255, 0]
    assert isinstance(on_cpu, BlockStored)
    assert on_cpu.block_hashes == (bytes(range(32)),)
    assert on_cpu.parent_block_hash == bytes(range(100, 132))
    assert (on_cpu.medium, on_cpu.extra_keys, on_cpu.group_idx) == ("CPU", None, None)
    assert removed == BlockRemoved(block_hashes=(11,), medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()


def test_positional_first_layout_from_msgspec() -> None:
    batch = fixture("positional-v1.msgpack")
    assert (batch.ts, batch.dp_rank) == (1700000000.5, None)
    root, child, removed, cleared = batch.events
    assert isinstance(root, BlockStored) and isinstance(child, BlockStored)
    assert (root.block_hashes, root.parent_block_hash, root.block_size) == ((11, BIG), None, 4)
    assert (child.block_hashes, child.parent_block_hash, child.lora_id) == ((12,), BIG, 7)
    assert tokens(child) == [128000, 65536, 255, 0]
    assert (root.medium, root.lora_name, root.group_idx) == (None, None, None)
    assert removed == BlockRemoved(block_hashes=(11,))
    assert cleared == AllBlocksCleared()


def test_positional_group_layout_from_msgspec() -> None:
    batch = fixture("positional-groups.msgpack")
    assert (batch.ts, batch.dp_rank) == (1750000000.0, 1)
    root, child, removed, cleared = batch.events
    assert isinstance(root, BlockStored) and isinstance(child, BlockStored)
    assert (root.medium, root.extra_keys, root.group_idx, root.kv_cache_spec_kind) == (
        "GPU",
        (None, None),
        0,
        None,
    )
    assert (child.lora_id, child.lora_name, child.extra_keys) == (3, "adapter", (("adapter",),))
    assert child.kv_cache_spec_kind == "full_attention"
    assert removed == BlockRemoved(block_hashes=(11,), medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()


# -- the replay socket --------------------------------------------------------------------


def test_replay_replies() -> None:
    payload = msgpack.packb([1.0, [["AllBlocksCleared"]], 0])
    new = decode_replay([b"kv", (5).to_bytes(8, "big"), payload])
    old = decode_replay([(5).to_bytes(8, "big"), payload])
    assert new is not None and old is not None
    assert (new.topic, new.seq, old.topic, old.seq) == ("kv", 5, "", 5)
    end = END_SEQ.to_bytes(8, "big")
    assert end == (-1).to_bytes(8, "big", signed=True)
    assert decode_replay([b"", end, b""]) is None
    assert decode_replay([end, b""]) is None
    with pytest.raises(KvEventError, match="2 or 3 frames"):
        decode_replay([end])


# -- refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ([b"kv", bytes(8)], "3 frames"),
        ([b"kv", bytes(8), b"\x90", b""], "3 frames"),
        ([b"kv", bytes(7), b"\x90"], "sequence frame is 7 bytes"),
        ([b"kv", bytes(9), b"\x90"], "sequence frame is 9 bytes"),
        ([b"\xff", bytes(8), b"\x90"], "topic is not UTF-8"),
        ([b"k" * 2000, bytes(8), b"\x90"], "topic is 2000 bytes"),
        ([b"kv", bytes(8), b""], "not valid msgpack"),
        ([b"kv", bytes(8), b"\xc1"], "not valid msgpack"),  # never used
        ([b"kv", bytes(8), msgpack.packb([1.0, []])[:-1]], "not valid msgpack"),
        ([b"kv", bytes(8), msgpack.packb([1.0, []]) + b"\x00"], "not valid msgpack"),
        ([b"kv", bytes(8), msgpack.packb({1: 2})], "not valid msgpack"),  # int map key
        ([b"kv", bytes(8), b"\x92\xa1\xff\x90"], "not valid msgpack"),  # a str not UTF-8
        ([b"kv", bytes(8), msgpack.packb(msgpack.ExtType(5, b"x"))], "not valid msgpack"),
        ([b"kv", bytes(8), b"\x91" * 5000 + b"\xc0"], "not valid msgpack"),  # too deep
    ],
)
def test_malformed_frames(message: list[bytes], error: str) -> None:
    with pytest.raises(KvEventError, match=error):
        decode_message(message)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (7, "payload is a int, not a batch array"),
        ("x", "payload is a string"),
        ([1.0], "array of 1"),
        ([1.0, [], 0, 0], "array of 4"),
        ({"ts": 1.0}, "lacks ts or events"),
        (["now", []], "ts is a string"),
        ([True, []], "ts is a boolean"),
        ([1.0, {}], "events is a map"),
        ([1.0, [], "0"], "data_parallel_rank is a string"),
        ([1.0, [7]], r"event 0 is a int, not a map or an array"),
        ([1.0, [None]], "event 0 is a nil"),
        ([1.0, [{"block_hashes": [1]}]], "event 0 is a map without a string 'type'"),
        ([1.0, [{"type": 3}]], "without a string 'type'"),
        ([1.0, [[]]], "array without a tag first"),
        ([1.0, [[1, 2]]], "array without a tag first"),
        ([1.0, [["BlockStored", [1], None, [1]]]], "has 3 fields, fewer than the 4"),
        ([1.0, [["BlockRemoved"]]], "has 0 fields, fewer than the 1"),
        ([1.0, [{"type": "BlockRemoved"}]], r"event 0 \(BlockRemoved\) lacks block_hashes"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]], "block_hashes is a int"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]], "holds a float"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [True]}]], "holds a boolean"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]], "holds a binary"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65]}]], "holds a binary"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 1}]], "medium is a int"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}]], "group_idx"),
    ],
)
def test_malformed_batches(body: Any, error: str) -> None:
    with pytest.raises(KvEventError, match=error):
        decode(body)


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"parent_block_hash": 1.5}, "parent_block_hash holds a float"),
        ({"token_ids": "abc"}, "token_ids is a string"),
        ({"token_ids": [1, -1]}, "token_ids holds something not a 32-bit token id"),
        ({"token_ids": [1, 1 << 32]}, "token_ids holds something not a 32-bit token id"),
        ({"token_ids": [1, "a"]}, "token_ids holds something not a 32-bit token id"),
        ({"token_ids": [1.0]}, "token_ids holds something not a 32-bit token id"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"block_size": True}, "block_size must be a positive int"),
        ({"block_size": "16"}, "block_size must be a positive int"),
        ({"lora_id": "3"}, "lora_id is a string"),
        ({"lora_name": 3}, "lora_name is a int"),
        ({"kv_cache_spec_kind": 1}, "kv_cache_spec_kind is a int"),
        ({"extra_keys": "x"}, "extra_keys is a string"),
        ({"extra_keys": [5]}, r"extra_keys\[0\] is a int"),
        ({"extra_keys": [[{"a": 1}]]}, r"extra_keys\[0\] holds a map"),
        ({"extra_keys": [[[[[["deep"]]]]]]}, r"extra_keys\[0\] nests deeper than 4"),
    ],
)
def test_malformed_block_stored(over: dict[str, Any], error: str) -> None:
    with pytest.raises(KvEventError, match=rf"event 0 \(BlockStored\): {error}"):
        decode([1.0, [stored_map(**over)]])


@pytest.mark.parametrize("field", ["block_hashes", "parent_block_hash", "token_ids", "block_size"])
def test_block_stored_lacking_a_required_field(field: str) -> None:
    event = stored_map()
    del event[field]
    with pytest.raises(KvEventError, match=rf"event 0 \(BlockStored\) lacks {field}"):
        decode([1.0, [event]])


def test_the_caps() -> None:
    with pytest.raises(KvEventError, match="payload is 1025 bytes, over the cap of 1024"):
        decode_message([b"kv", bytes(8), b"\xc0" * 1025], max_bytes=1024)
    with pytest.raises(KvEventError, match="3 events, over the cap of 2"):
        decode([1.0, [["AllBlocksCleared"]] * 3], max_events=2)
    with pytest.raises(KvEventError, match="129 token ids, over the cap of 128"):
        decode([1.0, [stored_map(token_ids=[1] * 129)]], max_tokens=128)
    with pytest.raises(KvEventError, match="65537 block hashes, over the cap of 65536"):
        decode([1.0, [{"type": "BlockRemoved", "block_hashes": [1] * 65537}]])
    # at the caps: accepted
    assert len(decode([1.0, [["AllBlocksCleared"]] * 2], max_events=2).events) == 2
    assert decode_message([b"kv", bytes(8), msgpack.packb([1.0, []])], max_bytes=11).events == ()


def test_the_default_message_cap_is_4_mib() -> None:
    body = msgpack.packb([1.0, [stored_map(token_ids=[70000] * 900_000)]])
    assert len(body) > 4 << 20
    with pytest.raises(KvEventError, match=f"over the cap of {4 << 20}"):
        decode_message([b"kv", bytes(8), body])
