"""Which replica holds which KV-cache blocks, from the engines' own KV-cache events.

The router names a block by its own chained hash, never by the engine's: vLLM's block
hashes are seeded per process (unless PYTHONHASHSEED is set), so two replicas holding the
same tokens report different hashes. A block's own hash is BLAKE2b-64 (read as a
little-endian int) over the digest of its extra key (8 bytes), its parent's own hash
(8 bytes, little-endian; `ROOT` at a chain's start) and its token ids (little-endian
uint32s). The extra key is the LoRA adapter's name and what else the engine keyed the
block by (`extra_keys`: multimodal identifiers, a cache salt, prompt-embedding digests).
The same in every process, like `prefix.stable_hash`. A request's blocks hash
the same way (`block_chain`), with its LoRA name and nothing else, so a block keyed by an
image or a cache salt is held but never matched by a text request, as the engine would
not reuse it for one either.

Per replica the index keeps the engine's hash of each block it reported (by medium:
GPU, CPU, ...) mapped to the block's own hash, so that `BlockRemoved`, which names the
engine's hash alone, finds it; a block is held while any medium holds it. A `BlockStored`
whose parent the index does not know (a chain whose start it never saw: events missed,
evicted here, or the router started late) cannot be placed: its blocks are dropped and
counted. One replica's events never touch another's entries.

Sequence numbers are tracked per replica. The next number applies the batch; a number
past it is a gap: the batch is buffered, the result says `replay_from` (the first missed
number, for the shell to ask the engine's replay socket), replayed batches fill the hole
and the buffered ones follow in order. A replay that cannot fill it (it starts past the
hole, `replay_done` comes first, or the buffer fills: `MAX_PENDING_BATCHES`,
`MAX_PENDING_TOKENS`) clears the replica and applies what was buffered: what was missed
may have removed anything. A live number below the last is the engine restarting: the
replica is cleared. `AllBlocksCleared` clears it too.

A replica whose events name more than one KV-cache group (`group_idx`) serves a hybrid
model (sliding-window or Mamba layers beside full attention): a prefix hit needs every
group to hold it, which this index does not model, so the replica is marked unusable for
precise routing (sticky until `forget`) and its entries are dropped.

`speculate` marks a routed request's blocks as held for `speculative_ttl_s` (2 s, as
llm-d), until the engine's events confirm them or the time passes; `lookup` does not count
an expired speculative entry.

Bounds: at most `max_blocks_per_replica` entries per replica (default 200,000) and
`max_blocks` in all (default 1,000,000), speculative ones included; past either the least
recently stored-or-looked-up entry goes first (from the replica holding the most, for the
total). A request's blocks are touched deepest first, so a chain's start is never older
than its end and eviction cuts chains from their tails. Memory: 180 to 230 bytes per
block held in one medium with 64-bit engine hashes, as the dicts grow in steps (the two
dict entries and the two ints, no object per block; tracemalloc: 176 at 20,000 blocks,
230 at 200,000, 205 at 1,000,000; tests/test_kv_index.py), so the defaults bound the index
near 230 MB, 46 MB per replica.

`lookup` is the router's hot path: for a 100k-token prompt every block of which a replica
holds, about 4 ms at block size 16 (6,250 blocks) and 1.5 ms at 128 on this project's
machine, nearly all of it hashing; a prompt that misses at its first block costs a few
microseconds (its tokens are converted a few blocks at a time).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections import Counter, OrderedDict, deque
from collections.abc import Generator, Iterator, Sequence
from typing import Final, TypeAlias, TypeVar

import attrs

from llmgw_core.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    ExtraKey,
    KvBatch,
)

MAX_BLOCKS_PER_REPLICA: Final = 200_000
MAX_BLOCKS: Final = 1_000_000
SPECULATIVE_TTL_S: Final = 2.0
MAX_PENDING_BATCHES: Final = 256  # batches buffered behind a gap
MAX_PENDING_TOKENS: Final = 1 << 21  # their token ids (4 bytes each as decoded)
ROOT: Final = 0  # the parent's own hash a chain's first block is hashed with
# Blocks hashed, dropped or evicted between two yields of `apply_steps`: about 2.5 ms of
# the loop on this project's machine (a block stored costs about 1.2 us).
SLICE_BLOCKS: Final = 2048

# A request's tokens are converted to bytes a chunk at a time, 4 blocks first and twice as
# many each time up to 64, so that a prefix that misses early costs little.
_FIRST_CHUNK_BLOCKS = 4
_CHUNK_BLOCKS = 64
_ROOT_BYTES = ROOT.to_bytes(8, "little")
_NO_EXTRA = bytes(8)  # the extra-key digest of a block with no LoRA and no extra keys
_DEFAULT_MEDIA = frozenset({None, "GPU"})
_BIG_ENDIAN = sys.byteorder == "big"
_blake2b = hashlib.blake2b

_T = TypeVar("_T")

# The engine's name for a block: its hash on the GPU, (medium, hash) elsewhere.
EngineKey: TypeAlias = BlockHash | tuple[str, BlockHash]


def block_chain(token_ids: Sequence[int], block_size: int, lora: str | None) -> tuple[int, ...]:
    """The own hash of each full block of a request's tokens, first block first."""
    return tuple(_chain(token_ids, block_size, extra_digest(lora)))


