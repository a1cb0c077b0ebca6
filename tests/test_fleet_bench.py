"""bench/fleet_bench.py's arithmetic: a quantile of a Prometheus histogram is the upper
bound of the first bucket whose cumulative count reaches it; the simulator's words
for why a session failed; and the simulator following the leader of several control
planes as the agent does (the failover bench's fleet)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fleet_bench as bench
import fleet_sim
import trio
import trio_websocket

from llmgw_core.dial import ConnectFailed
from llmgw_core.wire import (
    NOT_LEADER_CLOSE,
    PROTOCOL,
    Welcome,
    encode,
    not_leader_reason,
    stale_epoch_reason,
)

NAME = "llmgw_control_reconcile_seconds"


def page(counts: list[tuple[str, int]]) -> str:
    lines = ["# HELP x", f"# TYPE {NAME} histogram", 'other_bucket{le="1"} 99']
    lines += [f'{NAME}_bucket{{le="{bound}"}} {count}' for bound, count in counts]
    return "\n".join([*lines, f"{NAME}_sum 1.5", f"{NAME}_count {counts[-1][1]}"])


def test_quantiles_are_bucket_bounds() -> None:
    text = page([("0.005", 50), ("0.01", 98), ("0.025", 99), ("0.05", 100), ("+Inf", 100)])
    assert bench.histogram_bounds(text, NAME, (0.5, 0.98, 0.99, 1.0)) == (
        100,
        [0.005, 0.01, 0.025, 0.05],
    )


def test_a_quantile_past_every_finite_bound_is_infinite() -> None:
    text = page([("0.005", 10), ("+Inf", 100)])
    assert bench.histogram_bounds(text, NAME, (0.05, 0.5)) == (100, [0.005, math.inf])


def test_no_histogram_means_no_steps() -> None:
    assert bench.histogram_bounds("nothing here", NAME, (0.99,)) == (0, [math.inf])


# -- the simulator's words for a failed session -------------------------------------


def test_a_failure_is_named_by_its_cause_never_by_the_address() -> None:
    """The last 10,000-node run's table cut 'cannot connect to 127.0.0.1:34843: Error
    connecting to ('127' at 60 characters: the cause was lost."""
    cases = {
        "cannot connect to 127.0.0.1:34843: Error connecting to ('127.0.0.1', 34843): "
        "[Errno 104] Connection reset by peer": "cannot connect to [Errno 104] Connection reset by peer",
        "127.0.0.1:34843 closed the connection during the TLS handshake": (
            "closed the connection during the TLS handshake"
        ),
        "refused by the control plane: HTTP 503: busy registering others": (
            "refused by the control plane: HTTP 503"
        ),
        "connection refused by 127.0.0.1:5: nothing listens there": "refused",
        "no answer from the control plane at 127.0.0.1:3 within 45 s (timeout, during the "
        "TLS handshake)": "no answer (timeout, during the TLS handshake)",
    }
    for text, why in cases.items():
        assert fleet_sim.why_failed(ConnectFailed(text)) == why
        assert fleet_sim.why_failed(ExceptionGroup("x", [ConnectFailed(text)])) == why
    assert fleet_sim.why_failed(trio.TooSlowError()) == "TooSlowError"


# -- the simulator follows the leader as the agent does ------------------------------


def _worker(urls: list[str]) -> fleet_sim.Worker:
    args = argparse.Namespace(
        url=",".join(urls), first=0, count=1, boot_s=0.0, certs=None, own_addresses=False
    )
    return fleet_sim.Worker(args)


async def _plane(
    nursery: trio.Nursery, answer: Callable[[trio_websocket.WebSocketConnection], Awaitable[None]]
) -> tuple[str, list[str]]:
    """A fake control plane on a free port: each stream gets `answer` after the agent's
    register; returns its agent URL and the close reasons the agent gave."""
    reasons: list[str] = []

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()  # the register
        try:
            await answer(ws)
            await ws.get_message()
        except trio_websocket.ConnectionClosed as closed:
            if closed.reason is not None and closed.reason.reason:
                reasons.append(closed.reason.reason)

    server = await nursery.start(
        partial(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, ssl_context=None)
    )
    return f"ws://127.0.0.1:{server.port}/v1/agent", reasons


async def test_a_simulated_agent_goes_where_a_standby_names_the_leader() -> None:
    async def standby(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.aclose(code=NOT_LEADER_CLOSE, reason=not_leader_reason(leader_url))

    async def leader(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0, epoch=7)))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            standby_url, _ = await _plane(nursery, standby)
            leader_url, _ = await _plane(nursery, leader)
            worker = _worker([standby_url, leader_url])
            nursery.start_soon(worker.agent, 0, 0.0)
            while 0 not in worker.registered:
                await trio.sleep(0.01)
            assert worker.registered_epoch == {0: 7}
            assert worker.epochs == {0: 7}
            assert worker.moves == {"not leader": 1}
            nursery.cancel_scope.cancel()


async def test_a_simulated_agent_refuses_a_stale_welcome_and_tries_the_next() -> None:
    async def stale(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0, epoch=7)))

    async def current(ws: trio_websocket.WebSocketConnection) -> None:
        await ws.send_message(encode(Welcome(PROTOCOL, 5.0, epoch=9)))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            stale_url, reasons = await _plane(nursery, stale)
            current_url, _ = await _plane(nursery, current)
            worker = _worker([stale_url, current_url])
            worker.epochs[0] = 9  # seen before: the first control plane leads no more
            nursery.start_soon(worker.agent, 0, 0.0)
            while 0 not in worker.registered:
                await trio.sleep(0.01)
            assert worker.registered_epoch == {0: 9}
            assert worker.stale_welcomes == 1
            assert reasons == [stale_epoch_reason(7, 9)]
            nursery.cancel_scope.cancel()
