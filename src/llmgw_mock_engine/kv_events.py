"""vLLM's KV-cache events as the mock engine publishes them: its config and wire format.

Pure (no sockets): `KvEventsConfig.parse` reads vLLM's `--kv-events-config` JSON,
`encode_batch` turns what the scheduler model recorded in one step
(llmgw_mock_engine.scheduler's `StoredBlocks`, `RemovedBlocks`, `CacheCleared`) into the
msgpack payload vLLM's `ZmqEventPublisher` sends; llmgw_mock_engine.kv_publisher sends it.

Checked against vLLM 0.32.0's own source (vllm/distributed/kv_events.py,
vllm/config/kv_events.py, vllm/v1/core/block_pool.py):

- The config is a pydantic dataclass that forbids unknown keys: `enable_kv_cache_events`
  (false), `publisher` ("null" or "zmq"; unset: "zmq" when enabled), `endpoint`
  ("tcp://*:5557"), `replay_endpoint` (none), `buffer_steps` (10,000), `hwm` (100,000),
  `max_queue_size` (100,000), `topic` ("").
- The payload is `EventBatch(array_like=True)`: `[ts, events, data_parallel_rank]`, ts
  from time.time(), the rank 0 without data parallelism. Each event is a msgspec struct
  with `tag=True, omit_defaults=True`: a map whose first key `"type"` holds the class name
  (0.32.0; "map"), or, in the versions before, with `array_like=True` too, the positional
  `[tag, field1, field2, ...]` ("array"), a trailing field at its default left off.
- `BlockStored` fields in order: block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name (always sent: no defaults), then extra_keys, group_idx,
  kv_cache_spec_kind, kv_cache_spec_sliding_window, ... (defaults None, omitted when None).
  vLLM's block pool fills extra_keys with one entry per block: None, or the LoRA adapter's
  name first (`(lora_name,)` for a text prompt); group_idx is the KV-cache group (0 for a
  plain attention model), and the KV-cache manager adds kv_cache_spec_kind
  ("full_attention"). `BlockRemoved`: block_hashes, medium, group_idx, one block each.

The mock's token ids: the scheduler's tokens are words; `token_id` gives each a stable
31-bit id (CRC-32 of its UTF-8, the top bit cleared), the same in every process, so the
events' token_ids and the engine's `/tokenize` agree. Two words may share an id (CRC-32
collides at about 1 in 2**31 per pair): then a router's index takes them for the same
token where the mock's cache (hashed on words) does not. Block hashes are the scheduler's
own chained hashes (Python's hash of the words, seeded per process like vLLM's unseeded
ones) masked to unsigned 64 bits.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs
import msgpack

from llmgw_mock_engine.options import ENCODINGS
from llmgw_mock_engine.scheduler import CacheCleared, CacheEvent, RemovedBlocks, StoredBlocks

MEDIUM: Final = "GPU"
SPEC_KIND: Final = "full_attention"
_UINT64: Final = (1 << 64) - 1
_TOKEN_MASK: Final = 0x7FFF_FFFF

# vLLM's KVEventsConfig fields and defaults (vllm/config/kv_events.py, 0.32.0).
_DEFAULTS: Final[Mapping[str, Any]] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
_SCHEMES: Final = ("tcp://", "ipc://")


def token_id(word: str) -> int:
    """The mock's token id of one of its tokens (a word): stable across processes."""
    return zlib.crc32(word.encode("utf-8", "surrogatepass")) & _TOKEN_MASK


def token_ids(words: Iterable[str]) -> list[int]:
    crc = zlib.crc32
    return [crc(w.encode("utf-8", "surrogatepass")) & _TOKEN_MASK for w in words]


def engine_hash(block: int) -> int:
    """The scheduler's block hash as the events carry it: unsigned 64 bits."""
    return block & _UINT64


