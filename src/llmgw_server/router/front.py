"""The OpenAI-compatible front: authenticate, name the model, admit, hand the request to
its attempts (router.request_plan decides, router.forwarding carries out), record.

A request's path, in order: `handle` (its id, its record) -> `_route` (which kind of
path) -> `_proxy` (the key may use the model; the model is served; a stored response
pins its replica; the policy's prompt key) -> `request_plan.admit` (forward, or
`Holds.held` while no replica serves) -> `Forwarder.forward` (attempts: pick, send,
relay or retry, give up) -> `Outcomes.finished` (metrics, traffic, access log).
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Literal, NamedTuple

import attrs
import trio

from llmgw_core.config import Config, ServerSection
from llmgw_core.openai_errors import ANTHROPIC
from llmgw_core.tenant_limits import TenantLimiter
from llmgw_core.tomlshape import closest
from llmgw_http.server import JSON, Request, Responder, ServerLimits
from llmgw_server.reload import ReloadPlan, plan_reload, reloaded_config
from llmgw_server.route_feed.messages import Shares, Usage
from llmgw_server.router.access_log import FORMATTERS, AccessRecord, key_id_of, valid_request_id
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.fair_gate import QUEUE_RETRY_S, Entry, ModelGate
from llmgw_server.router.forwarding import Forwarder
from llmgw_server.router.headers import client_key
from llmgw_server.router.holding import Holds
from llmgw_server.router.meter import ModelMeter
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.outcomes import Outcomes
from llmgw_server.router.policies import spec_of
from llmgw_server.router.policy_needs import PolicyNeeds
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.recorder import LineWriter, RecordingResponder, new_request_id
from llmgw_server.router.request_plan import Admission, admit
from llmgw_server.router.routes import (
    ANTHROPIC_PATHS,
    NOT_PLAIN,
    FormRefused,
    Kind,
    Routes,
    form_model,
)
from llmgw_server.router.served import ServedModels, holder_replica
from llmgw_server.router.stored import (
    RESPONSES,
    holder_of,
    is_stored_path,
    mint,
    stored_path_id,
    with_response_id,
)
from llmgw_server.router.tenancy import (
    Admitted,
    Refused,
    Tenancy,
    charged_tokens,
    refusal_message,
    render_tenancy,
    reservation,
    retry_headers,
)
from llmgw_server.router.traffic_meter import TrafficMeter

_CHAT = b"/v1/chat/completions"
_COMPLETIONS = b"/v1/completions"
_REQUEST_ID = b"x-request-id"
_CLIENT_GONE = (trio.Cancelled, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)
_NO_KEY = "a valid API key is required (Authorization: Bearer)"
# A request refused by this process's share of a shared limit waits this long for its hub
# to raise the share (reports go every 0.25 s; a grant follows the next), at most this
# many at once in a process, their bodies (already read) within this many bytes.
BORROW_WAIT_S = 1.5
BORROW_MAX = 256
BORROW_MAX_BYTES = 64 * 1024 * 1024


def server_limits(s: ServerSection) -> ServerLimits:
    """The inference port's limits, as `[server]` sets them (every process serving it)."""
    return ServerLimits(
        max_body_bytes=s.max_body_bytes,
        header_timeout_s=s.header_timeout_s,
        body_timeout_s=s.body_timeout_s,
        keepalive_timeout_s=s.keepalive_timeout_s,
        max_connections=s.max_connections,
        min_body_rate=s.min_body_rate,
    )


class _Named(NamedTuple):
    """A relayed request's model, and its JSON body parsed ({} for a form)."""

    model: str
    body: dict[str, object]


