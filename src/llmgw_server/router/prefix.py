"""Prompt prefixes without a tokenizer, and what each replica has been sent.

A prompt is rendered to a canonical text (UTF-8): for chat, the `tools` (JSON, sorted
keys) and then each message as its role, its content and its tool calls, each message
closed by a separator, so that a conversation's next prompt starts with the bytes of the
previous one; for completions, the prompt itself. The text is cut every `block_bytes`
bytes and at the end of every message and of the prompt, and each cut gets the hash of
the whole text before it: CRC-32 and Adler-32 carried from cut to cut (one pass over the
bytes in C, the same in every process). Only the first `MAX_BLOCKS` blocks are hashed.
The hashes start from the hash of the request's `model` rather than of no text: a LoRA
adapter is served by its base model's replicas (one balancer, one index per replica),
and its prompts share no cached prefix with the base's (vLLM's block hashes include the
adapter: vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`).

The anchor is the cut that names a conversation: for chat, the end of its first message
that is not a system (or developer) message, which stays the same on every turn; for
completions, the first `ANCHOR_BLOCKS` blocks (or the whole prompt when shorter).

A `PrefixIndex` holds the cuts sent to one replica, newest last, as an LRU bounded in
entries, and forgets any older than its TTL, as the engine's cache would evict them. A
prompt's cuts are recorded deepest first, so a shorter prefix is never older than a longer
one and "holds the first d cuts" is monotone in d (found by bisection). Where each prompt
ended is kept too, under the last block boundary before its end (offset and hash): a
request that holds that boundary, is longer, and has the same hash at that offset
continues the earlier prompt (the next turn of a conversation, chat or completion),
where one that only shares a system prompt or header does not. The index answers
`depth`, `continues` and `record`, so an index fed by the engine's own KV-cache events
could stand in for it.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

MAX_BLOCKS = 512  # 128 KiB at the default block: enough to tell prompts apart, bounded cost
ANCHOR_BLOCKS = 4  # a completion prompt's anchor: its first 4 blocks
_EMPTY = 1  # the hash of no text: CRC-32 0, Adler-32 1
_MASK64 = (1 << 64) - 1
_SYSTEM_ROLES = frozenset({"system", "developer"})


@attrs.frozen(slots=True)
class PromptKey:
    """A prompt's cuts: the hash of the text before each cut, and where each cut falls."""

    chain: tuple[int, ...]  # cumulative hashes, shortest prefix first; never empty
    ends: tuple[int, ...]  # the byte offset of each cut, ascending
    anchor: int  # the index of the anchor's cut in `chain`
    block: int  # the block size it was cut with
    text: bytes = attrs.field(repr=False, eq=False)  # the canonical text, up to `size`
    origin: int = _EMPTY  # the hash the chain starts from: the model's (`model_origin`)
    # The prompt's token ids as its engine tokenizes it, where a policy reads them
    # (precise; set by the router after asking the engine), and the LoRA adapter named.
    # An array of uint32 from the tokenizer's cache, shared: never modified.
    tokens: Sequence[int] | None = attrs.field(default=None, eq=False, repr=False)
    lora: str | None = None

    def base(self, depth: int) -> tuple[int, int]:
        """The offset and hash of the last block boundary among the first `depth` cuts."""
        ends, block = self.ends, self.block
        for i in range(depth - 1, -1, -1):
            if ends[i] % block == 0:
                return ends[i], self.chain[i]
        return 0, self.origin

    def hash_at(self, offset: int, base: tuple[int, int]) -> int:
        """The hash of the text before `offset`, carried on from a boundary before it."""
        start, h = base
        piece = memoryview(self.text)[start:offset]
        return zlib.crc32(piece, h >> 32) << 32 | zlib.adler32(piece, h & 0xFFFFFFFF)

    @property
    def anchor_hash(self) -> int:
        return self.chain[self.anchor]

    @property
    def size(self) -> int:
        """The bytes hashed (the prompt's canonical text, up to MAX_BLOCKS blocks)."""
        return self.ends[-1]


def prompt_key(body: dict[str, Any], chat: bool, block_bytes: int) -> PromptKey | None:
    """The key of a chat or completion request's prompt; None when it has no text."""
    if chat:
        text, marks, anchor_at = _render_chat(body.get("messages"), body.get("tools"))
    else:
        text = _render_prompt(body.get("prompt"))
        marks = []
        anchor_at = ANCHOR_BLOCKS * block_bytes
    limit = min(len(text), MAX_BLOCKS * block_bytes)
    if not limit:
        return None
    cuts = set(range(block_bytes, limit + 1, block_bytes))
    cuts.update(m for m in marks if m <= limit)
    cuts.add(limit)
    ends = sorted(cuts)
    data = memoryview(text)
    origin = model_origin(body.get("model"))
    crc, adler, start = origin >> 32, origin & 0xFFFFFFFF, 0
    chain = []
    for end in ends:
        piece = data[start:end]
        crc = zlib.crc32(piece, crc)
        adler = zlib.adler32(piece, adler)
        chain.append(crc << 32 | adler)
        start = end
    anchor_at = min(anchor_at, limit)
    anchor = next(i for i, end in enumerate(ends) if end >= anchor_at)
    return PromptKey(
        chain=tuple(chain),
        ends=tuple(ends),
        anchor=anchor,
        block=block_bytes,
        text=text,
        origin=origin,
    )


