"""The mock engine's model of an engine scheduler: a paged prefix cache and FIFO admission.

Pure: no trio, no sockets, no clock of its own (times are passed in), so that the
decisions can be tested exhaustively. The mock engine (llmgw_mock_engine.engine) sleeps
for the times decided here.

The model, and where it follows vLLM (v1, automatic prefix caching):

- A prompt is a sequence of tokens: the words of a canonical rendering of the chat
  messages or of the completion prompt (`prompt_tokens`); no real tokenizer.
- The KV cache is `kv_blocks` blocks of `block_size` tokens. A full block is known by a
  chained hash (its tokens and the hash of the block before it), so equal hashes mean
  equal prefixes and a prompt matches the cache block by block from its start, as far
  as the chain goes. At least one prompt token is always computed, as in vLLM.
- Blocks referenced by a running sequence are never evicted. A finished sequence's
  hashed blocks stay cached, unreferenced, in least-recently-used order (its last block
  first, as vLLM frees them), and are evicted only when fresh blocks are needed.
- A running sequence reserves the blocks of its whole prompt and answer when it is
  admitted (vLLM allocates as it goes and preempts when it runs out: reserving up front
  means this model never preempts). The prompt's full blocks become reusable once its
  prefill is done, the answer's when it finishes (the next turn of a conversation then
  finds its previous answer cached, as with vLLM).
- At most `max_seqs` sequences run at once; the rest wait in arrival order (FIFO), and
  a head that does not fit the free blocks holds back those behind it (vLLM's FCFS).
- Prefill is compute-bound, so the engine's prefill rate is shared: admitted sequences
  prefill one after another, each taking (uncached prompt tokens) / `prefill_tps`.
  Time to first token = waiting for a slot + waiting for the prefill of the sequences
  admitted before + its own uncached prefill.
- Decode is memory-bound and batched: each running sequence produces its tokens at
  `decode_tps` on its own, whatever the batch size (up to `max_seqs`).
- Prefix-cache queries and hits are counted in tokens when a sequence is admitted, as
  vLLM's `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`.
- A LoRA adapter's blocks are its own: its name is part of each block's hash, as vLLM
  puts it in the block's extra keys, so an adapter never hits its base's blocks.

With `record_events`, the cache records what it did, as vLLM's block pool queues its
KV-cache events: full blocks made reusable (`StoredBlocks`: their hashes, their parent's,
their tokens), evicted blocks (`RemovedBlocks`, one event per block as vLLM), and a reset
(`CacheCleared`), in order, until `Scheduler.take_events` drains them (the mock engine
does after each call, and publishes what one call produced as one batch). Without it,
nothing is recorded.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs


def prompt_tokens(body: dict[str, Any]) -> list[str]:
    """The prompt's tokens: the words of a canonical rendering of the request.

    Chat messages render as `<|role|>` followed by the content's words, then the
    generation prompt `<|assistant|>`, so that a conversation's next turn starts with
    the previous prompt and answer token for token, as with a real chat template.
    Content that is not a string (parts, tool calls) renders as its JSON.
    """
    if "messages" in body:
        tokens: list[str] = []
        messages = body["messages"]
        for message in messages if isinstance(messages, list) else [messages]:
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else message
            tokens.append(f"<|{role if isinstance(role, str) else 'unknown'}|>")
            tokens.extend((content if isinstance(content, str) else json.dumps(content)).split())
        tokens.append("<|assistant|>")
        return tokens
    prompt = body.get("prompt", "")
    return (prompt if isinstance(prompt, str) else json.dumps(prompt)).split()


def block_hashes(tokens: Sequence[str], block_size: int, lora: str | None = None) -> list[int]:
    """The chained hash of each full block of `tokens`, from the start; a LoRA adapter's
    name is hashed into each of its blocks."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hash((parent, block) if lora is None else (parent, block, lora))
        hashes.append(parent)
    return hashes


