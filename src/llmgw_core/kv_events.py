"""vLLM's KV-cache events, decoded from the ZMQ messages its engine publishes.

An engine started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'` publishes one message per engine step that changed its prefix cache, three
frames: the topic (UTF-8), the sequence number (8 bytes, big-endian, from 0 at the engine's
start), and a msgpack payload, msgspec's encoding of vLLM's `KVEventBatch`
(vllm/distributed/kv_events.py): the positional `[ts, events, data_parallel_rank]`
(`array_like=True`; a map `{"ts", "events", "data_parallel_rank"}` is read too).

Each event is a msgspec tagged struct, tag = the class name, in one of two encodings:

- a map whose `"type"` key holds the tag (vLLM 0.32.0: `KVCacheEvent(..., tag=True)`
  without `array_like`), fields by name; a field left at its default is omitted
  (`omit_defaults=True`);
- the older positional array `[tag, field1, field2, ...]` (`array_like=True, tag=True`),
  fields in declaration order. Every version seen appends fields, never reorders them:
  `BLOCK_STORED_FIELDS` and `BLOCK_REMOVED_FIELDS` are that order; an array shorter than
  the newest layout leaves the missing trailing fields unset, one longer has its extra
  trailing fields ignored.

Unknown fields are ignored and unknown event types are skipped (counted in
`KvBatch.skipped`); anything else malformed raises `KvEventError`, whose message says what
and where. Sizes are capped (`MAX_MESSAGE_BYTES`, `MAX_EVENTS`, `MAX_BLOCKS_PER_EVENT`,
`MAX_TOKENS_PER_EVENT`, `MAX_EXTRA_ITEMS`), so one message costs bounded memory and time.
`decode_message_steps` and `decode_replay_steps` decode a slice at a time, yielding between
slices: msgpack's own pass over the payload (about 30 ms for a 4 MiB message) at once, then
about `SLICE_ITEMS` events, extra keys or 256k token ids a slice (a few ms each).

Block hashes are the engine's own: 64-bit ints (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`,
the default) or the digest's bytes. They are seeded per process unless PYTHONHASHSEED is
set, so they name blocks within one engine's stream only; the router hashes `token_ids`
itself (llmgw_server.router.kv_index).

The replay socket (`replay_endpoint`, a ROUTER) answers a request of one frame, the
first wanted sequence number (8 bytes, big-endian), with the buffered messages from that
number on, then an end marker whose sequence number is -1: `decode_replay` reads them.
"""

from __future__ import annotations

import array
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Final, TypeAlias, TypeGuard, TypeVar

import attrs
import msgpack

MAX_MESSAGE_BYTES: Final = 4 << 20  # a payload frame: 4 MiB
MAX_TOPIC_BYTES: Final = 1024
MAX_EVENTS: Final = 16_384  # events in one batch
MAX_BLOCKS_PER_EVENT: Final = 65_536  # block hashes in one event
MAX_TOKENS_PER_EVENT: Final = 1 << 20  # token ids in one BlockStored
MAX_HASH_BYTES: Final = 64  # a block hash sent as bytes (vLLM's: 32, SHA-256)
MAX_EXTRA_DEPTH: Final = 4  # nesting of arrays inside one block's extra keys
# Values in one block's extra keys, nested ones included: vLLM's are its LoRA name, a
# cache salt, a prompt-embedding digest and one identifier per multimodal item the block
# overlaps. Without it, 4 MiB of extra keys took 0.8 s to read.
MAX_EXTRA_ITEMS: Final = 64
SLICE_ITEMS: Final = 4096  # events or blocks' extra keys read between two yields
_SLICE_TOKENS: Final = 1 << 18  # token ids converted (or freed) between two yields

END_SEQ: Final = (1 << 64) - 1  # the replay's end marker: -1 as 8 unsigned bytes

BlockHash: TypeAlias = int | bytes
ExtraKey: TypeAlias = tuple[Any, ...]  # one block's extra keys: scalars and tuples of them