def extra_digest(lora: str | None, extra: ExtraKey = ()) -> bytes:
    """The 8 bytes a block's hash reads first: the digest of its LoRA adapter's name and
    the engine's other extra keys for it (8 zero bytes for neither)."""
    if lora is None and not extra:
        return _NO_EXTRA
    text = repr((lora, extra)).encode("utf-8", "surrogatepass")
    return _blake2b(text, digest_size=8).digest()


def _template(extra: bytes) -> hashlib.blake2b:
    """BLAKE2b-64 having read a block's extra-key digest: each block's hash is a copy of
    it fed the parent's hash and the block's tokens (copying beats a new hasher)."""
    template = _blake2b(digest_size=8)
    template.update(extra)
    return template


def _chain(token_ids: Sequence[int], block_size: int, extra: bytes) -> Iterator[int]:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _hash_chain(token_ids, block_size, _template(extra))


def _hash_chain(
    token_ids: Sequence[int], block_size: int, template: hashlib.blake2b
) -> Iterator[int]:
    end = len(token_ids) // block_size * block_size
    parent = _ROOT_BYTES
    start, blocks = 0, _FIRST_CHUNK_BLOCKS
    while start < end:
        stop = min(start + blocks * block_size, end)
        data = _tokens(token_ids, start, stop)
        for off in range(0, stop - start, block_size):
            h = template.copy()
            h.update(parent)
            h.update(data[off : off + block_size])
            parent = h.digest()
            yield int.from_bytes(parent, "little")
        start, blocks = stop, min(blocks * 2, _CHUNK_BLOCKS)


def _tokens(token_ids: Sequence[int], start: int, end: int) -> memoryview:
    """Token ids `start:end` as little-endian uint32s."""
    if isinstance(token_ids, array.array) and token_ids.typecode == "I" and not _BIG_ENDIAN:
        return memoryview(token_ids)[start:end]
    try:
        arr = array.array("I", token_ids[start:end])
    except (TypeError, OverflowError):
        raise ValueError("token ids must be ints from 0 to 2**32 - 1") from None
    if _BIG_ENDIAN:  # pragma: no cover - no such machine here
        arr.byteswap()
    return memoryview(arr)


