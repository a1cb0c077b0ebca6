"""What a router measures of an autoscaled model for the control plane's autoscaler, and
the requests it holds while no replica serves the model (scaled to zero, or waking).

One `ModelMeter` per autoscaled model (the route table names them), owned by the router;
the request path writes it (`arrived`, `first_byte`, `hold` ... `released`), the route
feed's reporter reads it (`report`) every `LOAD_INTERVAL_S` and at once when a request is
held. Bounds: `MAX_TTFB_SAMPLES` first-byte times a report interval (the latest kept),
and at most `[router] hold_max_per_model` requests held, each at most `hold_timeout_s`,
their bodies within `hold_max_bytes_per_model` a model and `hold_max_bytes` in all
(`hold_refusal`, the one place these are decided).
"""

from __future__ import annotations

import math
from collections import deque

import trio

from llmgw_core.autoscaling import RouterLoad
from llmgw_core.config import RouterSection

MAX_TTFB_SAMPLES = 4096


class ModelMeter:
    def __init__(self) -> None:
        self.held = 0  # requests waiting for a replica to serve
        self.held_bytes = 0  # their bodies'
        self.queued = 0  # requests waiting in its fair queue (router.fair_gate): load too
        self.last_request_at: float | None = None  # trio time of the latest arrival
        self._arrived = 0  # since the last report
        self._ttfb_s: deque[float] = deque(maxlen=MAX_TTFB_SAMPLES)
        self._served = trio.Event()  # set (and replaced) each time replicas may serve

    def arrived(self, now: float) -> None:
        self.last_request_at = now
        self._arrived += 1

    def first_byte(self, seconds: float) -> None:
        self._ttfb_s.append(seconds)

    def may_serve(self) -> None:
        """The model's replicas changed: held requests look again, oldest first."""
        self._served.set()
        self._served = trio.Event()

    async def wait_served(self) -> None:
        await self._served.wait()

    def report(self, now: float, in_flight: int, kv_use: float | None) -> RouterLoad:
        """This interval's load (its first-byte samples and arrivals are consumed)."""
        samples = sorted(self._ttfb_s)
        self._ttfb_s.clear()
        p90 = None
        if samples:
            p90 = samples[min(len(samples) - 1, math.ceil(0.9 * len(samples)) - 1)] * 1000
        idle = None if self.last_request_at is None else max(now - self.last_request_at, 0.0)
        arrived, self._arrived = self._arrived, 0
        waiting = self.held + self.queued
        return RouterLoad(max(in_flight - waiting, 0), waiting, p90, idle, kv_use, arrived)


def hold_refusal(
    model: str, meter: ModelMeter, size: int, held_bytes: int, tuning: RouterSection
) -> tuple[str, str] | None:
    """Why a request for `model` with a body of `size` bytes is not held, while this
    process holds `held_bytes` of bodies for all its models: the reason /metrics counts
    it under and the client's message; None: it is held."""
    if meter.held >= tuning.hold_max_per_model:
        why = f"{meter.held} requests wait for one already"
        return "count", _try_again(model, why)
    if meter.held_bytes + size > tuning.hold_max_bytes_per_model:
        why = (
            f"the requests waiting for one hold {meter.held_bytes} bytes of the "
            f"{tuning.hold_max_bytes_per_model} it may hold"
        )
        return "model_bytes", _try_again(model, why)
    if held_bytes + size > tuning.hold_max_bytes:
        why = (
            f"the requests this router holds for models that no replica serves hold "
            f"{held_bytes} bytes of the {tuning.hold_max_bytes} it may hold"
        )
        return "process_bytes", _try_again(model, why)
    return None


def _try_again(model: str, why: str) -> str:
    return f"no replica of the model {model!r} serves yet and {why}: try again shortly"
