"""An engine's KV-event feed takes a bounded share of the router's loop (issue 34):
the pure budget (router.loop_share), the feed pacing its slices by it on trio's autojump
clock with made-up costs, what it drops past its backlog (the replica stale, counted,
said once), a replay past what an engine buffers given up unread, and the index's and
decoder's slices."""

from __future__ import annotations

import array
import logging
from collections.abc import Generator

import msgpack
import pytest
import trio
import trio.testing

from llmgw_core.catalog import Endpoint
from llmgw_core.kv_events import (
    MAX_EXTRA_ITEMS,
    BlockStored,
    KvBatch,
    KvEventError,
    decode_message,
    decode_message_steps,
    run_steps,
)
from llmgw_core.ratelog import RateLimit
from llmgw_mock_engine.kv_events import BatchEncoder, KvEventsConfig
from llmgw_mock_engine.kv_publisher import KvEventPublisher
from llmgw_mock_engine.scheduler import StoredBlocks
from llmgw_server.router import kv_feed
from llmgw_server.router.kv_feed import Subscription
from llmgw_server.router.kv_index import SLICE_BLOCKS, KvIndex
from llmgw_server.router.loop_share import LoopShare
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.policies.precise import kv_metrics
from procs import free_port

ENGINE = Endpoint("127.0.0.1", 9, kv_events="tcp://127.0.0.1:1")
NAME = ENGINE.url
SLICE_COST = 0.01  # what each slice of work "takes" on the made-up clock


# -- the budget, pure ------------------------------------------------------------------


def test_a_share_lets_a_burst_through_then_paces_to_its_rate() -> None:
    share = LoopShare(0.1, 0.05)
    assert share.wait(0.0) == 0.0
    share.spent(0.03, 0.0)
    assert share.wait(0.0) == 0.0  # 20 ms of the burst left
    share.spent(0.03, 0.0)
    assert share.wait(0.0) == pytest.approx(0.1)  # 10 ms owed at 10%: 100 ms
    assert share.wait(0.05) == pytest.approx(0.05)
    assert share.wait(0.1) == 0.0
    # Idle for long: no more than the burst saved up.
    assert share.wait(100.0) == 0.0
    share.spent(0.2, 100.0)
    assert share.wait(100.0) == pytest.approx((0.2 - 0.05) / 0.1)


def test_a_share_is_validated() -> None:
    for share, burst in ((0.0, 0.1), (1.5, 0.1), (0.1, 0.0)):
        with pytest.raises(ValueError, match="loop share"):
            LoopShare(share, burst)


# -- the feed, paced -------------------------------------------------------------------


class MadeUpClock:
    """What the feed times its slices with: each slice "takes" SLICE_COST."""

    def __init__(self) -> None:
        self.t = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the end of a slice
            self.t += SLICE_COST
        return self.t


def subscription(index: KvIndex | None = None, **kw: object) -> Subscription:
    index = index if index is not None else KvIndex()
    return Subscription(index, ENGINE, RateLimit(60.0), clock=MadeUpClock(), **kw)  # type: ignore[arg-type]


def work(slices: int, log: list[str]) -> Generator[None, None, int]:
    for i in range(slices):
        log.append(f"slice {i}")
        yield
    log.append("done")
    return slices


async def test_a_feed_spends_its_share_of_the_loop_and_no_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """200 slices of 10 ms (2 s of loop) at 10% with a 50 ms burst take about 20 s.
    Without the pacing they take no time at all."""
    sub = subscription()
    log: list[str] = []
    start = trio.current_time()
    assert await sub._paced(work(200, log)) == 200
    took = trio.current_time() - start
    cost = 201 * SLICE_COST  # 200 slices and the last step, that returns
    assert took == pytest.approx((cost - kv_feed.FEED_BURST_S) / kv_feed.FEED_SHARE, rel=0.05)
    assert log[-1] == "done"