@attrs.define(slots=True)
class ApplyResult:
    """What one `apply` (or `replay_done`) did to one replica's entries."""

    replica: str
    applied: int = 0  # batches applied: this one and any buffered ones it released
    stored: int = 0  # blocks stored
    removed: int = 0  # blocks removed
    orphaned: int = 0  # blocks dropped: their parent is unknown to the index
    malformed: int = (
        0  # events dropped: tokens not blocks x block_size, or extra keys not one a block
    )
    skipped: int = 0  # events of types the decoder does not know
    evicted: int = 0  # entries evicted for the caps
    cleared: bool = False  # the replica's entries were dropped
    restarted: bool = False  # the sequence went back: the engine restarted
    duplicate: bool = False  # a batch already applied or buffered: ignored
    buffered: bool = False  # held behind a gap until the replay fills it
    replay_from: int | None = None  # a gap opened: ask the replay socket from this number
    resynced: bool = False  # a gap the replay could not fill: cleared, buffered batches applied
    unusable: str | None = None  # why the replica cannot be routed by its events


# What the index keeps for a block, by its own hash: the engine's name for it, a list of
# names when more than one maps to it (media, a LoRA adapter re-pointed), or, while it is
# only speculative, the time until which it counts as held. No object per block.
_Held: TypeAlias = EngineKey | list[EngineKey] | float


@attrs.define(slots=True, eq=False)
class _Replica:
    blocks: OrderedDict[int, _Held] = attrs.Factory(OrderedDict)  # own hash, oldest first
    engine: dict[EngineKey, int] = attrs.Factory(dict)  # engine's name -> own hash
    speculated: deque[tuple[float, tuple[int, ...]]] = attrs.Factory(deque)
    last_seq: int | None = None
    batches: int = 0  # batches applied since the router started
    pending: dict[int, KvBatch] = attrs.Factory(dict)
    pending_tokens: int = 0
    awaiting: bool = False  # a gap is open: replay_from was reported
    group: int | None = None
    unusable: str | None = None
    block_size: int | None = None
    dropped: Counter[str] = attrs.Factory(Counter)  # messages dropped unapplied, by why


# What `apply_steps` and `replay_done_steps` yield between slices of their work.
Steps: TypeAlias = Generator[None, None, ApplyResult]


