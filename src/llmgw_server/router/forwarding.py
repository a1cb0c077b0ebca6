"""Carrying out a request's attempts (router.request_plan decides them): open an
exchange with the replica chosen, read the answer's head, relay the answer or keep the
refusal, continue a stream that broke on another replica (router.continuation), and
answer the client once the plan gives up."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence

import trio

from llmgw_core.config import RouterSection
from llmgw_core.logsafe import escaped
from llmgw_core.ratelog import RateLimit
from llmgw_http.server import Request
from llmgw_server.router.balancer import Balancer, Replica, Verdict, busy_pause_s
from llmgw_server.router.continuation import (
    Rejoin,
    Spent,
    Unsafe,
    WholeEvents,
    asking_ids,
    continued_body,
    without_ids,
)
from llmgw_server.router.headers import content_type_of, end_to_end, header
from llmgw_server.router.kept_stream import KeepBudget, KeptStream
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
_CHAT = b"/v1/chat/completions"
_COMPLETIONS = b"/v1/completions"
_SSE = b"text/event-stream"
_DONE_EVENT = b"data: [DONE]\n\n"
_ASKED_IDS = b'"return_token_ids"'


class _Broke:
    """A relayed stream broke after its head, where another replica may continue it."""

    __slots__ = ("cause", "why")

    def __init__(self, why: str, cause: str) -> None:
        self.why = why
        self.cause = cause  # for /metrics: broke, silent, drain


class _Rest:
    """What asks another replica for the rest of a broken stream, and its rewriting."""

    __slots__ = ("body", "broke", "rejoin")

    def __init__(self, body: bytes, rejoin: Rejoin, broke: _Broke) -> None:
        self.body = body
        self.rejoin = rejoin
        self.broke = broke


class Forwarder:
    def __init__(self, tuning: RouterSection, metrics: RouterMetrics, served: ServedModels) -> None:
        self.tuning = tuning
        self.metrics = metrics
        self.served = served
        self._5xx_log = RateLimit(period_s=10.0)
        self.keep_budget = KeepBudget(tuning.migrate_keep_total_tokens)

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
        tuning = self.tuning
        chat = request.path == _CHAT
        keeper = None
        strip = False  # the ids in the engine's events are the router's, not the client's
        continuable = chat or request.path == _COMPLETIONS
        if stream and tuning.migrate_max and pinned is None and continuable:
            keeper = KeptStream(tuning.migrate_keep_tokens, self.keep_budget)
            strip = self._gives_ids(model) and _ASKED_IDS not in request.body
        plan = Attempts(1 + tuning.retries, pinned, tuning.migrate_max if keeper else 0)

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

        rest: _Rest | None = None  # once the stream broke: the continuation to send
        try:
            while True:
                step = plan.next(choose)
                if isinstance(step, Relayed):
                    return
                if isinstance(step, GiveUp):
                    if rest is not None:
                        why = f"{rest.broke.why}; no replica continued it"
                        await self._stream_broke(model, responder, why, rest.broke, "failed")
                    else:
                        await self._give_up(model, responder, step)
                    return
                choice = step.choice
                replica = choice.replica
                self.metrics.chose(model, choice, prompt, first=not step.attempt)
                record = responder.record
                record.cached_predicted = choice.matched_tokens
                record.replica = replica.endpoint.url
                if step.attempt and rest is None:
                    self.metrics.retries[model] += 1
                balancer.sent(replica)
                try:
                    if rest is not None:
                        body, rejoin = rest.body, rest.rejoin
                    else:
                        body = request.body if body_for is None else body_for(replica)
                        if strip:
                            body = asking_ids(body)
                        rejoin = None
                    broke = await self._attempt(
                        model, balancer, replica, plan, request, headers, body, responder,
                        stream, keeper, rejoin, strip,
                    )  # fmt: skip
                finally:
                    balancer.finished(replica)
                if rest is not None and plan.relayed:
                    record.migrated += 1
                    self.metrics.migrations[(model, rest.broke.cause, "continued")] += 1
                if broke is not None:
                    assert keeper is not None
                    rest = await self._rest(model, chat, request.body, plan, keeper, broke,
                                            responder)  # fmt: skip
                    if rest is None:
                        return
                elif plan.relayed:  # as plan.next would say: the client has its answer
                    return
        finally:
            if keeper is not None:
                keeper.release()

    async def _rest(
        self,
        model: str,
        chat: bool,
        raw: bytes,
        plan: Attempts,
        keeper: KeptStream,
        broke: _Broke,
        responder: RecordingResponder,
    ) -> _Rest | None:
        """The continuation of a stream that broke; None once the stream is ended (it
        could not go on, or had nothing left to say)."""
        if not plan.broke():
            await self._stream_broke(model, responder, broke.why, broke, "limit")
            return None
        seam = keeper.read()
        body = json.loads(raw)  # valid: the request was parsed before it was sent
        made = Unsafe(seam) if isinstance(seam, str) else continued_body(chat, body, seam)
        if isinstance(made, Unsafe) or isinstance(seam, str):
            why = f"{broke.why}; not continued: {made.why if isinstance(made, Unsafe) else ''}"
            await self._stream_broke(model, responder, why, broke, "unsafe")
            return None
        if isinstance(made, Spent):
            self.metrics.migrations[(model, broke.cause, "spent")] += 1
            await responder.send(_DONE_EVENT)
            await responder.end()
            return None
        options = body.get("stream_options")
        wanted = isinstance(options, dict) and options.get("include_usage") is True
        if self.tuning.migrate_seam_comment:
            await responder.comment(b"migrated")
        return _Rest(made, Rejoin(chat, seam, wanted), broke)

    async def _stream_broke(
        self, model: str, responder: RecordingResponder, why: str, broke: _Broke, outcome: str
    ) -> None:
        """End a stream that broke and does not go on: an error event, as clients expect."""
        self.metrics.migrations[(model, broke.cause, outcome)] += 1
        event = responder.errors.event(502, f"the engine stream broke: {why}")
        await responder.send(event)
        await responder.end()

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
        keeper: KeptStream | None = None,
        rejoin: Rejoin | None = None,
        strip: bool = False,
    ) -> _Broke | None:
        """One send: the answer relayed (the plan then gives up at once), or its refusal
        told to the plan; a relayed stream that broke where it may go on says how."""
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
            return None
        try:
            ttfb = time.monotonic() - started
            status = exchange.status
            if rejoin is not None and 200 <= status < 300 and not _sse(exchange.headers):
                status = 502  # a continuation must stream: this one cannot go on the client's
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
                return None
            if rejoin is not None:
                assert keeper is not None
                return await self._relay_rest(model, balancer, replica, exchange, responder,
                                              rejoin, keeper, strip)  # fmt: skip
            self.metrics.ttfb[model].observe(ttfb)
            meters = self.served.meters
            if meters:
                meter = meters.get(self.served.adapters.get(model, model))
                if meter is not None:
                    meter.first_byte(ttfb)
            broke = await self._relay(model, balancer, replica, exchange, responder, stream,
                                      keeper, strip)  # fmt: skip
            self.metrics.latency[model].observe(time.monotonic() - started)
            return broke
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
        keeper: KeptStream | None,
        strip: bool,
    ) -> _Broke | None:
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
            return None
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
                return None
            balancer.succeeded(replica)
            await responder.whole(exchange.status, body, headers)
            return None
        if length is not None:
            headers.append((b"content-length", b"%d" % length))
        await responder.start(exchange.status, headers)
        try:
            if keeper is not None:
                await _relay_kept(exchange, responder, keeper, strip, framed)
            elif not framed and exchange.chunked and responder.chunked:
                await exchange.relay_chunks(responder.send_chunks)
            else:
                async for data in exchange.body():
                    await responder.send(data)
        except UpstreamError as exc:
            self.failed(model, balancer, replica, str(exc))
            self.log_5xx(model, replica, 502, f"the answer broke off after its head: {exc}")
            # An error event only where the client's stream is whole so far; an answer
            # that broke HTTP's framing ends with the client's connection closed.
            if _sse(exchange.headers) and not framed and not exc.broken and not exchange.mid_chunk:
                if keeper is not None and 200 <= exchange.status < 300:
                    return _Broke(str(exc), _cause(replica, exc))
                event = responder.errors.event(502, f"the engine stream broke: {exc}")
                await responder.send(event)
                await responder.end()
            else:
                await responder.abort()
            return None
        balancer.succeeded(replica)
        await responder.end()
        return None

    async def _relay_rest(
        self,
        model: str,
        balancer: Balancer,
        replica: Replica,
        exchange: Exchange,
        responder: RecordingResponder,
        rejoin: Rejoin,
        keeper: KeptStream,
        strip: bool,
    ) -> _Broke | None:
        """A continuation's events, rewritten into the client's stream (head sent)."""
        try:
            async for data in exchange.body():
                out = rejoin.feed(data)
                if out:
                    keeper.feed(out)
                    await responder.send(without_ids(out) if strip else out)
        except UpstreamError as exc:
            self.failed(model, balancer, replica, str(exc))
            self.log_5xx(model, replica, 502, f"a continuation broke off: {exc}")
            if exc.broken:
                await responder.abort()
                return None
            return _Broke(str(exc), _cause(replica, exc))
        balancer.succeeded(replica)
        await responder.end()
        return None

    def _gives_ids(self, model: str) -> bool:
        """Whether the model's engines give token ids with their events (vLLM's
        return_token_ids), as its card from their /v1/models says who they are."""
        card = self.served.cards.get(self.served.adapters.get(model, model))
        return card is not None and card.get("owned_by") == "vllm"

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


async def _relay_kept(
    exchange: Exchange,
    responder: RecordingResponder,
    keeper: KeptStream,
    strip: bool,
    framed: bool,
) -> None:
    """A stream relayed as it is written, kept for a continuation; the ids the router
    asked for (`strip`) written over with spaces, so that each chunk goes on as it came."""
    if not framed and exchange.chunked and responder.chunked:
        keep = keeper.feed_framed_blanked if strip else keeper.feed_framed
        await exchange.relay_chunks(responder.send_chunks, keep)
    elif strip:
        events = WholeEvents()
        async for data in exchange.body():
            whole = events.feed(data)
            if whole:
                keeper.feed(whole)
                await responder.send(without_ids(whole))
        left = events.left()
        if left:
            await responder.send(without_ids(left))
    else:
        async for data in exchange.body():
            keeper.feed(data)
            await responder.send(data)


def _sse(headers: list[tuple[bytes, bytes]]) -> bool:
    return header(headers, b"content-type").startswith(_SSE)


def _cause(replica: Replica, exc: UpstreamError) -> str:
    """Why a stream broke, as /metrics counts migrations: the replica was lost (the route
    table dropped it undrained: its streams were cut), it was draining (its drain's
    timeout ended the engine), the engine went silent, or it broke the stream."""
    if replica.lost:
        return "lost"
    if replica.draining:
        return "drain"
    return "silent" if exc.idle else "broke"