async def test_other_tasks_run_between_every_two_slices() -> None:
    """Within its share (a burst that never runs out here), a feed still checkpoints
    between slices: a busy task runs in between."""
    sub = subscription(share=LoopShare(0.1, 1000.0))
    log: list[str] = []

    async def other_task() -> None:
        while True:
            log.append("other")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.lowlevel.checkpoint()
        assert await sub._paced(work(50, log)) == 50
        nursery.cancel_scope.cancel()
    slices = [i for i, what in enumerate(log) if what.startswith("slice")]
    assert len(slices) == 50
    # Each slice in a scheduler batch of its own (their order within one is random).
    assert all("other" in log[a:c] for a, c in zip(slices, slices[2:], strict=False))


async def test_a_flood_of_big_messages_is_applied_at_the_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Real decoding and applying (a 65,536-block message is dozens of slices), timed by
    the made-up clock: 4 such messages take their slices' cost over the share."""
    index = KvIndex()
    sub = subscription(index)
    frames = [[b"", seq.to_bytes(8, "big"), big_payload(seq, 65_536 // 4, 16)] for seq in range(4)]
    start = trio.current_time()
    for f in frames:
        await sub._apply_live(f, skip_old=False)
    took = trio.current_time() - start
    assert index.last_seq(NAME) == 3 and index.held(NAME) == 4 * (65_536 // 4)
    reads = sub._clock.reads  # type: ignore[attr-defined]
    assert reads > 4 * 2 * 8  # sliced: many slices a message
    cost = reads // 2 * SLICE_COST
    assert took >= (cost - kv_feed.FEED_BURST_S) / kv_feed.FEED_SHARE * 0.95


def big_payload(first: int, blocks: int, block_size: int) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": list(range(first * blocks + 1, (first + 1) * blocks + 1)),
        "parent_block_hash": None,
        "token_ids": [(first * 7 + i) % 60_000 for i in range(blocks * block_size)],
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgpack.packb([0.0, [event], 0])  # type: ignore[no-any-return]


# -- what the feed drops ---------------------------------------------------------------


async def test_past_its_backlog_messages_are_dropped_the_replica_stale_counted_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_feed, "MAX_QUEUED_BYTES", 100)
    index = KvIndex()
    index.apply(NAME, KvBatch("", 0, 0.0, 0, (stored_root(1),)), 0.0)
    assert index.held(NAME) == 1
    said: set[tuple[str, str]] = set()
    sub = Subscription(index, ENGINE, RateLimit(60.0), said)
    send, receive = trio.open_memory_channel[kv_feed.Handoff](kv_feed.CHANNEL)

    def message(seq: int, size: int) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big"), b"x" * size]

    with caplog.at_level(logging.WARNING, logger="llmgw.kv_feed"):
        sub._offer(send, [message(1, 60)])
        sub._offer(send, [message(2, 60)])  # 120 bytes would wait: dropped
        sub._offer(send, [message(3, 30)])
        assert (sub.queued, sub.dropped) == (90, 1)
        first, second = receive.receive_nowait(), receive.receive_nowait()
        assert (first[0], second[0]) == (0, 1)  # the second says one was dropped before it
        await sub._take(*first, skip_old=False)  # malformed payloads: dropped, said
        await sub._take(*second, skip_old=False)
        assert sub.queued == 0
        # Stale: cleared, its sequence forgotten (the next message starts it again).
        assert index.held(NAME) == 0 and index.last_seq(NAME) is None
        sub._offer(send, [message(4, 200)])  # over the backlog alone: dropped
        sub._offer(send, [message(5, 10)])
        await sub._take(*receive.receive_nowait(), skip_old=False)
    assert index.drops() == [(NAME, "backlog", 2)]
    dropped = [r.getMessage() for r in caplog.records if "dropped (" in r.getMessage()]
    assert len(dropped) == 1 and "1 messages dropped" in dropped[0]
    assert "cleared and rebuilt" in dropped[0]
    page = RouterMetrics().render({}, {}, policy_metrics=lambda urls: kv_metrics(index, urls))
    rendered = page.decode()
    assert f'llmgw_kv_events_dropped_total{{endpoint="{NAME}",reason="backlog"}} 2' in rendered
    assert "# HELP llmgw_kv_events_dropped_total KV-cache event messages dropped" in rendered


def stored_root(h: int) -> BlockStored:
    return BlockStored((h,), None, array.array("I", [h] * 4), 4)


async def test_a_replay_past_what_an_engine_buffers_is_given_up_unread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_feed, "REPLAY_MESSAGES", 5)
    events, replay = free_port(), free_port()
    config = KvEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{events}",
        replay_endpoint=f"tcp://*:{replay}",
    )
    publisher = KvEventPublisher(config, BatchEncoder(4))
    endpoint = Endpoint(
        "127.0.0.1", 9, kv_events=f"tcp://127.0.0.1:{events}", kv_replay=f"tcp://127.0.0.1:{replay}"
    )
    index = KvIndex()
    sub = Subscription(index, endpoint, RateLimit(60.0))
    words = [f"w{i}" for i in range(4)]
    with trio.fail_after(30), caplog.at_level(logging.WARNING, logger="llmgw.kv_feed"):
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            for seq in range(5):  # as many as the cap: replayed
                publisher.publish([StoredBlocks((seq + 1,), None, tuple(words))])
            await sub._replay(0)
            assert index.last_seq(NAME) == 4 and index.drops() == []
            publisher.publish([StoredBlocks((6,), None, tuple(words))])  # one more: too many
            await sub._replay(0)
            nursery.cancel_scope.cancel()
    assert index.drops() == [(NAME, "replay", 6)]
    assert index.last_seq(NAME) is None and index.held(NAME) == 0
    assert "6 messages dropped (a replay past" in caplog.text


# -- the index's and the decoder's slices ------------------------------------------------


def test_a_big_batch_is_applied_in_slices_with_the_same_result() -> None:
    blocks = 3 * SLICE_BLOCKS + 5
    payload = big_payload(0, blocks, 4)
    frames = [b"", bytes(8), payload]
    decoded_slices = 0
    decoding = decode_message_steps(frames)
    while True:
        try:
            next(decoding)
        except StopIteration as done:
            batch = done.value
            break
        decoded_slices += 1
    assert batch == decode_message(frames)
    tokens = list(batch.events[0].token_ids)
    whole, sliced = KvIndex(), KvIndex()
    whole.apply(NAME, batch, 0.0)
    steps = sliced.apply_steps(NAME, batch, 0.0)
    slices = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
            break
        slices += 1
        # In between, what is held is the chain's start: a lookup finds all of it.
        assert sliced.lookup(tokens, 4, None, 0.0).get(NAME, 0) == sliced.held(NAME)
    assert slices >= 3
    assert result.stored == blocks and sliced.held(NAME) == whole.held(NAME) == blocks
    assert (
        sliced.lookup(tokens, 4, None, 0.0) == whole.lookup(tokens, 4, None, 0.0) == {NAME: blocks}
    )


def test_a_replica_forgotten_between_slices_is_left_alone() -> None:
    index = KvIndex()
    batch = decode_message([b"", bytes(8), big_payload(0, 3 * SLICE_BLOCKS, 4)])
    steps = index.apply_steps(NAME, batch, 0.0)
    next(steps)
    index.forget(NAME)
    assert run_steps(steps).stored == 0
    assert len(index) == 0 and index.held(NAME) == 0


def test_a_blocks_extra_keys_are_capped() -> None:
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["a", ["b"] * (MAX_EXTRA_ITEMS - 2)]],
    }
    ok = msgpack.packb([0.0, [event], 0])
    assert decode_message([b"", bytes(8), ok]).events[0].extra_keys is not None  # type: ignore[union-attr]
    event["extra_keys"] = [["a", ["b"] * (MAX_EXTRA_ITEMS - 1)]]
    with pytest.raises(KvEventError, match=f"more than {MAX_EXTRA_ITEMS} values"):
        decode_message([b"", bytes(8), msgpack.packb([0.0, [event], 0])])