class KvIndex:
    """The blocks each replica holds, fed by its KV-cache events (see the module's text)."""

    def __init__(
        self,
        *,
        max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA,
        max_blocks: int = MAX_BLOCKS,
        speculative_ttl_s: float = SPECULATIVE_TTL_S,
        max_pending_batches: int = MAX_PENDING_BATCHES,
        max_pending_tokens: int = MAX_PENDING_TOKENS,
    ) -> None:
        if max_blocks_per_replica <= 0 or max_blocks <= 0:
            raise ValueError("the caps must be positive")
        self.max_blocks_per_replica = max_blocks_per_replica
        self.max_blocks = max_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self.max_pending_batches = max_pending_batches
        self.max_pending_tokens = max_pending_tokens
        self._replicas: dict[str, _Replica] = {}
        self._total = 0
        self._work = 0  # blocks handled since the last slice ended

    # -- what the shell asks ---------------------------------------------------------

    def __len__(self) -> int:
        """Entries held, all replicas, speculative ones included."""
        return self._total

    def held(self, replica: str) -> int:
        """Entries held for one replica, speculative ones included."""
        rep = self._replicas.get(replica)
        return len(rep.blocks) if rep is not None else 0

    def unusable(self, replica: str) -> str | None:
        """Why the replica's events cannot route it, or None."""
        rep = self._replicas.get(replica)
        return rep.unusable if rep is not None else None

    def batches(self, replica: str) -> int:
        """The replica's event batches applied (its engine's steps that changed its cache)."""
        rep = self._replicas.get(replica)
        return rep.batches if rep is not None else 0

    def last_seq(self, replica: str) -> int | None:
        rep = self._replicas.get(replica)
        return rep.last_seq if rep is not None else None

    def block_size(self, replica: str) -> int | None:
        """The block size of the replica's last stored blocks."""
        rep = self._replicas.get(replica)
        return rep.block_size if rep is not None else None

    def stale(self, replica: str, why: str, messages: int = 1) -> None:
        """Some of the replica's messages were dropped unapplied (`why`): what it holds is
        unknown, so it is cleared and its sequence forgotten; the next batch rebuilds it,
        as at a start without replay. Until one is applied `last_seq` is None, so the
        precise policy does not route it by its events."""
        rep = self._replica(replica)
        self._clear(rep)
        self._drop_pending(rep)
        rep.last_seq = None
        rep.dropped[why] += messages

    def drops(self) -> list[tuple[str, str, int]]:
        """(replica, why, messages) for every replica that dropped some."""
        return sorted(
            (name, why, n) for name, rep in self._replicas.items() for why, n in rep.dropped.items()
        )

    def forget(self, replica: str) -> None:
        """Drop everything about a replica (it left the pool)."""
        rep = self._replicas.pop(replica, None)
        if rep is not None:
            self._total -= len(rep.blocks)

    # -- lookups ---------------------------------------------------------------------

    def lookup(
        self, token_ids: Sequence[int], block_size: int, lora: str | None, now: float
    ) -> dict[str, int]:
        """The leading full blocks of the request each replica holds (its longest cached
        prefix, in blocks); replicas holding none are left out. Hashes only as far as the
        deepest replica's prefix goes."""
        live = self._live()
        if not live:
            return {}
        return self._walk(live, _chain(token_ids, block_size, extra_digest(lora)), now)

    def lookup_chain(self, chain: Sequence[int], now: float) -> dict[str, int]:
        """`lookup` for a request already hashed by `block_chain` (to speculate with the
        same hashes afterwards)."""
        live = self._live()
        return self._walk(live, iter(chain), now) if live else {}

    def _live(self) -> list[tuple[str, OrderedDict[int, _Held]]]:
        return [(n, r.blocks) for n, r in self._replicas.items() if r.blocks and not r.unusable]

    def _walk(
        self, live: list[tuple[str, OrderedDict[int, _Held]]], chain: Iterator[int], now: float
    ) -> dict[str, int]:
        depth: dict[str, int] = {}
        seen: list[int] = []
        alive = live
        for h in chain:
            for _, blocks in alive:
                v = blocks.get(h)
                if v is None or (type(v) is float and v <= now):
                    break
            else:
                seen.append(h)
                continue
            still = []
            for name, blocks in alive:
                v = blocks.get(h)
                if v is None or (type(v) is float and v <= now):
                    depth[name] = len(seen)
                else:
                    still.append((name, blocks))
            alive = still
            if not alive:
                break
            seen.append(h)
        for name, _ in alive:
            depth[name] = len(seen)
        found = {name: d for name, d in depth.items() if d}
        for name, blocks in live:
            d = found.get(name, 0)
            touch = blocks.move_to_end
            for i in range(d - 1, -1, -1):  # deepest first: the chain's start newest
                touch(seen[i])
        return found

    # -- speculation -----------------------------------------------------------------

    def speculate(
        self,
        replica: str,
        token_ids: Sequence[int],
        block_size: int,
        lora: str | None,
        now: float,
    ) -> int:
        """Mark a request's blocks as held by the replica it was routed to, for
        `speculative_ttl_s`; returns how many blocks."""
        return self.speculate_chain(replica, block_chain(token_ids, block_size, lora), now)

    def speculate_chain(self, replica: str, chain: Sequence[int], now: float) -> int:
        rep = self._replica(replica)
        if rep.unusable is not None or not chain:
            return 0
        self._expire(rep, now)
        until = now + self.speculative_ttl_s
        blocks = rep.blocks
        for h in chain:
            v = blocks.get(h)
            if v is None:
                blocks[h] = until
                self._total += 1
            elif type(v) is float and v < until:
                blocks[h] = until
        for h in reversed(chain):
            blocks.move_to_end(h)
        rep.speculated.append((until, tuple(chain)))
        self._evict(rep)
        return len(chain)

    def expire(self, now: float) -> None:
        """Drop speculative entries whose time has passed (apply and speculate do this for
        their replica as they go)."""
        for rep in self._replicas.values():
            self._expire(rep, now)

    def _expire(self, rep: _Replica, now: float) -> None:
        queue, blocks = rep.speculated, rep.blocks
        while queue and queue[0][0] <= now:
            for h in queue.popleft()[1]:
                v = blocks.get(h)
                if type(v) is float and v <= now:
                    del blocks[h]
                    self._total -= 1

    # -- events ----------------------------------------------------------------------

    def apply(
        self, replica: str, batch: KvBatch, now: float, *, replayed: bool = False
    ) -> ApplyResult:
        """Apply one decoded message from `replica`'s engine (`replayed`: it came from the
        replay socket rather than the live stream)."""
        return _run(self.apply_steps(replica, batch, now, replayed=replayed))

    def apply_steps(
        self, replica: str, batch: KvBatch, now: float, *, replayed: bool = False
    ) -> Steps:
        """`apply`, a slice at a time: it yields after about `SLICE_BLOCKS` blocks of work
        so that the shell lets other tasks run between slices. Lookups and speculation in
        between see part of the batch applied, a chain's first blocks before its last,
        which is what an engine holds while it prefills. Once the replica is forgotten,
        it stops."""
        return self._sliced(replica, self._applying(replica, batch, now, replayed))

    def _sliced(self, replica: str, steps: Steps) -> Steps:
        rep = self._replica(replica)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            yield
            if self._replicas.get(replica) is not rep:
                steps.close()
                return ApplyResult(replica)

    def _step(self, blocks: int) -> bool:
        """Count `blocks` of work done: True when a slice's worth has been."""
        self._work += blocks
        if self._work < SLICE_BLOCKS:
            return False
        self._work = 0
        return True

    def _applying(self, replica: str, batch: KvBatch, now: float, replayed: bool) -> Steps:
        rep = self._replica(replica)
        out = ApplyResult(replica)
        if rep.unusable is not None:
            out.unusable = rep.unusable
            return out
        self._expire(rep, now)
        seq, last = batch.seq, rep.last_seq
        if last is None or seq == last + 1:
            yield from self._apply_batch(rep, batch, out)
            yield from self._drain(rep, out)
        elif seq <= last:
            if replayed:
                out.duplicate = True
            else:
                self._clear(rep)
                self._drop_pending(rep)
                out.restarted = out.cleared = True
                yield from self._apply_batch(rep, batch, out)
        elif seq in rep.pending:
            out.duplicate = True
        elif replayed:
            # The replay starts past the hole: the engine no longer has what was missed.
            self._hold_back(rep, batch)
            yield from self._resync(rep, out)
        else:
            if not rep.awaiting:
                rep.awaiting = True
                out.replay_from = last + 1
            out.buffered = True
            if not self._hold_back(rep, batch):
                yield from self._resync(rep, out)
        return out

    def replay_done(self, replica: str, now: float) -> ApplyResult:
        """The replay for an open gap ended (its end marker, or it failed or timed out):
        a hole still open is given up on (the replica is cleared, buffered batches applied)."""
        return _run(self.replay_done_steps(replica, now))

    def replay_done_steps(self, replica: str, now: float) -> Steps:
        """`replay_done`, a slice at a time (as `apply_steps`)."""
        return self._sliced(replica, self._replay_done(replica, now))

    def _replay_done(self, replica: str, now: float) -> Steps:
        rep = self._replica(replica)
        out = ApplyResult(replica, unusable=rep.unusable)
        if rep.unusable is None and rep.awaiting:
            self._expire(rep, now)
            yield from self._resync(rep, out)
        return out

    def _replica(self, replica: str) -> _Replica:
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _Replica()
        return rep

    def _hold_back(self, rep: _Replica, batch: KvBatch) -> bool:
        """Buffer a batch behind the gap; False when the buffer is over its bounds."""
        rep.pending[batch.seq] = batch
        rep.pending_tokens += _batch_tokens(batch)
        return (
            len(rep.pending) <= self.max_pending_batches
            and rep.pending_tokens <= self.max_pending_tokens
        )

    def _drop_pending(self, rep: _Replica) -> None:
        rep.pending.clear()
        rep.pending_tokens = 0
        rep.awaiting = False

    def _drain(self, rep: _Replica, out: ApplyResult) -> Steps:
        while rep.last_seq is not None and rep.unusable is None:
            batch = rep.pending.pop(rep.last_seq + 1, None)
            if batch is None:
                break
            rep.pending_tokens -= _batch_tokens(batch)
            yield from self._apply_batch(rep, batch, out)
        if not rep.pending:
            self._drop_pending(rep)
        return out

    def _resync(self, rep: _Replica, out: ApplyResult) -> Steps:
        self._clear(rep)
        out.cleared = out.resynced = True
        out.buffered = False
        batches = [rep.pending[s] for s in sorted(rep.pending)]
        self._drop_pending(rep)
        for batch in batches:
            if rep.unusable is not None:
                break
            yield from self._apply_batch(rep, batch, out)
        return out

    def _apply_batch(self, rep: _Replica, batch: KvBatch, out: ApplyResult) -> Steps:
        rep.last_seq = batch.seq
        rep.batches += 1
        out.applied += 1
        out.skipped += batch.skipped
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self._clear(rep)
                out.cleared = True
                continue
            group = event.group_idx
            if group is not None:
                if rep.group is None:
                    rep.group = group
                elif group != rep.group:
                    self._mark_unusable(rep, group, out)
                    return out
            if isinstance(event, BlockStored):
                yield from self._store(rep, event, out)
            else:
                yield from self._remove(rep, event, out)
            if self._step(1):
                yield
        return out

    def _mark_unusable(self, rep: _Replica, group: int, out: ApplyResult) -> None:
        rep.unusable = out.unusable = (
            f"its events name KV-cache groups {rep.group} and {group}: a hybrid model, "
            "whose prefix hits need every group to hold the prefix, which the index does "
            "not track"
        )
        self._clear(rep)
        self._drop_pending(rep)
        out.cleared = True

    def _store(self, rep: _Replica, event: BlockStored, out: ApplyResult) -> Steps:
        hashes, size, extra_keys = event.block_hashes, event.block_size, event.extra_keys
        n = len(hashes)
        if not n:
            return out
        if len(event.token_ids) != n * size or (extra_keys is not None and len(extra_keys) != n):
            out.malformed += 1
            return out
        medium = event.medium
        if event.parent_block_hash is None:
            h: int | None = ROOT
        else:
            parent = event.parent_block_hash
            h = rep.engine.get(_key(medium, parent))
            if h is None and medium not in _DEFAULT_MEDIA:
                h = rep.engine.get(parent)
        if h is None:
            out.orphaned += n
            return out
        rep.block_size = size
        lora = event.lora_name
        base: ExtraKey = ()
        if lora is None and event.lora_id is not None:
            base = (("lora_id", event.lora_id),)  # vLLM before lora_name: never matched
        plain = _template(extra_digest(lora, base))
        data = _tokens(event.token_ids, 0, n * size)
        parent_bytes = h.to_bytes(8, "little")
        own: list[int] = []
        for first in range(0, n, SLICE_BLOCKS):
            for i in range(first, min(first + SLICE_BLOCKS, n)):
                keys = extra_keys[i] if extra_keys is not None else None
                rest = _strip(keys, lora) if keys else ()
                template = plain if not rest else _template(extra_digest(lora, base + rest))
                hasher = template.copy()
                hasher.update(parent_bytes)
                hasher.update(data[i * size : (i + 1) * size])
                parent_bytes = hasher.digest()
                h = int.from_bytes(parent_bytes, "little")
                self._hold(rep, _key(medium, hashes[i]), h)
                own.append(h)
            if self._step(min(SLICE_BLOCKS, n - first)):
                yield
        blocks = rep.blocks
        # Deepest first over the whole chain (slices may come between: the same order).
        for last in range(n, 0, -SLICE_BLOCKS):
            for h in reversed(own[max(last - SLICE_BLOCKS, 0) : last]):
                if h in blocks:  # not when a later block took over its engine hash
                    blocks.move_to_end(h)
            if self._step(min(SLICE_BLOCKS, last) // 4):  # a touch: a quarter of a block's work
                yield
        out.stored += n
        out.evicted += yield from self._evicting(rep)
        return out

    def _hold(self, rep: _Replica, key: EngineKey, own: int) -> None:
        old = rep.engine.get(key)
        if old == own:
            return
        if old is not None:  # the engine reused its name for other tokens
            self._unlink(rep, key, old)
        rep.engine[key] = own
        v = rep.blocks.get(own)
        if v is None:
            rep.blocks[own] = key
            self._total += 1
        elif isinstance(v, float):  # speculative until now: confirmed
            rep.blocks[own] = key
        elif isinstance(v, list):
            v.append(key)
        else:
            rep.blocks[own] = [v, key]

    def _remove(self, rep: _Replica, event: BlockRemoved, out: ApplyResult) -> Steps:
        hashes, medium = event.block_hashes, event.medium
        for first in range(0, len(hashes), SLICE_BLOCKS):
            for engine_hash in hashes[first : first + SLICE_BLOCKS]:
                key = _key(medium, engine_hash)
                own = rep.engine.pop(key, None)
                if own is not None:
                    self._unlink(rep, key, own)
                    out.removed += 1
            if self._step(min(SLICE_BLOCKS, len(hashes) - first) // 4):
                yield
        return out

    def _unlink(self, rep: _Replica, key: EngineKey, own: int) -> None:
        v = rep.blocks.get(own)
        if isinstance(v, list):
            v.remove(key)
            if len(v) == 1:
                rep.blocks[own] = v[0]
        elif v is not None and not isinstance(v, float):
            del rep.blocks[own]
            self._total -= 1

    def _clear(self, rep: _Replica) -> None:
        self._total -= len(rep.blocks)
        rep.blocks.clear()
        rep.engine.clear()
        rep.speculated.clear()

    def _evict(self, rep: _Replica) -> int:
        return _run(self._evicting(rep))

    def _evicting(self, rep: _Replica) -> Generator[None, None, int]:
        evicted = 0
        while len(rep.blocks) > self.max_blocks_per_replica:
            self._evict_one(rep)
            evicted += 1
            if self._step(1):
                yield
        while self._total > self.max_blocks:
            self._evict_one(max(self._replicas.values(), key=lambda r: len(r.blocks)))
            evicted += 1
            if self._step(1):
                yield
        return evicted

    def _evict_one(self, rep: _Replica) -> None:
        _, v = rep.blocks.popitem(last=False)
        if isinstance(v, list):
            for key in v:
                rep.engine.pop(key, None)
        elif not isinstance(v, float):
            rep.engine.pop(v, None)
        self._total -= 1


def _run(steps: Generator[None, None, _T]) -> _T:
    """A sliced piece of work done at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _key(medium: str | None, engine_hash: BlockHash) -> EngineKey:
    if medium is None or medium == "GPU":
        return engine_hash
    return (medium, engine_hash)


def _strip(keys: ExtraKey, lora: str | None) -> ExtraKey:
    """A block's extra keys less the LoRA name (vLLM puts it first), which the digest
    takes on its own."""
    if lora is not None and keys and keys[0] == lora:
        return keys[1:]
    return keys


def _batch_tokens(batch: KvBatch) -> int:
    return sum(len(e.token_ids) for e in batch.events if isinstance(e, BlockStored))
