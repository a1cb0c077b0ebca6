"""The router's subscription to an engine's KV-cache events (router.kv_feed), over real
ZMQ sockets in one process: the mock engine's publisher (vLLM's wire format) on loopback,
the router's KvIndex fed as the engine publishes. A message the subscriber missed is a
gap that the replay socket fills; a malformed message is dropped and said once; an engine
that starts again (its sequence back to 0) clears what it held; a replica that leaves is
unsubscribed and forgotten."""

from __future__ import annotations

import logging
import time

import attrs
import pytest
import trio
import zmq

from llmgw_core.catalog import Endpoint
from llmgw_mock_engine.kv_events import BatchEncoder, KvEventsConfig, token_ids
from llmgw_mock_engine.kv_publisher import KvEventPublisher
from llmgw_mock_engine.scheduler import CacheCleared, StoredBlocks
from llmgw_server.router.kv_feed import follow_kv_events
from llmgw_server.router.kv_index import KvIndex
from procs import free_port

BLOCK = 4
ENGINE = "http://127.0.0.1:9"  # the replica's name in the index: its endpoint's URL


def stored(words: list[str], parent: int | None, first: int) -> StoredBlocks:
    blocks = len(words) // BLOCK
    return StoredBlocks(tuple(range(first, first + blocks)), parent, tuple(words))


def held(index: KvIndex, words: list[str]) -> int:
    return index.lookup(token_ids(words), BLOCK, None, time.monotonic()).get(ENGINE, 0)


async def until(check: object, what: str) -> None:
    with trio.fail_after(10):
        while not check():  # type: ignore[operator]
            await trio.sleep(0.02)


async def test_a_missed_message_is_replayed_and_a_restart_clears(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events, replay = free_port(), free_port()
    config = KvEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{events}",  # a wildcard: the engine binds (vLLM's rule)
        replay_endpoint=f"tcp://*:{replay}",
    )
    publisher = KvEventPublisher(config, BatchEncoder(BLOCK))
    endpoint = Endpoint(
        "127.0.0.1", 9, kv_events=f"tcp://127.0.0.1:{events}", kv_replay=f"tcp://127.0.0.1:{replay}"
    )
    index = KvIndex()
    replicas = {endpoint}
    words = [f"w{i}" for i in range(24)]  # six blocks
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(publisher.run)
            # Published before the router follows: its start replays it.
            publisher.publish([stored(words[:8], None, 1)])
            await nursery.start(follow_kv_events, index, lambda: set(replicas))
            await until(lambda: held(index, words) == 2, "the replayed blocks")
            # Message 1 never reaches the subscriber (kept in the replay buffer only):
            # message 2 opens a gap, and the replay fills it.
            payload = publisher.encoder.encode([stored(words[8:16], 2, 3)], 0.0)
            publisher.buffer.append((publisher.next_seq, payload))
            publisher.next_seq += 1
            publisher.publish([stored(words[16:], 4, 5)])
            await until(lambda: held(index, words) == 6, "the gap filled by the replay")
            assert publisher.replays == 2  # one at the start, one for the gap
            # A malformed message: dropped, said once, nothing else disturbed.
            with caplog.at_level(logging.WARNING, logger="llmgw.kv_feed"):
                publisher._pub.send_multipart((b"", (99).to_bytes(8, "big"), b"\xc1junk"))  # type: ignore[union-attr]
                await until(lambda: "malformed" in caplog.text, "the malformed message said")
            assert held(index, words) == 6
            # The engine starts again: its sequence back at 0, what it held is gone.
            publisher.next_seq = 0
            publisher.publish([CacheCleared()])
            await until(lambda: held(index, words) == 0, "the restart cleared")
            publisher.publish([stored(words[:4], None, 7)])
            await until(lambda: held(index, words) == 1, "new blocks after the restart")
            # The replica leaves: unsubscribed, and its entries forgotten.
            replicas.clear()
            await until(lambda: index.held(ENGINE) == 0, "the replica forgotten")
            nursery.cancel_scope.cancel()


async def test_a_subscription_is_said_when_it_starts_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with_replay = Endpoint("127.0.0.1", 9, kv_events=events, kv_replay=replay)
    live_only = Endpoint("127.0.0.1", 10, kv_events=f"tcp://127.0.0.1:{free_port()}")
    replicas = {with_replay, live_only, Endpoint("127.0.0.1", 11)}  # 11: publishes none

    live_started = (
        f"following the KV events of http://127.0.0.1:10 at {live_only.kv_events} "
        "(replay none: a gap is rebuilt from the live events)"
    )

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "llmgw.kv_feed"]

    with caplog.at_level(logging.INFO, logger="llmgw.kv_feed"), trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(follow_kv_events, KvIndex(), lambda: set(replicas))
            await until(lambda: len(said()) == 2, "the starts said")
            assert sorted(said()) == [
                live_started,
                f"following the KV events of {ENGINE} at {events} (replay {replay})",
            ]
            replicas.discard(with_replay)
            await until(lambda: len(said()) == 3, "the end said")
            assert said()[2] == (
                f"no longer following the KV events of {ENGINE}: no model has that replica now"
            )
            # The same engine with a new key: a new subscription, the old one ended.
            replicas.discard(live_only)
            replicas.add(attrs.evolve(live_only, api_key="new"))
            await until(lambda: len(said()) == 5, "the change said")
            assert said()[3:] == [
                live_started,
                "no longer following the KV events of http://127.0.0.1:10: followed anew",
            ]
            nursery.cancel_scope.cancel()


def test_the_messages_queued_go_to_the_loop_in_batches() -> None:
    """One handoff (one wake of the loop) for what a burst left queued: at most
    BATCH_MESSAGES messages, or about BATCH_BYTES of payload, at once."""
    from llmgw_server.router import kv_feed

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    try:
        # inproc: a message sent is queued at the subscriber before send returns.
        pub.bind("inproc://kv-feed-batches")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://kv-feed-batches")
        deadline = time.monotonic() + 10
        while not sub.poll(10):  # a slow joiner: publish until the subscription is in
            pub.send_multipart([b"kv", b"0" * 8, b"hello"])
            assert time.monotonic() < deadline
        while sub.poll(100):
            sub.recv_multipart()
        for i in range(100):
            pub.send_multipart([b"kv", i.to_bytes(8, "big"), b"x" * 10])
        pub.send_multipart([b"kv", (100).to_bytes(8, "big"), b"y" * kv_feed.BATCH_BYTES])
        pub.send_multipart([b"kv", (101).to_bytes(8, "big"), b"z"])
        sizes: list[int] = []
        while sum(sizes) < 102 and sub.poll(2000):
            sizes.append(len(kv_feed._queued(sub)))
        # 64, then 36 and the big one (past BATCH_BYTES: the batch ends), then the last.
        assert sizes == [kv_feed.BATCH_MESSAGES, 37, 1], sizes
    finally:
        pub.close(0)
        sub.close(0)
