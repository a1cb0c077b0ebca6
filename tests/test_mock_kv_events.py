"""The mock engine publishes vLLM's KV-cache events over real ZMQ, from its scheduler model.

Each test runs the engine in process (its own trio tasks and sockets) and subscribes with
real ZMQ sockets on loopback or a private ipc:// path, decoding with
llmgw_core.kv_events as a router would, and feeding a real KvIndex.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgpack
import pytest
import trio
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    decode_message,
    decode_replay,
)
from llmgw_mock_engine.engine import MockSettings, main, parse_args
from llmgw_mock_engine.kv_events import BatchEncoder, KvEventsConfig, token_id
from llmgw_mock_engine.kv_publisher import KvEventPublisher
from llmgw_mock_engine.scheduler import (
    CacheCleared,
    CacheEvent,
    EngineModel,
    PromptTooLong,
    RemovedBlocks,
    Scheduler,
    StoredBlocks,
    block_hashes,
)
from llmgw_server.router.kv_index import KvIndex, block_chain
from procs import free_port

REPLICA = "mock"
BLOCK = 4


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    # Short: an ipc:// path must fit a socket address (107 bytes).
    path = tempfile.mkdtemp(prefix="kv-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def mock_settings(config: dict[str, Any], *flags: str) -> MockSettings:
    return parse_args(
        ["serve", "m", "--port", "0", "--mock-kv-blocks", "16", "--mock-block-size", str(BLOCK),
         "--mock-tokens", "8", "--mock-prefill-tps", "100000", "--kv-events-config",
         json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **config}), *flags],
        {},
    )  # fmt: skip


@asynccontextmanager
async def engine(mock: MockSettings) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(main, mock)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
        nursery.cancel_scope.cancel()


def replay(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[KvBatch]:
    """Ask the replay socket from `start`: the batches it sends before its end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        return replay_replies(dealer)
    finally:
        dealer.close(linger=0)


def replay_replies(dealer: zmq.Socket[bytes]) -> list[KvBatch]:
    batches: list[KvBatch] = []
    while True:
        if not dealer.poll(5000):
            raise AssertionError("no end marker from the replay socket")
        empty, *frames = dealer.recv_multipart()
        assert empty == b""
        batch = decode_replay(frames)
        if batch is None:
            return batches
        batches.append(batch)


