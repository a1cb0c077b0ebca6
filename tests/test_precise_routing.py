"""`balancing = "precise"` against mock engines that publish vLLM's KV-cache events over
real ZMQ: a prompt another client warmed on one engine is sent there, as its engine says
it holds it (cache_aware, which only knows what its own router sent, cannot); a router
started after the engines knows the same from their replay sockets; the engines' own
cached-token counts confirm every prediction. Real processes on loopback."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleet import wait_until
from procs import Proc, Procs, free_port, metric

BLOCK = 16
WORDS = 200  # a prompt of about 200 tokens: 12 full blocks


@pytest.fixture
def engines(procs: Procs) -> Iterator[list[tuple[Proc, int, int]]]:
    """Two mock engines with the scheduler model, publishing events and replays."""
    out = []
    for _ in range(2):
        events, replay = free_port(), free_port()
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        proc = procs.mock(
            "m",
            "--mock-kv-blocks", "512", "--mock-block-size", str(BLOCK),
            "--mock-tokens", "4", "--mock-prefill-tps", "200000",
            "--kv-events-config", json.dumps(config),
        )  # fmt: skip
        out.append((proc, events, replay))
    yield out


def router_of(procs: Procs, engines: list[tuple[Proc, int, int]], balancing: str) -> Proc:
    items = ", ".join(
        f'{{ url = "{proc.url}", kv_events = "tcp://127.0.0.1:{events}", '
        f'kv_replay = "tcp://127.0.0.1:{replay}" }}'
        for proc, events, replay in engines
    )
    return procs.router(
        f'[router]\nbalancing = "{balancing}"\nhealth_interval_s = 0.5\n'
        f'[[models]]\nname = "m"\nendpoints = [{items}]\n'
    )


def chat(prompt: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(100_000)}" for _ in range(WORDS)) for _ in range(count)]


def cached(answer: httpx.Response) -> int:
    details = answer.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def fed(client: httpx.Client, router: Proc, engines: list[tuple[Proc, int, int]]) -> bool:
    """Whether the router holds blocks of every engine, from that engine's own events."""
    page = client.get(router.url + "/metrics").text
    return all(
        metric(page, "llmgw_kv_event_batches_total", endpoint=e.url) > 0
        and metric(page, "llmgw_prefix_index_entries", model="m", endpoint=e.url) > 0
        for e, _, _ in engines
    )


def test_precise_sends_a_prompt_where_its_engine_says_it_is_cached(
    procs: Procs, engines: list[tuple[Proc, int, int]]
) -> None:
    router = router_of(procs, engines, "precise")
    warm = prompts(6, seed=1)
    with httpx.Client(timeout=10) as client:
        # Another client warms each prompt on one engine, directly: this router saw none.
        home = {}
        for i, prompt in enumerate(warm):
            engine = engines[i % 2][0]
            assert client.post(engine.url + "/v1/chat/completions", json=chat(prompt)).is_success
            home[prompt] = engine.url

        wait_until(lambda: fed(client, router, engines), 10, what="both engines' events")
        for prompt in warm:
            answer = client.post(router.url + "/v1/chat/completions", json=chat(prompt))
            assert answer.is_success, answer.text
            # The engine it reached had it cached: all its full blocks but the last token's.
            assert cached(answer) >= (WORDS // BLOCK - 1) * BLOCK, (answer.json()["usage"], home[prompt])
        page = client.get(router.url + "/metrics").text
        assert metric(page, "llmgw_balancing_decisions_total", model="m", kind="precise_hit") == 6

        # A router started now knows the same within a second of its start: the replay.
        late = router_of(procs, engines, "precise")
        wait_until(lambda: fed(client, late, engines), 5, what="the late router's replay")
        for prompt in warm:
            answer = client.post(late.url + "/v1/chat/completions", json=chat(prompt))
            assert cached(answer) >= (WORDS // BLOCK - 1) * BLOCK
        page = client.get(late.url + "/metrics").text
        assert metric(page, "llmgw_balancing_decisions_total", model="m", kind="precise_hit") == 6
