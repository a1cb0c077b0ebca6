"""Holding a request while its model has no serving replica (scaled to zero, waking, or
just after a restart), oldest first, within the bounds meter.hold_refusal decides; and
answering 503 with Retry-After when it cannot be held or no replica came in time."""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from llmgw_core.config import RouterSection
from llmgw_core.logsafe import escaped
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.headers import content_type_of
from llmgw_server.router.meter import ModelMeter, hold_refusal
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.recorder import RecordingResponder
from llmgw_server.router.served import ServedModels

# A held request refused (its model's queue full, or no replica in hold_timeout_s) is
# told to come back this much later: a waking engine may serve by then.
HOLD_RETRY_AFTER_S = 5
# A held stream's `: ping` comments come this often: well inside the idle timeouts of
# proxies (nginx's and AWS ALB's are 60 s) and the read timeouts clients set.
HELD_PING_S = 10.0

Log5xx = Callable[[str, Replica | None, int, str], None]


class Holds:
    def __init__(
        self, tuning: RouterSection, metrics: RouterMetrics, served: ServedModels, log_5xx: Log5xx
    ) -> None:
        self.tuning = tuning
        self.metrics = metrics
        self.served = served
        self.log_5xx = log_5xx

    async def held(
        self,
        model: str,
        balancer: Balancer,
        meter: ModelMeter,
        responder: RecordingResponder,
        size: int,
        stream: bool,
    ) -> bool:
        """Hold a request (request_plan.admit said so) until a replica of its model
        serves, oldest first: True once one may serve it; False when it was answered 503
        with Retry-After (the model's queue or a byte budget is full, or `hold_timeout_s`
        passed). `size`: its body's bytes.

        A `stream` request, once held, is sent its answer's head and a comment at once,
        then a `: ping` every HELD_PING_S: its client sees bytes while the model wakes
        (and a proxy's idle timeout is not reached); past `hold_timeout_s` its stream ends
        with an error event, and the engine's answer is relayed as events after it
        (RecordingResponder.early)."""
        tuning = self.tuning
        refused = hold_refusal(model, meter, size, self.served.held_bytes(), tuning)
        if refused is not None:
            await self.refuse(model, responder, *refused)
            return False
        meter.held += 1
        meter.held_bytes += size
        metrics = self.metrics
        metrics.held[model] += 1
        metrics.held_bytes[model] += size
        self.served.load_wanted()
        started = trio.current_time()
        try:
            with trio.move_on_after(tuning.hold_timeout_s):
                if stream:
                    await responder.start_early()
                    waiting = f"waiting for a replica of {escaped(model)} to start"
                    await responder.comment(waiting.encode())
                ping_s = HELD_PING_S if stream else math.inf
                meters = self.served.meters
                while meters.get(model) is meter and not balancer.healthy_count:
                    with trio.move_on_after(ping_s) as waited:
                        await meter.wait_served()
                    if waited.cancelled_caught:
                        await responder.comment(b"ping")
                return True
        finally:
            meter.held -= 1
            meter.held_bytes -= size
            metrics.held[model] -= 1
            metrics.held_bytes[model] -= size
            queued = responder.record.queued_s = trio.current_time() - started
            metrics.queued[model].observe(queued)
        message = f"no replica of the model {model!r} served within {tuning.hold_timeout_s:g} s"
        await self.refuse(model, responder, "timeout", message)
        return False

    async def refuse(
        self, model: str, responder: RecordingResponder, reason: str, message: str
    ) -> None:
        """Answer 503 with Retry-After: not held (`reason`, as /metrics counts it)."""
        self.metrics.held_refused[(model, reason)] += 1
        self.log_5xx(model, None, 503, message)
        body = responder.errors.body(503, message, None)
        retry = (b"retry-after", b"%d" % HOLD_RETRY_AFTER_S)
        await responder.whole(503, body, [*content_type_of(body), retry])