class Router:
    """`metrics_page`: the page of every worker (router.workers) in place of this
    process's own; `answer_headers`: in the head of every answer (a worker's name)."""

    def __init__(
        self,
        config: Config,
        *,
        metrics_page: Callable[[], Awaitable[bytes]] | None = None,
        answer_headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.config = config
        self.tuning = config.router
        self.keys = config.auth.keys  # digest -> the models it may use (None: all)
        self.routes = Routes(config.router.extra_paths)
        self.metrics = RouterMetrics()
        # What the configured policy declares it needs (policies.policy.Needs): its
        # per-process state (precise: what each engine holds, by its KV-cache events),
        # the service that tokenizes prompts (None where it reads no token ids), the
        # feed the wiring starts, its families on /metrics.
        self.needs = PolicyNeeds(spec_of(config.router.balancing), self.metrics.tokenize_refused)
        self.served = ServedModels(config, self.metrics, TrafficMeter(), self.needs.shared)
        self.forwarder = Forwarder(self.tuning, self.metrics, self.served)
        self.holds = Holds(self.tuning, self.metrics, self.served, self.forwarder.log_5xx)
        self.tokenizer = self.needs.tokens
        self._policy_metrics = self.needs.metrics()
        self._tokenize_turn = 0
        self.ready = False  # the first health probe round is done
        self.draining = False
        s = config.server
        self.metrics_token = s.metrics_token_digest  # None: /metrics is open
        self.access_log = (
            LineWriter(FORMATTERS[s.access_log_format], s.access_log_file) if s.access_log else None
        )
        self.outcomes = Outcomes(self.metrics, self.served, self.keys, self.access_log)
        self.tenancy = Tenancy(config)
        self._granted = trio.Event()  # set (and made anew) when a hub's grant applies
        self._borrowing = 0  # requests waiting for a raised share (_borrow)
        self._borrowed_bytes = 0  # and their bodies
        self.gates: dict[str, ModelGate] = {}  # model -> its fair queue (replica_max_in_flight)
        self.metrics_page = metrics_page
        self.answer_headers = answer_headers

    def reload(self, config: Config) -> ReloadPlan:
        """Take the API keys, metrics token and static models of `config` (router.reload);
        requests in flight finish where they are."""
        plan = plan_reload(self.config, config)
        self.config = reloaded_config(self.config, config)
        self.keys = self.outcomes.keys = self.config.auth.keys
        self.tenancy.reload(self.config)
        self.metrics_token = self.config.server.metrics_token_digest
        self.served.reload(self.config, plan)
        return plan

    # -- shares of the tenants' limits (route_feed.follower.ShareTarget) ------------

    def share_usage(self) -> Usage | None:
        totals, have, used, wanted = self.tenancy.usage(trio.current_time())
        if not totals:
            return None
        return Usage(self.tenancy.shares_version, totals, have, used, wanted)

    def apply_shares(self, shares: Shares) -> None:
        self.tenancy.apply_shares(shares.version, shares.shares, shares.full)
        self._granted.set()
        self._granted = trio.Event()

    async def _borrow(
        self,
        tenant: str,
        limiters: tuple[TenantLimiter, ...],
        tokens: int,
        refused: Refused,
        size: int,
    ) -> Admitted | Refused:
        """A request refused by this process's share of a limit that the router processes
        enforce together: its refused demand goes to the hub in the next report (every
        0.25 s), which raises this share where the others leave room. The request waits
        for the grants of the next BORROW_WAIT_S, tried again after each, rather than
        sending its client away while the fleet has room; at most BORROW_MAX wait at once
        in a process, their bodies within BORROW_MAX_BYTES (then 429 at once). Past the
        wait, the refusal as it stands then."""
        if self._borrowing >= BORROW_MAX or self._borrowed_bytes + size > BORROW_MAX_BYTES:
            return refused
        self._borrowing += 1
        self._borrowed_bytes += size
        try:
            outcome: Admitted | Refused = refused
            with trio.move_on_after(BORROW_WAIT_S):
                while isinstance(outcome, Refused):
                    await self._granted.wait()
                    outcome = self.tenancy.admit(
                        tenant, limiters, tokens, trio.current_time(), again=True
                    )
            return outcome
        finally:
            self._borrowing -= 1
            self._borrowed_bytes -= size

    def shares_connection(self) -> None:
        self.tenancy.new_connection()

    def dispatch_queues(self) -> None:
        """Hand every model's free slots to its waiting requests (router.fair_gate)."""
        for base, gate in self.gates.items():
            balancer = self.served.balancers.get(base)
            if balancer is not None:
                gate.dispatch(balancer.replicas)

    def start_draining(self) -> None:
        """Shutting down: /readyz answers 503 from now on (load balancers stop sending)."""
        self.draining = True

    def render_metrics(self) -> bytes:
        page = self.metrics.render(
            self.served.balancers,
            self.served.pools,
            trio.current_time(),
            self.tuning.cache_aware,
            self._policy_metrics,
        )
        return (
            page
            + "".join(
                f"{line}\n" for line in render_tenancy(self.tenancy, trio.current_time())
            ).encode()
        )

    async def handle(self, request: Request, responder: Responder) -> None:
        """Answer one request. Its id (the client's x-request-id, or a new one) goes to the
        engine and back to the client; what happened goes to the access log and the metrics."""
        arrived = time.monotonic()
        request_id = valid_request_id(request.header(_REQUEST_ID))
        if request_id is None:
            request_id = new_request_id()
            request.headers = [h for h in request.headers if h[0] != _REQUEST_ID]
            request.headers.append((_REQUEST_ID, request_id.encode()))
        # Hashed by check_head where it ran: once a request.
        digest = request.credential if request.head_checked else client_key(request)
        record = AccessRecord(
            time.time(),
            request_id,
            request.method.decode("latin-1"),
            request.path.decode("latin-1"),
            key_id=None if digest is None else key_id_of(digest),
        )
        recorder = RecordingResponder(responder, record, arrived, self.answer_headers)
        if request.path in ANTHROPIC_PATHS:
            recorder.errors = ANTHROPIC
        try:
            await self._route(request, recorder, digest)
        except BaseException as exc:
            # Status 0: the client went away before the answer ended (as in the metrics).
            # Anything else is a bug, which the server answers with 500 if it still can.
            gone = isinstance(exc, _CLIENT_GONE) or recorder.started
            record.status = 0 if gone else 500
            raise
        finally:
            record.duration_s = time.monotonic() - arrived
            self.outcomes.finished(recorder, digest)

    def rejected(self, status: int, message: str) -> None:
        """A request that the HTTP server refused before routing (413, 408, malformed)."""
        self.outcomes.rejected(AccessRecord(time.time(), "-", "-", "-", status=status), message)

    def check_head(self, request: Request) -> bool:
        """The HTTP server's head check: whether to read the body. An inference request
        without a valid key (where keys are set) is answered 401 from its head, and its
        connection closed unread. The key is hashed here once, for the whole request."""
        digest = request.credential = client_key(request)
        request.head_checked = True
        if not self.keys or digest in self.keys:
            return True
        path = request.path
        return path not in self.routes.relayed and not is_stored_path(path)

    def _metrics_allowed(self, digest: str | None) -> bool:
        if self.metrics_token is None:
            return True
        return digest is not None and hmac.compare_digest(digest, self.metrics_token)

    async def _route(
        self, request: Request, responder: RecordingResponder, digest: str | None
    ) -> None:
        path = request.path
        kind = self.routes.kind(path)
        if kind is Kind.JSON or kind is Kind.FORM:
            if request.method != b"POST":
                await responder.error(405, f"{path.decode()} takes POST")
                return
            await self._proxy(request, responder, digest, kind)
        elif kind is Kind.MANAGEMENT:
            what = f"{path.decode()} manages an engine for all its clients"
            await responder.error(403, f"{what}: llmgw never relays it")
        elif kind is Kind.NOT_PLAIN:
            await responder.error(400, f"{NOT_PLAIN}: {path.decode()}")
        elif is_stored_path(path):
            await self._stored(request, responder, digest)
        elif request.method not in (b"GET", b"HEAD"):
            if path in _GET_PATHS:
                await responder.error(405, f"{path.decode()} takes GET")
            else:
                await responder.error(404, _no_route(path, self.routes.relayed | _GET_PATHS))
        elif path == b"/v1/models":
            allowed = self._authorized(digest)
            if allowed is False:
                await responder.error(401, _NO_KEY)
            else:
                await responder.whole(200, self.served.listing(allowed))
        elif path == b"/healthz":
            await responder.whole(200, b'{"status": "ok"}')
        elif path == b"/readyz":
            ok = self.ready and not self.draining
            await responder.whole(200 if ok else 503, json.dumps(self._readiness()).encode())
        elif path == b"/metrics" and not self._metrics_allowed(digest):
            await responder.error(401, "a valid metrics token is required (Authorization: Bearer)")
        elif path == b"/metrics":
            page = self.render_metrics() if self.metrics_page is None else await self.metrics_page()
            await responder.whole(200, page, [(b"content-type", b"text/plain; version=0.0.4")])
        else:
            await responder.error(404, _no_route(path, self.routes.relayed | _GET_PATHS))

    def _authorized(self, digest: str | None) -> frozenset[str] | Literal[False] | None:
        """False: no valid key; None: every model; else the models the key may use."""
        if not self.keys:
            return None
        # Looked up by digest: the raw key is never compared.
        return False if digest is None else self.keys.get(digest, False)

    def _readiness(self) -> dict[str, object]:
        return {
            "ready": self.ready and not self.draining,
            "draining": self.draining,
            "models": self.served.healthy_counts(),
        }

    async def _proxy(
        self, request: Request, responder: RecordingResponder, digest: str | None, kind: Kind
    ) -> None:
        allowed = self._authorized(digest)
        if allowed is False:
            await responder.error(401, _NO_KEY)
            return
        named = await _named(request, responder, kind)
        if named is None:
            return
        model, body = named.model, named.body
        responder.record.model = model
        served = self.served
        if allowed is not None and model not in allowed:  # whether it exists or not
            message = f"this API key may not use the model {model!r}{served.hint(model, allowed)}"
            responder.message = message
            await responder.whole(403, responder.errors.body(403, message, "model_not_allowed"))
            return
        base = served.base_of(model)
        balancer = served.balancers.get(base)
        if balancer is None:
            hint = served.hint(model, allowed)
            await responder.error(404, f"the model {model!r} does not exist{hint}")
            return
        meter = served.meters.get(base)
        if meter is not None:
            meter.arrived(trio.current_time())
        pin = await _pin(request.path, model, balancer, body, responder)
        if pin is None:
            return
        pinned, body_for = pin
        session_value = request.header(self.tuning.session_header.encode())
        session = session_value.decode("latin-1") if session_value else None
        tenancy = self.tenancy
        tenant = responder.record.tenant = tenancy.tenant(digest)
        counts = tenancy.counts[tenant]
        counts.requests += 1
        limiters = tenancy.limiters(tenant, model)
        admitted: Admitted | None = None
        if limiters:
            context = _context_of(served.cards.get(base))
            prompt_tokens, output_tokens = reservation(
                request.path, body, len(request.body), None, self.tuning.reserve_output_tokens,
                context,
            )  # fmt: skip
            outcome = tenancy.admit(
                tenant, limiters, prompt_tokens + output_tokens, trio.current_time()
            )
            if isinstance(outcome, Refused) and tenancy.shared(limiters, outcome.which):
                outcome = await self._borrow(tenant, limiters, prompt_tokens + output_tokens,
                                             outcome, len(request.body))  # fmt: skip
            if isinstance(outcome, Refused):
                await _rate_limited(responder, tenant, outcome)
                return
            admitted = outcome
            admitted.prompt = prompt_tokens
            responder.add_headers(outcome.headers)
            responder.count_events = body.get("stream") is True
        counts.in_flight += 1
        # The parsed body goes on in a box that _admitted empties: a held request keeps
        # its raw body alone (see there), which this frame must not keep either.
        box, body, named = [body], {}, None
        try:
            await self._admitted(
                request, responder, model, base, balancer, meter, box, kind, pinned, body_for,
                session, tenant,
            )  # fmt: skip
        finally:
            counts.in_flight -= 1
            record = responder.record
            if record.prompt_tokens is not None:
                counts.prompt_tokens += record.prompt_tokens
            if record.completion_tokens is not None:
                counts.completion_tokens += record.completion_tokens
            if admitted is not None:
                used = charged_tokens(record, responder.events, admitted)
                tenancy.settle(admitted, used, trio.current_time())

    async def _admitted(
        self,
        request: Request,
        responder: RecordingResponder,
        model: str,
        base: str,
        balancer: Balancer,
        meter: ModelMeter | None,
        box: list[dict[str, object]],
        kind: Kind,
        pinned: Replica | None,
        body_for: Callable[[Replica], bytes] | None,
        session: str | None,
        tenant: str,
    ) -> None:
        """A request its tenant's limits admitted: held while its model has no replica,
        queued while every replica is full, then its attempts."""
        body = box.pop()
        prompt = None
        if balancer.policy.reads_prompt and session is None:
            prompt = await self._prompt(model, balancer, request.path, body)
        metrics = self.metrics
        metrics.in_flight[model] += 1
        gate: ModelGate | None = None
        cost = 0
        try:  # counted in llmgw_requests_total by handle, with the status sent
            # The serving replicas counted for a held model alone: a sum over the
            # replicas that no other request pays for.
            serving = balancer.healthy_count if meter is not None else 0
            if admit(meter is not None, serving) is Admission.HOLD:
                assert meter is not None
                stream = body.get("stream") is True
                # Held with its raw body alone, not beside its parsed form (about twice
                # its size) nor the prompt's whole text: parsed again once a replica may
                # serve (`body_for` reads `body` then).
                body = {}
                if prompt is not None:
                    prompt = attrs.evolve(prompt, text=prompt.text[: prompt.size])
                size = len(request.body)
                if not await self.holds.held(model, balancer, meter, responder, size, stream):
                    return
                if kind is Kind.JSON:
                    body = json.loads(request.body)  # valid: it was parsed before
            if self.tuning.replica_max_in_flight and pinned is None:
                gate = self._gate(base)
                cost = sum(reservation(request.path, body, len(request.body), None,
                                       self.tuning.reserve_output_tokens, None))  # fmt: skip
                entry = await self._queue(gate, tenant, cost, balancer, meter, responder)
                if entry is None:
                    return
                gate.taken(entry)
            await self.forwarder.forward(
                model, balancer, request, responder, body.get("stream") is True, session,
                prompt, pinned=pinned, body_for=body_for, full=None if gate is None else gate.full,
            )  # fmt: skip
        finally:
            metrics.in_flight[model] -= 1
            if gate is not None:
                record = responder.record
                if record.prompt_tokens is not None and record.completion_tokens is not None:
                    uncached = record.prompt_tokens
                    if self.tuning.queue_cost == "uncached":
                        uncached -= record.cached_tokens or 0
                    gate.settle(tenant, uncached + record.completion_tokens - cost)
                gate.dispatch(balancer.replicas)

    def _gate(self, base: str) -> ModelGate:
        gate = self.gates.get(base)
        if gate is None:
            gate = self.gates[base] = ModelGate(self.tuning)
        return gate

    async def _queue(
        self,
        gate: ModelGate,
        tenant: str,
        cost: float,
        balancer: Balancer,
        meter: ModelMeter | None,
        responder: RecordingResponder,
    ) -> Entry | None:
        """Wait in the model's fair queue while its replicas are full; None once answered
        429 (the tenant's queue is full, or it waited queue_max_wait_s)."""
        entry = self.tenancy.entry(tenant)
        priority, weight = (0, 1.0) if entry is None else (entry.priority, entry.weight)
        started = trio.current_time()
        counts = self.tenancy.counts[tenant]
        counts.queued += 1
        if meter is not None:
            meter.queued += 1
        try:
            outcome = await gate.enter(tenant, cost, balancer.replicas, priority, weight)
        finally:
            counts.queued -= 1
            if meter is not None:
                meter.queued -= 1
        if outcome is Entry.WAITED:
            waited = trio.current_time() - started
            record = responder.record
            record.queued_s = waited + (record.queued_s or 0.0)
        if outcome is Entry.FULL or outcome is Entry.TIMEOUT:
            why = "queue_full" if outcome is Entry.FULL else "queue_timeout"
            self.tenancy.refused(tenant, why)
            await _rate_limited(responder, tenant, Refused(why, QUEUE_RETRY_S, []))
            return None
        return outcome

    async def _prompt(
        self, model: str, balancer: Balancer, path: bytes, body: dict[str, object]
    ) -> PromptKey | None:
        """The prompt's key, for a policy that reads it: hashed once per request, with
        its token ids where the policy would read them."""
        if path not in (_CHAT, _COMPLETIONS):
            return None
        chat = path == _CHAT
        policy = balancer.policy
        prompt = policy.prompt_key(body, chat)
        tokenizer = self.tokenizer
        if prompt is None or tokenizer is None or not policy.wants_tokens(balancer.replicas):
            return prompt
        # The prompt with its token ids, as an engine of the model tokenizes it (None
        # when none could say: the policy then decides without them).
        replicas = [r for r in balancer.replicas if r.available]
        if not replicas:
            return prompt
        # In turn: one engine does not tokenize the whole fleet's prompts.
        self._tokenize_turn += 1
        ask = self.served.pools[replicas[self._tokenize_turn % len(replicas)].endpoint]
        tokens = await tokenizer.tokens(ask, model, body, chat, prompt)
        lora = model if model in self.served.adapters else None
        return attrs.evolve(prompt, tokens=tokens, lora=lora)

    async def _stored(
        self, request: Request, responder: RecordingResponder, digest: str | None
    ) -> None:
        """`GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: relayed to
        the replica that stored the response, as its id names it, and nowhere else."""
        allowed = self._authorized(digest)
        if allowed is False:
            await responder.error(401, _NO_KEY)
            return
        response_id = stored_path_id(request.path)
        if response_id is None:
            await responder.error(404, _no_route(request.path, frozenset()))
            return
        if request.method not in (b"GET", b"DELETE", b"POST"):
            await responder.error(405, "a stored response takes GET, DELETE or POST")
            return
        holder = holder_of(response_id)
        found = None if holder is None else self.served.holding(holder, allowed)
        if found is None:
            await _response_gone(responder, response_id)
            return
        model, balancer, replica = found
        responder.record.model = model
        self.metrics.in_flight[model] += 1
        try:
            await self.forwarder.forward(
                model, balancer, request, responder, False, None, None, pinned=replica
            )
        finally:
            self.metrics.in_flight[model] -= 1


def _context_of(card: dict[str, object] | None) -> int | None:
    """The model's context length, as its engine's /v1/models said (model_cards checks
    its type), None where no engine said."""
    value = None if card is None else card.get("max_model_len")
    return value if type(value) is int and value > 0 else None


async def _rate_limited(responder: RecordingResponder, tenant: str, refused: Refused) -> None:
    """429 in the path's API shape, with Retry-After (and -Ms) and the x-ratelimit-*."""
    message = refusal_message(tenant, refused.which, refused.retry_after_s)
    responder.message = message
    headers = [*JSON, *retry_headers(refused.retry_after_s), *refused.headers]
    await responder.whole(429, responder.errors.body(429, message, "rate_limit_exceeded"), headers)


_Pin = tuple[Replica | None, Callable[[Replica], bytes] | None]
_ANY_REPLICA: _Pin = (None, None)


async def _named(request: Request, responder: RecordingResponder, kind: Kind) -> _Named | None:
    """The request's model and parsed body; None once answered with why not."""
    body: dict[str, object] = {}
    if kind is Kind.FORM:
        try:
            model: object = form_model(request.header(b"content-type"), request.body)
        except FormRefused as exc:  # also where the engine could read another model
            await responder.error(400, str(exc))
            return None
    else:
        try:
            parsed = json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            await responder.error(400, f"the request body is not valid JSON: {exc}")
            return None
        if not isinstance(parsed, dict):
            await responder.error(400, "the request body must be a JSON object")
            return None
        body = parsed
        model = body.get("model")
    if model is None:
        await responder.error(404, "no model given: set the 'model' field")
        return None
    if not isinstance(model, str):
        await responder.error(400, "'model' must be a string")
        return None
    return _Named(model, body)


async def _pin(
    path: bytes,
    model: str,
    balancer: Balancer,
    body: dict[str, object],
    responder: RecordingResponder,
) -> _Pin | None:
    """The replica a request must go to, and the body each replica tried is sent
    (None, None: any replica, its own body); None once answered 404."""
    if path != RESPONSES:
        return _ANY_REPLICA
    # A follow-up goes where the response it continues is stored; each response is
    # given an id that names its replica (stored.py).
    pinned = None
    previous = body.get("previous_response_id")
    holder = holder_of(previous)
    if holder is not None:
        pinned = holder_replica(model, balancer, holder)
        if pinned is None:
            await _response_gone(responder, str(previous))
            return None

    def body_for(replica: Replica) -> bytes:
        return with_response_id(body, mint(model, replica.rid))

    return pinned, body_for


_GET_PATHS = frozenset({b"/v1/models", b"/healthz", b"/readyz", b"/metrics"})
# How close a path must be to a served one to be named as meant: the relayed paths share
# their /v1/ head, and at the default closeness /v1/admin/status reads as
# /v1/audio/translations.
_PATH_HINT_CUTOFF = 0.75


def _no_route(path: bytes, served: frozenset[bytes]) -> str:
    """The router's own 404, saying that llmgw answered it (an engine's own 404 is relayed
    as it is), with the served path meant: most often the base URL lacked its /v1."""
    text = path.decode(errors="replace")
    meant = b"/v1" + path
    hint = (
        meant.decode()
        if meant in served
        else closest(text, (p.decode() for p in served), _PATH_HINT_CUTOFF)
    )
    return f"llmgw: no such route {text}" + (f" (did you mean {hint}?)" if hint else "")


async def _response_gone(responder: RecordingResponder, response_id: str) -> None:
    if holder_of(response_id) is None:
        message = (
            f"the response id {response_id[:128]!r} was not given by llmgw, which cannot "
            "tell which replica stored it"
        )
    else:
        message = (
            f"no replica serving now holds the response {response_id!r}: the one that "
            "stored it is gone (a response lives in its engine's memory), or this API key "
            "may not use its model"
        )
    responder.message = message
    await responder.whole(404, responder.errors.body(404, message, "response_not_found"))