class Feed:
    """A router's subscription to one engine: live messages, a gap (the first messages
    missed while the subscription was joining included) repaired from the replay socket,
    everything applied in order to a KvIndex."""

    def __init__(
        self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, replay_endpoint: str, bind: bool
    ) -> None:
        self.context = context
        self.replay_endpoint = replay_endpoint
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.index = KvIndex()
        self.batches: list[KvBatch] = []  # applied, in order
        self.raw: dict[int, list[bytes]] = {}  # the live messages' frames, by sequence
        self.next_seq = 0

    def close(self) -> None:
        self.sub.close(linger=0)

    def _receive(self) -> list[bytes] | None:
        return self.sub.recv_multipart() if self.sub.poll(100) else None

    def _apply(self, batch: KvBatch, replayed: bool) -> None:
        result = self.index.apply(REPLICA, batch, time.monotonic(), replayed=replayed)
        assert result.applied == 1 and not result.orphaned and not result.malformed, result
        self.batches.append(batch)
        self.next_seq = batch.seq + 1

    async def catch_up(self, last_seq: int) -> None:
        """Until the message `last_seq` is applied. A message missed (the subscription
        joins some time after the engine's socket opens, and drops what came before) is
        asked of the replay socket: when a later one comes, or after 100 ms without."""
        while self.next_seq <= last_seq:
            frames = await trio.to_thread.run_sync(self._receive)
            batch = decode_message(frames) if frames is not None else None
            if frames is not None and batch is not None:
                self.raw[batch.seq] = frames
                if batch.seq < self.next_seq:
                    continue
            if batch is None or batch.seq > self.next_seq:
                missed = await trio.to_thread.run_sync(
                    replay, self.context, self.replay_endpoint, self.next_seq
                )
                for old in missed:
                    if self.next_seq <= old.seq and (batch is None or old.seq < batch.seq):
                        self._apply(old, True)
            if batch is not None:
                assert self.next_seq == batch.seq, "the replay did not fill the gap"
                self._apply(batch, False)

    def predicted(self, tokens: list[int], lora: str | None = None) -> int:
        """The cached tokens the index predicts for a prompt: its longest held prefix in
        blocks, less the last token, which the engine always computes."""
        blocks = self.index.lookup(tokens, BLOCK, lora, time.monotonic()).get(REPLICA, 0)
        return min(blocks, (len(tokens) - 1) // BLOCK) * BLOCK

    def events(self) -> list[Any]:
        return [e for b in self.batches for e in b.events]


async def settle(client: httpx.AsyncClient) -> int:
    """Once nothing runs: the sequence number of the last message published."""
    while True:
        stats = (await client.get("/mock/stats")).json()
        if stats["running"] == stats["waiting"] == 0:
            last: int = stats["kv_events"]["last_seq"]
            return last
        await trio.sleep(0.01)


async def tokenize(client: httpx.AsyncClient, body: dict[str, Any]) -> list[int]:
    answer = (await client.post("/tokenize", json=body)).json()
    assert answer["count"] == len(answer["tokens"]) and answer["token_strs"] is None
    tokens: list[int] = answer["tokens"]
    return tokens


async def complete(client: httpx.AsyncClient, prompt: str, model: str = "m") -> int:
    answer = (await client.post("/v1/completions", json={"model": model, "prompt": prompt})).json()
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


# --------------------------------------------------------------------------- the model's record


@settings(max_examples=profile_times(1.5), deadline=None)
@given(data=st.data())
def test_the_recorded_events_account_for_every_cached_block(data: st.DataObject) -> None:
    """Any run of the scheduler model, replayed from its events alone (as a router's
    index is), holds exactly the blocks its cache holds; each stored chain hangs from a
    block stored before it and hashes as its whole prefix does."""
    draw = data.draw
    block = draw(st.integers(1, 4), "block size")
    model = EngineModel(kv_blocks=draw(st.integers(4, 24)), block_size=block, max_seqs=draw(st.integers(1, 3)))
    scheduler = Scheduler(model, record_events=True)
    held: dict[int, tuple[str, ...]] = {}  # a cached block -> every token up to its end
    waiting: list[int] = []
    running: dict[int, bool] = {}  # -> prefilled
    events = 0

    def account() -> None:
        nonlocal events
        for event in scheduler.take_events():
            events += 1
            if isinstance(event, StoredBlocks):
                assert len(event.tokens) == len(event.hashes) * block
                prefix = () if event.parent is None else held[event.parent]
                whole = prefix + event.tokens
                assert block_hashes(whole, block, event.lora)[-len(event.hashes) :] == list(event.hashes)
                for i, h in enumerate(event.hashes):
                    assert h not in held
                    held[h] = whole[: len(prefix) + (i + 1) * block]
            elif isinstance(event, RemovedBlocks):
                for h in event.hashes:
                    del held[h]
            else:
                assert isinstance(event, CacheCleared)
                held.clear()
        assert scheduler.cache.cached == len(held)
        assert all(scheduler.cache.contains(h) for h in held)

    def admit(admitted: list[Any]) -> None:
        for a in admitted:
            waiting.remove(a.seq_id)
            running[a.seq_id] = False

    for seq_id in range(draw(st.integers(1, 40), "steps")):
        op = draw(st.sampled_from(["arrive", "arrive", "prefill", "finish", "reset"]))
        if op == "arrive":
            family, length = draw(st.integers(0, 2)), draw(st.integers(1, 20))
            lora = draw(st.sampled_from([None, None, "sql"]))
            prompt = [f"f{family}-{i}" for i in range(length)]
            waiting.append(seq_id)
            try:
                admit(scheduler.submit(seq_id, prompt, draw(st.integers(0, 6)), 0.0, lora))
            except PromptTooLong:
                waiting.remove(seq_id)
        elif op == "prefill" and any(not done for done in running.values()):
            chosen = draw(st.sampled_from(sorted(s for s, done in running.items() if not done)))
            scheduler.prefilled(chosen)
            running[chosen] = True
        elif op == "finish" and (running or waiting):
            chosen = draw(st.sampled_from(sorted([*running, *waiting])))
            output = [f"o{i}" for i in range(draw(st.integers(0, 6)))] if running.get(chosen) else []
            if chosen in waiting:
                waiting.remove(chosen)
            running.pop(chosen, None)
            admit(scheduler.finish(chosen, output, 0.0))
        elif op == "reset" and not running and not waiting:
            scheduler.reset()
        account()
    assert events or not held


# --------------------------------------------------------------------------- (a) the wire


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_a_subscriber_decodes_the_published_messages_in_either_encoding(
    encoding: str, zctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    if encoding == "map":
        # An explicit host: the engine connects, the subscriber binds (vLLM's rule).
        endpoint, bind = f"tcp://127.0.0.1:{free_port()}", True
    else:
        endpoint, bind = f"ipc://{ipc_dir}/kv", False  # ipc://: the engine binds
    config = {"endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": "kv@m"}
    mock = mock_settings(config, "--mock-kv-events-encoding", encoding)
    feed = Feed(zctx, endpoint, replay_endpoint, bind)
    prompt = words("w", 17)
    with trio.fail_after(20):
        async with engine(mock) as client:
            tokens = await tokenize(client, {"model": "m", "prompt": prompt})
            assert tokens == [token_id(w) for w in prompt.split()]
            # Stable in every process (CRC-32, not Python's seeded hash of a str).
            assert token_id("hello") == 907060870 and token_id("<|user|>") < 1 << 31
            await complete(client, prompt)
            await feed.catch_up(await settle(client))
            # Live messages come once the subscription has joined (a connecting SUB tries
            # every 100 ms until the engine's socket is there): ask until one does.
            for i in range(100):
                if feed.raw:
                    break
                await complete(client, words(f"x{i}-", 9))
                await feed.catch_up(await settle(client))
                await trio.sleep(0.02)
    feed.close()
    assert [b.seq for b in feed.batches] == list(range(len(feed.batches)))
    assert feed.raw, "no message came live"
    assert all(b.topic == "kv@m" and b.dp_rank == 0 and b.skipped == 0 for b in feed.batches)
    first = feed.batches[0].events
    assert len(first) == 1 and isinstance(first[0], BlockStored)
    stored = first[0]
    # The prompt's 4 full blocks, stored when its prefill ended.
    assert list(stored.token_ids) == tokens[:16] and len(stored.block_hashes) == 4
    assert stored.parent_block_hash is None and stored.block_size == BLOCK
    assert (stored.medium, stored.lora_name, stored.lora_id, stored.group_idx) == ("GPU", None, None, 0)
    assert stored.kv_cache_spec_kind == "full_attention" and stored.extra_keys == (None,) * 4
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in stored.block_hashes)
    # The encoding on the wire: vLLM 0.32.0's maps tagged by "type", or the older arrays.
    seq, frames = next(iter(feed.raw.items()))
    assert frames[0] == b"kv@m" and frames[1] == seq.to_bytes(8, "big")
    ts, events, rank = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    assert abs(ts - time.time()) < 60 and rank == 0
    if encoding == "map":
        assert all(isinstance(e, dict) and next(iter(e)) == "type" for e in events)
    else:
        assert all(isinstance(e, list) and isinstance(e[0], str) for e in events)


# --------------------------------------------------------------------------- (b) predictions


async def test_the_index_fed_by_the_events_predicts_the_engines_cached_tokens_through_evictions(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """16 blocks of 4 tokens; each request of 17 words and 8 answer tokens leaves 6 full
    blocks cached, so a third distinct prompt evicts the first's tail."""
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    mock = mock_settings(
        {"endpoint": endpoint, "replay_endpoint": replay_endpoint},
        "--enable-lora", "--lora-modules", "m-sql=/l/sql",
    )  # fmt: skip
    feed = Feed(zctx, endpoint, replay_endpoint, bind=True)
    a, b, c = words("a", 17), words("b", 17), words("c", 17)
    seen: list[tuple[str, int, int]] = []  # (prompt, predicted, reported)
    with trio.fail_after(30):
        async with engine(mock) as client:

            async def ask(prompt: str, model: str = "m") -> int:
                tokens = await tokenize(client, {"model": model, "prompt": prompt})
                predicted = feed.predicted(tokens, model if model != "m" else None)
                reported = await complete(client, prompt, model)
                seen.append((prompt[:2] + model, predicted, reported))
                await feed.catch_up(await settle(client))
                return predicted

            assert await ask(a) == 0
            tokens_a = await tokenize(client, {"model": "m", "prompt": a})
            # What was stored is what the request's tokens hash to.
            chain = block_chain(tokens_a, BLOCK, None)
            assert feed.index.lookup_chain(chain, time.monotonic()) == {REPLICA: 4}
            assert await ask(a) == 16  # its 4 prompt blocks (the last token recomputed)
            assert await ask(a, "m-sql") == 0  # an adapter's blocks are its own
            assert await ask(a, "m-sql") == 16
            before = feed.predicted(tokens_a)
            removed_before = sum(isinstance(e, BlockRemoved) for e in feed.events())
            await ask(b)
            await ask(c)
            removed = sum(isinstance(e, BlockRemoved) for e in feed.events()) - removed_before
            after = await ask(a)
    feed.close()
    assert all(predicted == reported for _, predicted, reported in seen), seen
    assert removed > 0 and after < before == 16, (removed, before, after, seen)
    adapter = [e for e in feed.events() if isinstance(e, BlockStored) and e.lora_name]
    assert adapter and all(e.lora_name == "m-sql" and e.lora_id == 1 for e in adapter)
    assert all(e.extra_keys == (("m-sql",),) * len(e.block_hashes) for e in adapter)


async def test_a_conversations_next_turn_is_predicted_from_its_stored_answer(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    mock = mock_settings({"endpoint": endpoint, "replay_endpoint": replay_endpoint}, "--mock-kv-blocks", "64")
    feed = Feed(zctx, endpoint, replay_endpoint, bind=True)
    messages = [{"role": "user", "content": words("q", 10)}]
    with trio.fail_after(30):
        async with engine(mock) as client:
            first = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
            await feed.catch_up(await settle(client))
            text = first.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
            tokens = await tokenize(client, {"model": "m", "messages": messages})
            predicted = feed.predicted(tokens)
            second = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
            without_prompt = await client.post(
                "/tokenize", json={"messages": messages, "add_generation_prompt": False, "return_token_strs": True}
            )
    feed.close()
    # 1 + 10 + 1 prompt tokens and 8 answer tokens: 5 full blocks, the answer's included.
    assert predicted == 20 == second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    listed = without_prompt.json()
    assert listed["tokens"] == tokens[:-1] and listed["token_strs"][-1] == "more"
    assert listed["max_model_len"] == 64 * BLOCK


# --------------------------------------------------------------------------- (c) replay


async def test_a_late_subscriber_replays_every_buffered_batch_then_the_end_marker(
    zctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    endpoint, replay_endpoint = f"ipc://{ipc_dir}/pub", f"tcp://127.0.0.1:{free_port()}"
    mock = mock_settings({"endpoint": endpoint, "replay_endpoint": replay_endpoint, "buffer_steps": 5, "topic": "t"})
    feed = Feed(zctx, endpoint, replay_endpoint, bind=False)
    with trio.fail_after(30):
        async with engine(mock) as client:
            for i in range(5):
                await complete(client, words(f"p{i}-", 9))
                last = await settle(client)
                await feed.catch_up(last)
            assert last >= 6  # more batches than the buffer keeps
            from_zero = await trio.to_thread.run_sync(replay, zctx, replay_endpoint, 0)
            # A request of another shape is ignored (vLLM logs it); the socket still serves.
            junk = zctx.socket(zmq.DEALER)
            junk.connect(replay_endpoint)
            junk.send_multipart([b"", b"x", b"y"])
            tail = await trio.to_thread.run_sync(replay, zctx, replay_endpoint, last - 1)
            junk.close(linger=0)
            late = await trio.to_thread.run_sync(replay, zctx, replay_endpoint, last + 1)
    feed.close()
    assert [b.seq for b in from_zero] == list(range(last - 4, last + 1))
    assert from_zero == feed.batches[-5:] and all(b.topic == "t" for b in from_zero)
    assert tail == feed.batches[-2:] and late == []
    # The engine closed its sockets on the way out: the port is free again.
    again = zctx.socket(zmq.ROUTER)
    again.bind(replay_endpoint)
    again.close(linger=0)


# --------------------------------------------------------------------------- (d) reset


async def test_a_reset_publishes_all_blocks_cleared_and_the_index_forgets(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    endpoint, replay_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    feed = Feed(zctx, endpoint, replay_endpoint, bind=True)
    prompt = words("r", 13)
    with trio.fail_after(20):
        async with engine(mock_settings({"endpoint": endpoint, "replay_endpoint": replay_endpoint})) as client:
            tokens = await tokenize(client, {"prompt": prompt})
            await complete(client, prompt)
            await feed.catch_up(await settle(client))
            assert feed.predicted(tokens) == 12
            assert (await client.post("/mock/reset")).status_code == 200
            await feed.catch_up(await settle(client))
            predicted = feed.predicted(tokens)
            reported = await complete(client, prompt)
    feed.close()
    assert feed.batches[-1].events == (AllBlocksCleared(),)
    assert predicted == reported == 0 and feed.index.held(REPLICA) == 0


# --------------------------------------------------------------------------- the publisher


async def test_a_subscriber_that_never_reads_holds_nothing_up_and_shutdown_closes_everything(
    zctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    config = KvEventsConfig.parse(json.dumps({
        "enable_kv_cache_events": True, "endpoint": f"ipc://{ipc_dir}/pub", "hwm": 4,
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "buffer_steps": 100,
    }))  # fmt: skip
    publisher = KvEventPublisher(config, BatchEncoder(block_size=16))
    stuck = zctx.socket(zmq.SUB)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.setsockopt(zmq.RCVHWM, 4)
    stuck.connect(config.endpoint)
    step: list[CacheEvent] = [StoredBlocks(tuple(range(1, 65)), None, ("w",) * 1024), RemovedBlocks((7,))]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            await trio.sleep(0.2)  # the subscription reaches the engine
            started = time.process_time()
            for _ in range(2000):  # about 8 MB: far past what the two queues hold
                publisher.publish(step)
            spent = time.process_time() - started
            assert len(publisher.buffer) == 100  # buffer_steps, the oldest dropped

            def drain() -> int:
                received = 0
                while stuck.poll(200):
                    stuck.recv_multipart()
                    received += 1
                return received

            received = await trio.to_thread.run_sync(drain)
            nursery.cancel_scope.cancel()
    assert publisher.next_seq == 2000 and publisher.dropped == 0
    assert spent < 10, spent  # never waited for the subscriber (about 0.1 s here)
    assert publisher.context is not None and publisher.context.closed
    assert len(publisher.sockets) == 2 and all(sock.closed for sock in publisher.sockets)
    assert publisher.publish(step) is None  # after shutdown: dropped, no error
    stuck.close(linger=0)
    # The rest was dropped at the high-water marks (4 each side, and the kernel's buffer).
    assert 0 < received < 100, received


async def test_a_replay_longer_than_the_high_water_mark_arrives_whole(
    zctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: str
) -> None:
    """ZMQ's ROUTER drops what a peer's full queue (1,000 messages) cannot take, silently
    unless ROUTER_MANDATORY: the publisher waits for room instead."""
    config = KvEventsConfig.parse(json.dumps({
        "enable_kv_cache_events": True, "endpoint": f"ipc://{ipc_dir}/pub",
        "replay_endpoint": f"ipc://{ipc_dir}/replay", "buffer_steps": 5000,
    }))  # fmt: skip
    assert config.replay_endpoint is not None
    publisher = KvEventPublisher(config, BatchEncoder(block_size=4, encoding="array"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            for i in range(3000):
                publisher.publish([RemovedBlocks((i,))])
            # A peer that waits before it reads: the replay fills its queues meanwhile.
            dealer = zctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 10)
            dealer.connect(config.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            await trio.sleep(0.5)
            replayed = await trio.to_thread.run_sync(replay_replies, dealer)
            nursery.cancel_scope.cancel()
    dealer.close(linger=0)
    assert [b.seq for b in replayed] == list(range(3000))
    assert [b.events for b in replayed[:2]] == [(BlockRemoved((0,), "GPU", 0),), (BlockRemoved((1,), "GPU", 0),)]
    assert publisher.replays == 1


# --------------------------------------------------------------------------- (e) the flags


def test_vllms_config_is_read_as_vllm_reads_it() -> None:
    config = KvEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 7, "hwm": 9, '
        '"max_queue_size": 3}'
    )
    assert (config.enabled, config.binds, config.buffer_steps, config.hwm) == (True, True, 7, 9)
    assert KvEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert KvEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://[::]:1"}').binds
    assert not KvEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.1:1"}').binds
    # Off: no events, and then no need for the scheduler model.
    for off in ('{"enable_kv_cache_events": false}', '{"enable_kv_cache_events": true, "publisher": "null"}'):
        assert parse_args(["serve", "m", "--kv-events-config", off], {}).kv_events is None
    on = parse_args(["serve", "m", "--mock-kv-blocks", "8", "--kv-events-config", '{"enable_kv_cache_events": true}'], {})
    assert on.kv_events is not None and on.kv_events.endpoint == "tcp://*:5557"
    assert on.kv_events_encoding == "map"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-events-config", "{enable"], "is not JSON"),
        (["--kv-events-config", "[1]"], "must be a JSON object"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoints": "tcp://*:1"}'], "unknown keys endpoints"),
        (["--kv-events-config", '{"enable_kv_cache_events": "yes"}'], "must be true or false"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'], "publisher must be"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "buffer_steps": -1}'], "buffer_steps must be"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "hwm": "10"}'], "hwm must be"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "topic": 3}'], "topic must be"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "inproc://kv"}'], "endpoint must be a tcp://"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "replay_endpoint": "localhost:1"}'], "replay_endpoint must be"),
        (["--mock-kv-events-encoding", "json"], "invalid choice"),
    ],
)  # fmt: skip
def test_bad_event_flags_are_refused_with_a_reason(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(["serve", "m", "--mock-kv-blocks", "8", *flags], {})
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_events_without_the_scheduler_model_stop_the_engine_with_a_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_mock_engine", "serve", "m", "--port", str(free_port()),
         "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}'],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert "give --mock-kv-blocks N (N > 0) too" in done.stderr, done.stderr