@attrs.frozen
class KvEventsConfig:
    """vLLM's `--kv-events-config`, read as vLLM reads it (unknown keys refused)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000  # the PUB socket's send high-water mark, in messages (0: none)
    max_queue_size: int = 100_000  # accepted; the mock sends at once, it queues nothing
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """vLLM's rule for the PUB socket: bind a wildcard (`*`, `::`) or an ipc:// or
        inproc:// endpoint, connect to any other (the subscriber binds there). The replay
        socket always binds."""
        e = self.endpoint
        return "*" in e or "::" in e or e.startswith(("ipc://", "inproc://"))

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig:
        """The config in `text` (vLLM's JSON); ValueError says what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, not {text!r}")
        unknown = sorted(set(raw) - set(_DEFAULTS))
        if unknown:
            raise ValueError(
                f"--kv-events-config has unknown keys {', '.join(unknown)} (vLLM refuses "
                f"them too; its keys: {', '.join(_DEFAULTS)})"
            )
        values = {**_DEFAULTS, **raw}
        enable = values["enable_kv_cache_events"]
        if not isinstance(enable, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        publisher = values["publisher"]
        if publisher is None:
            publisher = "zmq" if enable else "null"
        if publisher not in ("null", "zmq"):
            raise ValueError(
                f'--kv-events-config: publisher must be "zmq" or "null", not {publisher!r}'
            )
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = values[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"--kv-events-config: {key} must be a whole number, 0 or more, not {value!r}"
                )
        if not isinstance(values["topic"], str):
            raise ValueError("--kv-events-config: topic must be a string")
        config = cls(
            enable_kv_cache_events=enable,
            publisher=publisher,
            endpoint=values["endpoint"],
            replay_endpoint=values["replay_endpoint"],
            buffer_steps=values["buffer_steps"],
            hwm=values["hwm"],
            max_queue_size=values["max_queue_size"],
            topic=values["topic"],
        )
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(config, key)
            if value is None and key == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(_SCHEMES):
                raise ValueError(
                    f"--kv-events-config: {key} must be a tcp:// or ipc:// address (another "
                    f"process has to reach it), not {value!r}"
                )
        return config


@attrs.frozen
class BatchEncoder:
    """Encodes one step's events as vLLM's publisher does (see the module's text)."""

    block_size: int
    encoding: str = "map"
    # LoRA adapters in --lora-modules order: vLLM numbers them from 1 (lora_id).
    adapters: Sequence[str] = ()

    def __attrs_post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"the encoding must be map or array, not {self.encoding!r}")

    def encode(self, events: Sequence[CacheEvent], ts: float) -> bytes:
        array = self.encoding == "array"
        wire = [self._stored(e, array) if isinstance(e, StoredBlocks) else
                self._removed(e, array) if isinstance(e, RemovedBlocks) else
                self._cleared(e, array) for e in events]  # fmt: skip
        payload: bytes = msgpack.packb([ts, wire, 0], use_bin_type=True)
        return payload

    def _stored(self, event: StoredBlocks, array: bool) -> Any:
        lora = event.lora
        lora_id = self.adapters.index(lora) + 1 if lora in self.adapters else None
        hashes = [engine_hash(h) for h in event.hashes]
        parent = engine_hash(event.parent) if event.parent is not None else None
        extra = [None if lora is None else (lora,)] * len(hashes)
        tokens = token_ids(event.tokens)
        if array:
            return ["BlockStored", hashes, parent, tokens, self.block_size, lora_id, MEDIUM,
                    lora, extra, 0, SPEC_KIND]  # fmt: skip
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": lora_id,
            "medium": MEDIUM,
            "lora_name": lora,
            "extra_keys": extra,
            "group_idx": 0,
            "kv_cache_spec_kind": SPEC_KIND,
        }

    def _removed(self, event: RemovedBlocks, array: bool) -> Any:
        hashes = [engine_hash(h) for h in event.hashes]
        if array:
            return ["BlockRemoved", hashes, MEDIUM, 0]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0}

    def _cleared(self, event: CacheCleared, array: bool) -> Any:
        return ["AllBlocksCleared"] if array else {"type": "AllBlocksCleared"}