@attrs.frozen
class StoredBlocks:
    """Full blocks made reusable, a chain: `hashes` in order, `parent` the hash of the
    block before the first (None at the prompt's start), `tokens` every token of them
    (`len(hashes) * block_size`), `lora` the adapter whose blocks they are."""

    hashes: tuple[int, ...]
    parent: int | None
    tokens: tuple[str, ...]
    lora: str | None = None


@attrs.frozen
class RemovedBlocks:
    """Cached blocks evicted to make room."""

    hashes: tuple[int, ...]


@attrs.frozen
class CacheCleared:
    """Every cached block dropped (a reset)."""


CacheEvent: TypeAlias = StoredBlocks | RemovedBlocks | CacheCleared


@attrs.define
class BlockCache:
    """A fixed pool of KV blocks with prefix reuse and LRU eviction.

    Every block is in one of three states: in use by running sequences (hashed and
    shared, or anonymous: fresh, partly filled, or a duplicate of a cached block),
    cached but unreferenced (evictable, least recently used first), or empty.
    """

    capacity: int
    _held: dict[int, int] = attrs.field(init=False, factory=dict)  # hash -> references
    _free: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict)
    anonymous: int = attrs.field(init=False, default=0)
    evictions: int = attrs.field(init=False, default=0)
    # What it did, in order, when recording (None: not recording).
    events: list[CacheEvent] | None = attrs.field(default=None, kw_only=True)

    @property
    def used(self) -> int:
        """Blocks referenced by running sequences."""
        return len(self._held) + self.anonymous

    @property
    def cached(self) -> int:
        """Blocks with a reusable hash, referenced or not."""
        return len(self._held) + len(self._free)

    @property
    def free_blocks(self) -> int:
        """Blocks a new sequence could take: the empty ones and the evictable ones."""
        return self.capacity - self.used

    def contains(self, block: int) -> bool:
        return block in self._held or block in self._free

    def evictable(self) -> list[int]:
        """The unreferenced cached blocks, the next to be evicted first."""
        return list(self._free)

    def match(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, are cached."""
        count = 0
        for block in hashes:
            if block not in self._held and block not in self._free:
                break
            count += 1
        return count

    def fits(self, hits: Sequence[int], fresh: int) -> bool:
        reclaimed = sum(1 for block in hits if block in self._free)
        return fresh <= self.free_blocks - reclaimed

    def acquire(self, hits: Sequence[int], fresh: int) -> None:
        """Reference the cached blocks `hits` and take `fresh` anonymous blocks,
        evicting the least recently used unreferenced ones as needed."""
        if any(not self.contains(block) for block in hits):
            raise ValueError("a hit block is not cached")
        if fresh < 0 or not self.fits(hits, fresh):
            raise ValueError(f"{fresh} fresh blocks do not fit in {self.free_blocks} free")
        for block in hits:
            if block in self._free:
                del self._free[block]
                self._held[block] = 1
            else:
                self._held[block] += 1
        empty = self.capacity - self.used - len(self._free)
        for _ in range(max(0, fresh - empty)):
            evicted, _ = self._free.popitem(last=False)
            self.evictions += 1
            if self.events is not None:
                self.events.append(RemovedBlocks((evicted,)))
        self.anonymous += fresh

    def commit(self, block: int) -> bool:
        """An anonymous block now holds the tokens hashed `block`: make it reusable.

        False when that hash is cached already (another sequence computed the same
        prefix): the block stays anonymous and is freed with its sequence.
        """
        if self.anonymous <= 0:
            raise ValueError("no anonymous block to commit")
        if self.contains(block):
            return False
        self.anonymous -= 1
        self._held[block] = 1
        return True

    def release(self, hashes: Sequence[int], anonymous: int) -> None:
        """A sequence lets go of its blocks (`hashes` in block order)."""
        if anonymous < 0 or anonymous > self.anonymous:
            raise ValueError(f"releasing {anonymous} anonymous blocks of {self.anonymous}")
        if any(block not in self._held for block in hashes):
            raise ValueError("releasing a block that is not referenced")
        self.anonymous -= anonymous
        for block in reversed(hashes):  # the tail first: it is evicted before the head
            self._held[block] -= 1
            if self._held[block] == 0:
                del self._held[block]
                self._free[block] = None


@attrs.frozen
class EngineModel:
    """The parameters of the model (the mock engine's --mock-* flags)."""

    kv_blocks: int
    block_size: int = 16
    prefill_tps: float = 8000.0  # prompt tokens per second, shared by the engine
    decode_tps: float = 50.0  # output tokens per second, for each running sequence
    max_seqs: int = 16

    def __attrs_post_init__(self) -> None:
        if self.kv_blocks < 1 or self.block_size < 1 or self.max_seqs < 1:
            raise ValueError("kv_blocks, block_size and max_seqs must be at least 1")
        if not (self.prefill_tps > 0 and math.isfinite(self.prefill_tps)):
            raise ValueError("prefill_tps must be a positive number")
        if not (self.decode_tps >= 0 and math.isfinite(self.decode_tps)):
            raise ValueError("decode_tps must be zero or a positive number")

    @property
    def max_tokens(self) -> int:
        """The longest prompt plus answer that fits the cache."""
        return self.kv_blocks * self.block_size


class PromptTooLong(ValueError):
    pass


@attrs.frozen
class Admission:
    """A sequence starts running: its prefill ends (its first token) at `first_token_at`."""

    seq_id: int
    admitted_at: float
    cached_tokens: int
    prefill_tokens: int
    first_token_at: float


@attrs.define
class _Sequence:
    seq_id: int
    tokens: Sequence[str]
    output_tokens: int
    hashes: list[int]
    lora: str | None
    # Once running: for each block of prompt + answer, the hash it holds or None.
    blocks: list[int | None] = attrs.field(factory=list)


@attrs.define
class Scheduler:
    model: EngineModel
    record_events: bool = attrs.field(default=False, kw_only=True)
    cache: BlockCache = attrs.field(init=False)
    _waiting: deque[_Sequence] = attrs.field(init=False, factory=deque)
    _running: dict[int, _Sequence] = attrs.field(init=False, factory=dict)
    prefill_free_at: float = attrs.field(init=False, default=-math.inf)
    queried_tokens: int = attrs.field(init=False, default=0)
    hit_tokens: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.cache = BlockCache(self.model.kv_blocks, events=[] if self.record_events else None)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.cache.used / self.cache.capacity

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.model.block_size)

    def take_events(self) -> list[CacheEvent]:
        """What the cache did since the last call, in order (nothing unless recording)."""
        events = self.cache.events
        if not events:
            return []
        self.cache.events = []
        return events

    def reset(self) -> None:
        """Start afresh, as a new scheduler (nothing may be scheduled): every cached block
        dropped (`CacheCleared` recorded after what is still undrained), counters zeroed."""
        if self._running or self._waiting:
            raise ValueError("sequences are still scheduled")
        events = self.cache.events
        self.cache = BlockCache(self.model.kv_blocks, events=events)
        self.prefill_free_at = -math.inf
        self.queried_tokens = self.hit_tokens = 0
        if events is not None:
            events.append(CacheCleared())

    def submit(
        self,
        seq_id: int,
        tokens: Sequence[str],
        output_tokens: int,
        now: float,
        lora: str | None = None,
    ) -> list[Admission]:
        """A new request joins the queue (`lora`: the adapter it names); returns the
        sequences admitted now."""
        if seq_id in self._running or any(s.seq_id == seq_id for s in self._waiting):
            raise ValueError(f"sequence {seq_id} is already scheduled")
        total = len(tokens) + output_tokens
        if not tokens or output_tokens < 0:
            raise ValueError("a sequence needs a prompt and a non-negative answer length")
        if self.blocks_for(total) > self.model.kv_blocks:
            raise PromptTooLong(
                f"This model's maximum context length is {self.model.max_tokens} tokens. "
                f"However, you requested {total} tokens ({len(tokens)} in the messages, "
                f"{output_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        hashes = block_hashes(tokens, self.model.block_size, lora)
        self._waiting.append(_Sequence(seq_id, tokens, output_tokens, hashes, lora))
        return self._schedule(now)

    def prefilled(self, seq_id: int) -> None:
        """The sequence's prefill is done: its prompt's full blocks become reusable."""
        seq = self._running[seq_id]
        stored = []
        for index, block in enumerate(seq.hashes):
            if seq.blocks[index] is None and self.cache.commit(block):
                seq.blocks[index] = block
                stored.append(index)
        self._record_stored(seq, seq.tokens, seq.hashes, stored)

    def finish(self, seq_id: int, output: Sequence[str], now: float) -> list[Admission]:
        """The sequence leaves (finished with `output`, or gone before that, waiting or
        running); returns the sequences admitted in its place."""
        for waiting in self._waiting:
            if waiting.seq_id == seq_id:
                self._waiting.remove(waiting)
                return self._schedule(now)
        seq = self._running.pop(seq_id)
        if output:
            size = self.model.block_size
            tokens = [*seq.tokens, *output]
            full = block_hashes(tokens, size, seq.lora)
            stored = []
            # From the prompt's first block: one that was a copy of a cached block (left
            # anonymous at its prefill) is committed now if that block was evicted since,
            # so that the answer's blocks hang from a chain the cache holds, as vLLM's
            # (whose request keeps its own copy) do.
            for index in range(min(len(full), len(seq.blocks))):
                if seq.blocks[index] is None and self.cache.commit(full[index]):
                    seq.blocks[index] = full[index]
                    stored.append(index)
            self._record_stored(seq, tokens, full, stored)
        held = [block for block in seq.blocks if block is not None]
        self.cache.release(held, len(seq.blocks) - len(held))
        return self._schedule(now)

    def _record_stored(
        self, seq: _Sequence, tokens: Sequence[str], hashes: Sequence[int], stored: list[int]
    ) -> None:
        """Record the blocks `stored` (indexes into `hashes`, ascending) as one chain per
        run of consecutive blocks."""
        events = self.cache.events
        if events is None or not stored:
            return
        size = self.model.block_size
        start = 0
        for i in range(1, len(stored) + 1):
            if i < len(stored) and stored[i] == stored[i - 1] + 1:
                continue
            first, last = stored[start], stored[i - 1]
            events.append(
                StoredBlocks(
                    hashes=tuple(hashes[first : last + 1]),
                    parent=hashes[first - 1] if first else None,
                    tokens=tuple(tokens[first * size : (last + 1) * size]),
                    lora=seq.lora,
                )
            )
            start = i

    def _schedule(self, now: float) -> list[Admission]:
        admitted: list[Admission] = []
        model = self.model
        while self._waiting and len(self._running) < model.max_seqs:
            seq = self._waiting[0]
            # At least one token is computed, so a whole cached prompt still prefills one.
            limit = (len(seq.tokens) - 1) // model.block_size
            hits = seq.hashes[: self.cache.match(seq.hashes[:limit])]
            fresh = self.blocks_for(len(seq.tokens) + seq.output_tokens) - len(hits)
            if not self.cache.fits(hits, fresh):
                break  # first come, first served: nobody overtakes the head
            self._waiting.popleft()
            self.cache.acquire(hits, fresh)
            seq.blocks = [*hits, *([None] * fresh)]
            self._running[seq.seq_id] = seq
            cached = len(hits) * model.block_size
            prefill = len(seq.tokens) - cached
            self.queried_tokens += len(seq.tokens)
            self.hit_tokens += cached
            start = max(now, self.prefill_free_at)
            self.prefill_free_at = start + prefill / model.prefill_tps
            admitted.append(Admission(seq.seq_id, now, cached, prefill, self.prefill_free_at))
        return admitted