# vLLM's BlockStored and BlockRemoved, fields in declaration order (the positional
# encoding's order after the tag). Verified against vllm/distributed/kv_events.py: the
# first BlockStored (block_hashes, parent_block_hash, token_ids, block_size, lora_id;
# BlockRemoved: block_hashes), then medium, lora_name, extra_keys, group_idx,
# kv_cache_spec_kind, kv_cache_spec_sliding_window appended in turn, and in 0.32.0 locality,
# ownership, session_id (BlockRemoved: medium, group_idx, locality, ownership).
BLOCK_STORED_FIELDS: Final = (
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
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
BLOCK_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_STORED_REQUIRED = 4  # block_hashes .. block_size: every version has them
_REMOVED_REQUIRED = 1

_UINT32 = "I"
assert array.array(_UINT32).itemsize == 4  # on every platform CPython runs on


class KvEventError(ValueError):
    """A KV-event message that cannot be decoded; the text says what is wrong."""


@attrs.frozen(slots=True)
class BlockStored:
    """Full blocks the engine stored: `token_ids` holds every token of them in order
    (`len(block_hashes) * block_size` of them), `parent_block_hash` the engine's hash of
    the block before the first (None at a chain's start)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    # As decoded: an array of unsigned 32-bit ints (typecode "I"), checked and compact.
    token_ids: Sequence[int] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    # One entry per block (None: no extra keys), or None for none at all.
    extra_keys: tuple[ExtraKey | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@attrs.frozen(slots=True)
class BlockRemoved:
    """Blocks the engine evicted from `medium`."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@attrs.frozen(slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. `/reset_prefix_cache`)."""


KvEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@attrs.frozen(slots=True)
class KvBatch:
    """One message: the events of one engine step, in order."""

    topic: str
    seq: int
    ts: float
    dp_rank: int | None
    events: tuple[KvEvent, ...]
    skipped: int = 0  # events of a type this decoder does not know


_T = TypeVar("_T")
Steps: TypeAlias = Generator[None, None, _T]


def run_steps(steps: Steps[_T]) -> _T:
    """What a sliced decoding returns, decoded at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def decode_message(
    frames: Sequence[bytes],
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_events: int = MAX_EVENTS,
    max_tokens: int = MAX_TOKENS_PER_EVENT,
) -> KvBatch:
    """The batch in a published message's frames: topic, sequence number, payload."""
    return run_steps(
        decode_message_steps(
            frames, max_bytes=max_bytes, max_events=max_events, max_tokens=max_tokens
        )
    )


def decode_message_steps(
    frames: Sequence[bytes],
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_events: int = MAX_EVENTS,
    max_tokens: int = MAX_TOKENS_PER_EVENT,
) -> Steps[KvBatch]:
    """`decode_message`, a slice at a time (see the module's text)."""
    if len(frames) != 3:
        raise KvEventError(
            f"a KV-event message has 3 frames (topic, sequence, payload), got {len(frames)}"
        )
    topic, seq, payload = frames
    return (yield from _decode(topic, seq, payload, max_bytes, max_events, max_tokens))


def decode_replay(
    frames: Sequence[bytes],
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_events: int = MAX_EVENTS,
    max_tokens: int = MAX_TOKENS_PER_EVENT,
) -> KvBatch | None:
    """One reply from the replay socket, after the envelope's empty delimiter: `[topic,
    sequence, payload]` (vLLM 0.32.0), or `[sequence, payload]` (older, topic ""); None
    for the end marker (sequence -1, empty payload)."""
    return run_steps(
        decode_replay_steps(
            frames, max_bytes=max_bytes, max_events=max_events, max_tokens=max_tokens
        )
    )


def decode_replay_steps(
    frames: Sequence[bytes],
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    max_events: int = MAX_EVENTS,
    max_tokens: int = MAX_TOKENS_PER_EVENT,
) -> Steps[KvBatch | None]:
    """`decode_replay`, a slice at a time."""
    if len(frames) == 3:
        topic, seq, payload = frames
    elif len(frames) == 2:
        topic, (seq, payload) = b"", frames
    else:
        raise KvEventError(
            f"a KV-event replay has 2 or 3 frames ([topic,] sequence, payload), got {len(frames)}"
        )
    if len(seq) == 8 and int.from_bytes(seq, "big") == END_SEQ and not payload:
        return None
    return (yield from _decode(topic, seq, payload, max_bytes, max_events, max_tokens))


def _decode(
    topic: bytes, seq: bytes, payload: bytes, max_bytes: int, max_events: int, max_tokens: int
) -> Steps[KvBatch]:
    for name, frame in (("topic", topic), ("sequence", seq), ("payload", payload)):
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise KvEventError(f"the {name} frame is {type(frame).__name__}, not bytes")
    if len(topic) > MAX_TOPIC_BYTES:
        raise KvEventError(f"the topic is {len(topic)} bytes, over {MAX_TOPIC_BYTES}")
    try:
        topic_text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvEventError(f"the topic is not UTF-8: {e}") from None
    if len(seq) != 8:
        raise KvEventError(f"the sequence frame is {len(seq)} bytes, not 8")
    if len(payload) > max_bytes:
        raise KvEventError(f"the payload is {len(payload)} bytes, over the cap of {max_bytes}")
    cap = max(max_events, max_tokens, MAX_BLOCKS_PER_EVENT)
    try:
        # Strings as str (strict UTF-8), map keys str or bytes only, extension types
        # (timestamps included) as ExtType, which no field accepts; each container's length
        # capped before it is allocated.
        body = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            timestamp=0,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=cap,
            max_map_len=1024,
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
        # ExtraData, FormatError, StackError and UnicodeDecodeError are ValueErrors.
        raise KvEventError(f"the payload is not valid msgpack: {e}") from None
    yield
    ts, events_raw, dp_rank = _batch_fields(body)
    if len(events_raw) > max_events:
        raise KvEventError(f"the batch has {len(events_raw)} events, over the cap of {max_events}")
    events: list[KvEvent] = []
    skipped = 0
    # An engine under pressure sends a BlockRemoved a block, most of a batch: a run of
    # them from one medium and group is one event here (the same removals, in order).
    run: list[BlockHash] = []
    run_place: tuple[str | None, int | None] = (None, None)
    for i, raw in enumerate(events_raw):
        if type(raw) is dict and raw.get("type") == "BlockRemoved":
            plain = _plain_removal(raw)
            if plain is not None:
                hashes, place = plain[0], plain[1:]
                if place != run_place or not run:
                    _end_run(events, run, run_place)
                    run, run_place = [], place
                run += hashes
                continue
        _end_run(events, run, run_place)
        run = []
        event = yield from _event(i, raw, max_tokens)
        if event is None:
            skipped += 1
        else:
            events.append(event)
        if i % SLICE_ITEMS == SLICE_ITEMS - 1:
            yield
    _end_run(events, run, run_place)
    return KvBatch(
        topic=topic_text,
        seq=int.from_bytes(seq, "big"),
        ts=ts,
        dp_rank=dp_rank,
        events=tuple(events),
        skipped=skipped,
    )


_INT_ONLY: Final = frozenset({int})


def _plain_removal(fields: Mapping[str, Any]) -> tuple[list[int], str | None, int | None] | None:
    """A BlockRemoved's hashes, medium and group when they are what engines send (int
    hashes, a string medium or nil, an int group or nil), checked in one pass: most of
    what an engine under pressure sends, one a block. None: read it field by field."""
    hashes, medium = fields.get("block_hashes"), fields.get("medium")
    group = fields.get("group_idx")
    if (
        type(hashes) is list
        and len(hashes) <= MAX_BLOCKS_PER_EVENT
        and {*map(type, hashes)} <= _INT_ONLY
        and (medium is None or type(medium) is str)
        and (group is None or type(group) is int)
    ):
        return hashes, medium, group
    return None


def _end_run(
    events: list[KvEvent], run: list[BlockHash], place: tuple[str | None, int | None]
) -> None:
    if run:
        medium, group = place
        events.append(BlockRemoved(block_hashes=tuple(run), medium=medium, group_idx=group))


def _batch_fields(body: object) -> tuple[float, list[Any], int | None]:
    if isinstance(body, list):
        if not 2 <= len(body) <= 3:
            raise KvEventError(
                f"the payload is an array of {len(body)}, not [ts, events, data_parallel_rank]"
            )
        ts, events = body[0], body[1]
        dp_rank = body[2] if len(body) == 3 else None
    elif isinstance(body, dict):
        if "ts" not in body or "events" not in body:
            raise KvEventError("the payload map lacks ts or events")
        ts, events, dp_rank = body["ts"], body["events"], body.get("data_parallel_rank")
    else:
        raise KvEventError(f"the payload is a {_kind(body)}, not a batch array")
    if not _is_number(ts):
        raise KvEventError(f"the batch's ts is a {_kind(ts)}, not a number")
    if not isinstance(events, list):
        raise KvEventError(f"the batch's events is a {_kind(events)}, not an array")
    if dp_rank is not None and not _is_int(dp_rank):
        raise KvEventError(f"the batch's data_parallel_rank is a {_kind(dp_rank)}, not an int")
    return float(ts), events, dp_rank


def _event(i: int, raw: object, max_tokens: int) -> Steps[KvEvent | None]:
    """The event, or None for a type this decoder does not know."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventError(f"event {i} is a map without a string 'type'")
        fields: Mapping[str, Any] = raw
    elif isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KvEventError(f"event {i} is an array without a tag first")
        tag = raw[0]
        names = {"BlockStored": BLOCK_STORED_FIELDS, "BlockRemoved": BLOCK_REMOVED_FIELDS}.get(
            tag, ()
        )
        required = {"BlockStored": _STORED_REQUIRED, "BlockRemoved": _REMOVED_REQUIRED}.get(tag, 0)
        if len(raw) - 1 < required:
            raise KvEventError(
                f"event {i} ({tag}) has {len(raw) - 1} fields, fewer than the {required} "
                f"every version sends"
            )
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KvEventError(f"event {i} is a {_kind(raw)}, not a map or an array")
    if tag == "BlockRemoved":
        plain = _plain_removal(fields)
        if plain is not None:
            hashes, medium, group = plain
            return BlockRemoved(block_hashes=tuple(hashes), medium=medium, group_idx=group)
    where = f"event {i} ({tag})"
    if tag == "BlockStored":
        return (yield from _stored(where, fields, max_tokens))
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(where, _required(where, fields, "block_hashes")),
            medium=_opt_str(where, fields, "medium"),
            group_idx=_opt_int(where, fields, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(where: str, fields: Mapping[str, Any], max_tokens: int) -> Steps[BlockStored]:
    hashes = _hashes(where, _required(where, fields, "block_hashes"))
    parent = _required(where, fields, "parent_block_hash")
    if parent is not None:
        parent = _hash(where, "parent_block_hash", parent)
    tokens = _required(where, fields, "token_ids")
    if not isinstance(tokens, list):
        raise KvEventError(f"{where}: token_ids is a {_kind(tokens)}, not an array")
    if len(tokens) > max_tokens:
        raise KvEventError(f"{where}: {len(tokens)} token ids, over the cap of {max_tokens}")
    token_ids = array.array(_UINT32)
    for first in range(0, len(tokens), _SLICE_TOKENS):
        try:
            token_ids.extend(tokens[first : first + _SLICE_TOKENS])
        except (TypeError, OverflowError):
            raise KvEventError(
                f"{where}: token_ids holds something not a 32-bit token id"
            ) from None
        if len(tokens) > _SLICE_TOKENS:
            yield
    # A million ids take 10 ms to free: a slice at a time, from the end (the list is the
    # decoded payload's, read no more).
    while len(tokens) > _SLICE_TOKENS:
        del tokens[-_SLICE_TOKENS:]
        yield
    block_size = _required(where, fields, "block_size")
    if not _is_int(block_size) or block_size <= 0:
        raise KvEventError(f"{where}: block_size must be a positive int, got {block_size!r}")
    extra_raw = fields.get("extra_keys")
    extra: tuple[ExtraKey | None, ...] | None = None
    if extra_raw is not None:
        if not isinstance(extra_raw, list) or len(extra_raw) > MAX_BLOCKS_PER_EVENT:
            raise KvEventError(f"{where}: extra_keys is a {_kind(extra_raw)}, not an array")
        frozen: list[ExtraKey | None] = []
        for j, e in enumerate(extra_raw):
            frozen.append(_extra(where, j, e))
            if j % SLICE_ITEMS == SLICE_ITEMS - 1:
                yield
        extra = tuple(frozen)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=_opt_int(where, fields, "lora_id"),
        lora_name=_opt_str(where, fields, "lora_name"),
        medium=_opt_str(where, fields, "medium"),
        extra_keys=extra,
        group_idx=_opt_int(where, fields, "group_idx"),
        kv_cache_spec_kind=_opt_str(where, fields, "kv_cache_spec_kind"),
    )


def _required(where: str, fields: Mapping[str, Any], name: str) -> Any:
    if name not in fields:
        raise KvEventError(f"{where} lacks {name}")
    return fields[name]


def _hashes(where: str, value: object) -> tuple[BlockHash, ...]:
    if not isinstance(value, list):
        raise KvEventError(f"{where}: block_hashes is a {_kind(value)}, not an array")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise KvEventError(
            f"{where}: {len(value)} block hashes, over the cap of {MAX_BLOCKS_PER_EVENT}"
        )
    if {*map(type, value)} <= _INT_ONLY:
        return tuple(value)
    return tuple(_hash(where, "block_hashes", h) for h in value)


def _hash(where: str, name: str, value: object) -> BlockHash:
    if _is_int(value):
        # msgpack's range: int64 and uint64 (some forks send the signed reading).
        return value
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BYTES:
        return value
    raise KvEventError(f"{where}: {name} holds a {_kind(value)}, not an int or bytes hash")


def _extra(where: str, j: int, value: object) -> ExtraKey | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise KvEventError(f"{where}: extra_keys[{j}] is a {_kind(value)}, not an array or nil")
    return _freeze(where, j, value, 0, [MAX_EXTRA_ITEMS])


def _freeze(where: str, j: int, value: list[Any], depth: int, left: list[int]) -> ExtraKey:
    if depth >= MAX_EXTRA_DEPTH:
        raise KvEventError(f"{where}: extra_keys[{j}] nests deeper than {MAX_EXTRA_DEPTH}")
    left[0] -= len(value)
    if left[0] < 0:
        raise KvEventError(f"{where}: extra_keys[{j}] holds more than {MAX_EXTRA_ITEMS} values")
    out: list[Any] = []
    for item in value:
        if isinstance(item, list):
            out.append(_freeze(where, j, item, depth + 1, left))
        elif item is None or isinstance(item, str | bytes | int | float):
            out.append(item)
        else:
            raise KvEventError(f"{where}: extra_keys[{j}] holds a {_kind(item)}")
    return tuple(out)


def _opt_int(where: str, fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None or _is_int(value):
        return value
    raise KvEventError(f"{where}: {name} is a {_kind(value)}, not an int or nil")


def _opt_str(where: str, fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise KvEventError(f"{where}: {name} is a {_kind(value)}, not a string or nil")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """A msgpack value's kind, in msgpack's words."""
    if value is None:
        return "nil"
    kinds = {bool: "boolean", int: "int", float: "float", str: "string", bytes: "binary"}
    kinds |= {list: "array", dict: "map", msgpack.ExtType: "extension"}
    return kinds.get(type(value), type(value).__name__)
