"""One reader and one writer task per websocket, with memory channels between them and
the logic, so a slow consumer never stops the connection's pings (both daemons use them);
and the watch that tells a silent peer from a quiet one.

A peer that vanishes without closing (host powered off, route black-holed) leaves
the socket open: writes still succeed into the kernel's buffer, and TCP would
take its retransmission timeout (~15 minutes) to give up. So the agent counts
the stream dead when nothing has come from the peer for a bound derived from
the heartbeat interval. Any frame the peer sends counts; on a quiet stream a
websocket ping, answered by the peer's websocket library without reaching its
control loop, is sent after half the bound.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio
import trio_websocket

# The agent cuts a stream after this many heartbeat intervals without a frame...
SILENT_INTERVALS = 4.0
# ...but never sooner than this, so a busy peer on a short interval is not cut off...
MIN_CUT_S = 2.0
# ...and, at the control plane's usual interval (5 s), never later than this, so that
# with a redial (after a session that was healthy, the backoff is at most reconnect
# base_s, 0.5 s by default) the node is back within 30 s. A large fleet gives longer
# intervals (the control plane paces its heartbeats): then two intervals and this
# slack, so that a quiet stream is not pinged between its heartbeats' acks.
MAX_CUT_S = 20.0
LONG_INTERVAL_SLACK_S = 10.0


@attrs.frozen
class SilenceBound:
    """After `probe_after_s` without a frame, ask with a ping; after `cut_after_s`, the
    stream is dead."""

    probe_after_s: float
    cut_after_s: float


def silence_bound(heartbeat_interval_s: float) -> SilenceBound:
    """The bound for a stream whose heartbeat interval is `heartbeat_interval_s`: with the
    control plane's 5 s, a ping after 10 s of quiet and a cut after 20 s; with 50 s
    (a paced fleet of 10,000), after 55 s and 110 s."""
    latest = max(MAX_CUT_S, 2 * heartbeat_interval_s + LONG_INTERVAL_SLACK_S)
    cut = min(max(SILENT_INTERVALS * heartbeat_interval_s, MIN_CUT_S), latest)
    return SilenceBound(probe_after_s=cut / 2, cut_after_s=cut)


@attrs.define
class Paced:
    """A stream's heartbeat interval and its silence bound, which the control plane may
    change (a `Pace`): the heartbeat and the silence watch read them at each turn, and
    `changed` wakes a heartbeat waiting on the old interval."""

    interval_s: float
    bound: SilenceBound
    changed: trio.Event = attrs.Factory(trio.Event)

    @classmethod
    def at(cls, interval_s: float) -> Paced:
        return cls(interval_s, silence_bound(interval_s))

    def set(self, interval_s: float) -> None:
        self.interval_s, self.bound = interval_s, silence_bound(interval_s)
        changed, self.changed = self.changed, trio.Event()
        changed.set()


@attrs.define
class Heard:
    """When the peer was last heard from (trio's clock)."""

    at: float

    def now(self) -> None:
        self.at = max(self.at, trio.current_time())


class Pingable(Protocol):
    async def ping(self, payload: bytes | None = None) -> None: ...


async def read_frames(
    ws: trio_websocket.WebSocketConnection,
    inbox: trio.MemorySendChannel[str | bytes],
    on_close: trio.CancelScope | None = None,
    heard: Heard | None = None,
) -> None:
    """Feed every frame into `inbox` (noting it in `heard`); close it (and cancel
    `on_close`) when the peer goes."""
    async with inbox:
        try:
            while True:
                frame = await ws.get_message()
                if heard is not None:
                    heard.now()
                await inbox.send(frame)
        except trio_websocket.ConnectionClosed:
            if on_close is not None:
                on_close.cancel()


async def write_frames(
    ws: trio_websocket.WebSocketConnection,
    outbox: trio.MemoryReceiveChannel[str],
    on_close: trio.CancelScope | None = None,
) -> None:
    """Send everything queued in `outbox`, in order."""
    try:
        async for text in outbox:
            await ws.send_message(text)
    except trio_websocket.ConnectionClosed:
        if on_close is not None:
            on_close.cancel()


def _bound(bound_or_paced: SilenceBound | Paced) -> SilenceBound:
    if isinstance(bound_or_paced, Paced):
        return bound_or_paced.bound
    return bound_or_paced


async def cut_when_silent(
    ws: Pingable, heard: Heard, bound_or_paced: SilenceBound | Paced, cut: trio.CancelScope
) -> None:
    """Cancel `cut` once nothing (no frame, no pong) has come for the bound's `cut_after_s`
    (a paced stream's bound as it is at each turn), a ping having gone unanswered for the
    last `cut_after_s - probe_after_s` of it.

    The ping's answer window is counted from when the ping goes out: when this process
    itself stalled (a GC pause, a starved CPU, a paused VM) past the bound, the peer's
    frames wait unread in the socket, and the stall is not the peer's silence.

    Returns without cutting when the connection closes: the reader reports that.
    """
    try:
        while True:
            bound = _bound(bound_or_paced)
            quiet_since = heard.at
            await trio.sleep_until(quiet_since + bound.probe_after_s)
            if heard.at > quiet_since:
                continue  # a frame came meanwhile: no need to ask
            answer_window = bound.cut_after_s - bound.probe_after_s
            answer_by = max(quiet_since + bound.cut_after_s, trio.current_time() + answer_window)
            with trio.move_on_at(answer_by):
                await ws.ping()
                heard.now()
            if heard.at == quiet_since:
                cut.cancel()
                return
    except trio_websocket.ConnectionClosed:
        return
