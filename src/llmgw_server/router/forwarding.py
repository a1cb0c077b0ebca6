"""Carrying out a request's attempts (router.request_plan decides them): open an
exchange with the replica chosen, read the answer's head, relay the answer or keep the
refusal, and answer the client once the plan gives up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import trio

from llmgw_core.config import RouterSection
from llmgw_core.logsafe import escaped
from llmgw_core.ratelog import RateLimit
from llmgw_http.server import Request
from llmgw_server.router.balancer import Balancer, Replica, Verdict, busy_pause_s
from llmgw_server.router.headers import content_type_of, end_to_end, header
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.policies import Choice
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.recorder import RecordingResponder
from llmgw_server.router.request_plan import Attempts, GiveUp, Refusal, Relayed
from llmgw_server.router.served import ServedModels
from llmgw_server.router.upstream import Exchange, UpstreamError

log = logging.getLogger("llmgw.router")

_ERROR_BODY_LIMIT = 1024 * 1024
_WHOLE_LIMIT = 1024 * 1024


class Forwarder:
    def __init__(self, tuning: RouterSection, metrics: RouterMetrics, served: ServedModels) -> None:
        self.tuning = tuning
        self.metrics = metrics
        self.served = served
        self._5xx_log = RateLimit(period_s=10.0)

    async def forward(
        self,
        model: str,
        balancer: Balancer,
        request: Request,
        responder: RecordingResponder,
        stream: bool,
        session: str | None,
        prompt: PromptKey | None,
        *,
        pinned: Replica | None = None,
        body_for: Callable[[Replica], bytes] | None = None,
        full: Callable[[Replica], bool] | None = None,
    ) -> None:
        """Relay the request to a replica, retrying others before the first byte. A
        `pinned` replica is tried alone (it holds what the request names); `body_for`
        gives the body each replica tried is sent, the request's own by default; `full`
        says which replicas are at their load bound (router.fair_gate)."""
        headers = end_to_end(request.headers)
        plan = Attempts(1 + self.tuning.retries, pinned)

        def choose(tried: Sequence[Replica]) -> Choice | None:
            exclude: Sequence[Replica] = tried
            if full is not None and not tried:
                # The first attempt goes to a replica below its load bound (the fair
                # queue let the request through because one is); a retry to any.
                busy = [r for r in balancer.replicas if full(r)]
                if busy and len(busy) < len(balancer.replicas):
                    exclude = busy
            return balancer.choose(
                exclude=exclude, session=session, now=trio.current_time(), prompt=prompt
            )

        while True:
            step = plan.next(choose)
            if isinstance(step, Relayed):
                return
            if isinstance(step, GiveUp):
                await self._give_up(model, responder, step)
                return
            choice = step.choice
            replica = choice.replica
            self.metrics.chose(model, choice, prompt, first=not step.attempt)
            record = responder.record
            record.cached_predicted = choice.matched_tokens
            record.replica = replica.endpoint.url
            if step.attempt:
                self.metrics.retries[model] += 1
            balancer.sent(replica)
            try:
                body = request.body if body_for is None else body_for(replica)
                await self._attempt(model, balancer, replica, plan, request, headers, body,
                                    responder, stream)  # fmt: skip
            finally:
                balancer.finished(replica)
            if plan.relayed:  # as plan.next would say: the client has its answer
                return

    async def _attempt(
        self,
        model: str,
        balancer: Balancer,
        replica: Replica,
        plan: Attempts,
        request: Request,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        responder: RecordingResponder,
        stream: bool,
    ) -> None:
        """One send: the answer relayed (the plan then gives up at once), or its refusal
        told to the plan."""
        started = time.monotonic()
        try:
            exchange = await self.served.pools[replica.endpoint].open(
                request.method, request.target, headers, body, self.tuning.first_byte_timeout_s
            )
        except UpstreamError as exc:
            status = 504 if exc.timed_out else 502
            plan.refused(Refusal(status, responder.errors.body(status, str(exc), None), replica,
                                 str(exc)))  # fmt: skip
            self.failed(model, balancer, replica, str(exc))
            return
        try:
            ttfb = time.monotonic() - started
            status = exchange.status
            verdict = plan.answered(status)
            if verdict is not Verdict.RELAY:
                try:
                    text = await exchange.read_body(_ERROR_BODY_LIMIT)
                except UpstreamError:
                    message = f"{replica.endpoint} answered {status}"
                    text = responder.errors.body(502, message, None)
                why = f"answered {status}"
                retry_after = header(exchange.headers, b"retry-after")
                plan.refused(Refusal(status, text, replica, why, retry_after))
                if verdict is Verdict.FAILED:
                    self.failed(model, balancer, replica, why)
                else:  # the engine is alive and says so: not a failure
                    pause = busy_pause_s(retry_after)
                    balancer.busy(replica, pause, trio.current_time())
                return
            self.metrics.ttfb[model].observe(ttfb)
            meters = self.served.meters
            if meters:
                meter = meters.get(self.served.adapters.get(model, model))
                if meter is not None:
                    meter.first_byte(ttfb)
            await self._relay(model, balancer, replica, exchange, responder, stream)
            self.metrics.latency[model].observe(time.monotonic() - started)
        finally:
            exchange.release()

    async def _give_up(self, model: str, responder: RecordingResponder, step: GiveUp) -> None:
        last = step.last
        if last is None:
            message = f"no healthy replica for the model {model!r}"
            self.log_5xx(model, None, 503, message)
            await responder.error(503, message)
            return
        self.log_5xx(model, last.replica, last.status, last.why)
        answer_headers = content_type_of(last.body)
        if last.retry_after:
            answer_headers = [*answer_headers, (b"retry-after", last.retry_after)]
        await responder.whole(last.status, last.body, answer_headers)

    async def _relay(
        self,
        model: str,
        balancer: Balancer,
        replica: Replica,
        exchange: Exchange,
        responder: RecordingResponder,
        stream: bool,
    ) -> None:
        headers = end_to_end(exchange.headers)
        if exchange.status >= 500:  # an answer such as 501, relayed as the engine gave it
            self.log_5xx(model, replica, exchange.status, "relayed the engine's answer")
        if responder.early and not 200 <= exchange.status < 300:
            # A held stream's head went out: the engine's refusal ends it as an error event.
            try:
                body = await exchange.read_body(_ERROR_BODY_LIMIT)
            except UpstreamError:
                body = b""
            said = body or b"the engine answered %d" % exchange.status
            await responder.whole(exchange.status, said)
            return
        length = exchange.content_length
        framed = length is not None
        if length is not None and length <= _WHOLE_LIMIT:
            # A small answer goes out in one write: head and body together.
            try:
                body = await exchange.read_body(_WHOLE_LIMIT)
            except UpstreamError as exc:
                self.failed(model, balancer, replica, str(exc))
                self.log_5xx(model, replica, 502, f"the answer broke off: {exc}")
                await responder.error(502, f"the engine's answer broke off: {exc}")
                return
            balancer.succeeded(replica)
            await responder.whole(exchange.status, body, headers)
            return
        if length is not None:
            headers.append((b"content-length", b"%d" % length))
        await responder.start(exchange.status, headers)
        try:
            if not framed and exchange.chunked and responder.chunked:
                await exchange.relay_chunks(responder.send_chunks)
            else:
                async for data in exchange.body():
                    await responder.send(data)
        except UpstreamError as exc:
            self.failed(model, balancer, replica, str(exc))
            self.log_5xx(model, replica, 502, f"the answer broke off after its head: {exc}")
            sse = header(exchange.headers, b"content-type").startswith(b"text/event-stream")
            # An error event only where the client's stream is whole so far; an answer
            # that broke HTTP's framing ends with the client's connection closed.
            if sse and not framed and not exc.broken and not exchange.mid_chunk:
                event = responder.errors.event(502, f"the engine stream broke: {exc}")
                await responder.send(event)
                await responder.end()
            else:
                await responder.abort()
            return
        balancer.succeeded(replica)
        await responder.end()

    def log_5xx(self, model: str, replica: Replica | None, status: int, why: str) -> None:
        """One line per 5xx sent or relayed, at most one a period for each model and replica."""
        where = str(replica.endpoint) if replica is not None else "-"
        suppressed = self._5xx_log.allow((model, where, status), trio.current_time())
        if suppressed is None:
            return
        more = f" ({suppressed} more since the last line)" if suppressed else ""
        # `why` may quote the engine's own answer: escaped, one line whatever it sent.
        log.warning("%d for %s from replica %s: %s%s", status, model, where, escaped(why), more)

    def failed(self, model: str, balancer: Balancer, replica: Replica, why: str) -> None:
        self.served.traffic.failed(self.served.adapters.get(model, model), replica.endpoint.url)
        if balancer.failed(replica, trio.current_time()):
            self.metrics.ejections[(model, replica.endpoint.url)] += 1
            log.warning(
                "ejected %s for %s after %d failures in a row (last: %s)",
                replica.endpoint,
                model,
                replica.failures,
                why,
            )