def model_origin(model: object) -> int:
    """The hash a prompt's chain starts from: that of the model's name and a separator
    (of no text for a request without one), so that no two models share a prefix."""
    if not isinstance(model, str):
        return _EMPTY
    name = _encode(model + "\x1e")
    return zlib.crc32(name) << 32 | zlib.adler32(name)


def _render_chat(messages: object, tools: object) -> tuple[bytes, list[int], int]:
    """The canonical text, the offset where each message ends, and the anchor's offset."""
    parts: list[bytes] = []
    marks: list[int] = []
    size = 0
    anchor_at = -1
    if tools is not None:
        parts.append(_encode(_json(tools) + "\x1e"))
        size += len(parts[-1])
        marks.append(size)
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict):
            role = message.get("role")
            role = role if isinstance(role, str) else None
            content = message.get("content")
            text = f"{role}\x1f{_content(content)}"
            if message.get("tool_calls") is not None:
                text += "\x1f" + _json(message["tool_calls"])
            if message.get("name") is not None:
                text += "\x1f" + str(message["name"])
        else:
            role = None
            text = _json(message)
        parts.append(_encode(text + "\x1e"))
        size += len(parts[-1])
        marks.append(size)
        if anchor_at < 0 and role not in _SYSTEM_ROLES:
            anchor_at = size
    return b"".join(parts), marks, size if anchor_at < 0 else anchor_at


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        return "\x1d".join(
            p["text"]
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            else _json(p)
            for p in content
        )
    return _json(content)


def _render_prompt(prompt: object) -> bytes:
    if isinstance(prompt, str):
        return _encode(prompt)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return _encode("\x1e".join(prompt))
    return b"" if prompt is None else _encode(_json(prompt))


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _encode(text: str) -> bytes:
    # A JSON body may hold lone surrogates ("\ud800"): hashed as they are, never an error.
    return text.encode("utf-8", "surrogatepass")


class PrefixIndex:
    """The prompt prefixes recently sent to one replica: at most `capacity` entries."""

    __slots__ = ("_anchors", "_ends", "_seen", "capacity", "ttl_s")

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._seen: OrderedDict[int, float] = OrderedDict()  # hash -> when last sent
        self._anchors: OrderedDict[int, float] = OrderedDict()  # the conversations sent here
        # A block boundary's hash -> when, and where and with what hash a prompt ended after it.
        self._ends: OrderedDict[int, tuple[float, int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def _held(self, h: int, now: float) -> bool:
        at = self._seen.get(h)
        return at is not None and now - at <= self.ttl_s

    def depth(self, key: PromptKey, now: float) -> int:
        """How many of the prompt's cuts, from the start, this replica holds."""
        lo, hi = 0, len(key.chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._held(key.chain[mid - 1], now):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def continues(self, key: PromptKey, depth: int, now: float) -> bool:
        """Whether a whole prompt sent here before is a prefix of this longer one."""
        base = key.base(depth)
        marked = self._ends.get(base[1])
        if marked is None:
            return False
        at, end, end_hash = marked
        return (
            now - at <= self.ttl_s
            and base[0] <= end < key.size
            and key.hash_at(end, base) == end_hash
        )

    def conversations(self, now: float) -> int:
        """How many conversations (anchors) were sent here within the TTL."""
        self._expire(self._anchors, now)
        return len(self._anchors)

    def record(self, key: PromptKey, now: float) -> None:
        seen = self._seen
        for h in reversed(key.chain):
            if h in seen:
                seen.move_to_end(h)
            seen[h] = now
        _touch(self._anchors, key.anchor_hash, now)
        # Under the last block boundary up to the end, which every longer prompt holds.
        _touch(self._ends, key.base(len(key.chain))[1], (now, key.size, key.chain[-1]))
        for entries in (seen, self._anchors):
            while len(entries) > self.capacity:
                entries.popitem(last=False)
            self._expire(entries, now)
        ends = self._ends
        while len(ends) > self.capacity:
            ends.popitem(last=False)
        while ends and now - next(iter(ends.values()))[0] > self.ttl_s:
            ends.popitem(last=False)

    def _expire(self, entries: OrderedDict[int, float], now: float) -> None:
        while entries:
            oldest, at = next(iter(entries.items()))
            if now - at <= self.ttl_s:
                return
            del entries[oldest]

    def clear(self) -> None:
        self._seen.clear()
        self._anchors.clear()
        self._ends.clear()


def _touch(entries: OrderedDict[int, Any], key: int, value: Any) -> None:
    if key in entries:
        entries.move_to_end(key)
    entries[key] = value


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (unlike `hash`)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: int, replica: int) -> int:
    """The replica's score for a key: the highest wins, the same in every router process.

    SplitMix64's finaliser over the pair, so that nearby keys give unrelated orders.
    """
    x = (key ^ replica) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
