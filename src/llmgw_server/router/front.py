"""The OpenAI-compatible front: authenticate, pick a replica, relay the answer."""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Literal

import attrs
import trio

from llmgw_core.autoscaling import RouterLoad
from llmgw_core.bearer import client_key_digest
from llmgw_core.catalog import Endpoint
from llmgw_core.config import Config, ServerSection
from llmgw_core.logsafe import escaped
from llmgw_core.openai_errors import ANTHROPIC
from llmgw_core.ratelog import RateLimit
from llmgw_core.tomlshape import closest, did_you_mean
from llmgw_core.traffic import MODEL_ROW, Sample
from llmgw_http.server import JSON, Request, Responder, ServerLimits
from llmgw_server.reload import ReloadPlan, plan_reload, reloaded_config
from llmgw_server.router.access_log import (
    FORMATTERS,
    AccessRecord,
    key_id_of,
    logfmt_value,
    valid_request_id,
)
from llmgw_server.router.balancer import (
    Balancer,
    Choice,
    Decision,
    Replica,
    Verdict,
    busy_pause_s,
    judge,
)
from llmgw_server.router.kv_index import KvIndex
from llmgw_server.router.meter import ModelMeter, hold_refusal
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.model_cards import plain_card
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.recorder import LineWriter, RecordingResponder, new_request_id
from llmgw_server.router.routes import (
    ANTHROPIC_PATHS,
    NOT_PLAIN,
    FormRefused,
    Kind,
    Routes,
    form_model,
)
from llmgw_server.router.stored import (
    RESPONSES,
    Holder,
    holder_of,
    is_stored_path,
    mint,
    model_tag,
    stored_path_id,
    with_response_id,
)
from llmgw_server.router.tokenizer import Tokenizer
from llmgw_server.router.traffic_meter import TrafficMeter
from llmgw_server.router.upstream import Exchange, Pool, UpstreamError

log = logging.getLogger("llmgw.router")

_CHAT = b"/v1/chat/completions"
_COMPLETIONS = b"/v1/completions"
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"authorization",
        b"expect",
    }
)
# A client's own key in the other headers OpenAI-style clients send it in (Anthropic's,
# Azure's): never the engine's business, which gets the engine key (Endpoint.api_key).
_CLIENT_KEYS = frozenset({b"x-api-key", b"api-key"})
# Headers some servers and frameworks let rewrite the request's path, method or prefix
# (IIS, Symfony, Spring, ...): a client could name an engine's management path in them,
# or change what the router routed. No engine llmgw serves needs them (issue 34).
_REWRITES = frozenset(
    {b"x-original-url", b"x-rewrite-url", b"x-http-method-override", b"x-forwarded-prefix"}
)
# Never relayed either way: the above, and their lookalikes with `_` for `-`.
_NOT_FORWARDED = frozenset(
    name.replace(b"-", sep)
    for name in _HOP_BY_HOP | _CLIENT_KEYS | _REWRITES
    for sep in (b"-", b"_")
)
# Connection header values that name no further header to drop (what clients send).
_PLAIN_CONNECTION = frozenset({b"keep-alive", b"close", b"Keep-Alive", b"Close"})
_ERROR_BODY_LIMIT = 1024 * 1024
_WHOLE_LIMIT = 1024 * 1024
_REQUEST_ID = b"x-request-id"
# A held request refused (its model's queue full, or no replica in hold_timeout_s) is
# told to come back this much later: a waking engine may serve by then.
HOLD_RETRY_AFTER_S = 5
# A held stream's `: ping` comments come this often: well inside the idle timeouts of
# proxies (nginx's and AWS ALB's are 60 s) and the read timeouts clients set.
HELD_PING_S = 10.0
_PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # answered, neither logged nor counted
_CLIENT_GONE = (trio.Cancelled, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)


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


class Router:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.tuning = config.router
        self.keys = config.auth.keys  # digest -> the models it may use (None: all)
        self.routes = Routes(config.router.extra_paths)
        self.metrics = RouterMetrics()
        self.traffic = TrafficMeter()  # by model and replica, for the fleet page
        self.pools: dict[Endpoint, Pool] = {}
        self.balancers: dict[str, Balancer] = {}
        # Each model's description from its engines (health.py reads them): /v1/models.
        self.cards: dict[str, dict[str, object]] = {}
        # LoRA adapter -> the model whose replicas serve it under its name (route feed).
        self.adapters: dict[str, str] = {}
        # Each autoscaled model's meter and held requests (route feed; router.meter).
        self.meters: dict[str, ModelMeter] = {}
        self._autoscaled: frozenset[str] = frozenset()  # the route feed's
        self._start_hold: frozenset[str] = frozenset()  # see hold_at_start
        # What each engine holds, by its own KV-cache events (router.kv_feed), for
        # `balancing = "precise"`; with another policy, None.
        self.kv = KvIndex() if config.router.balancing == "precise" else None
        self.tokenizer = Tokenizer(refused=self.metrics.tokenize_refused)
        self._tokenize_turn = 0
        self._load_wanted = trio.Event()  # set when a request is held: report at once
        # A request was held since the last load report: one held while no one waited
        # (the feed between two reports, or between two control planes) is not missed.
        self._held_unreported = False
        self.ready = False  # the first health probe round is done
        self.draining = False
        self._5xx_log = RateLimit(period_s=10.0)
        self._refusal_log = RateLimit(period_s=10.0)
        s = config.server
        self.metrics_token = s.metrics_token_digest  # None: /metrics is open
        self.access_log = (
            LineWriter(FORMATTERS[s.access_log_format], s.access_log_file) if s.access_log else None
        )
        for model in config.catalog.models:
            self.set_endpoints(model.name, model.endpoints)
        # Set by a worker: the page of every worker (router.workers), instead of this one's.
        self.metrics_page: Callable[[], Awaitable[bytes]] | None = None
        # Set by a worker: its name, in the head of every answer (x-llmgw-worker).
        self.answer_headers: tuple[tuple[bytes, bytes], ...] = ()

    def reload(self, config: Config) -> ReloadPlan:
        """Take the API keys, metrics token and static models of `config` (router.reload);
        requests in flight finish where they are."""
        plan = plan_reload(self.config, config)
        self.config = reloaded_config(self.config, config)
        self.keys = self.config.auth.keys
        self.metrics_token = self.config.server.metrics_token_digest
        for name, endpoints in {**plan.models_added, **plan.models_changed}.items():
            self.set_endpoints(name, endpoints)
        for name in plan.models_removed:
            self.set_endpoints(name, ())
            del self.balancers[name]
            self.cards.pop(name, None)
        return plan

    def render_metrics(self) -> bytes:
        return self.metrics.render(
            self.balancers, self.pools, trio.current_time(), self.tuning.cache_aware, self.kv
        )

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint]) -> None:
        """The replicas of a model: static from the catalog, or the control plane's ready shards."""
        balancer = self.balancers.get(model)
        if balancer is None:
            balancer = self.balancers[model] = Balancer(
                [],
                eject_after_failures=self.tuning.eject_after_failures,
                eject_cooldown_s=self.tuning.eject_cooldown_s,
                balancing=self.tuning.balancing,
                tuning=self.tuning.cache_aware,
                kv=self.kv,
            )
        for endpoint in endpoints:
            if endpoint not in self.pools:
                self.pools[endpoint] = Pool(
                    endpoint,
                    self.tuning.connect_timeout_s,
                    self.tuning.read_idle_timeout_s,
                    self.tuning.upstream_idle_s,
                )
        balancer.set_endpoints(endpoints)
        meter = self.meters.get(model)
        if meter is not None and endpoints:
            meter.may_serve()
        in_use = {r.endpoint for b in self.balancers.values() for r in b.replicas}
        for endpoint in [e for e in self.pools if e not in in_use]:
            self.pools.pop(endpoint).close()

    # -- what the route feed needs (route_feed.follower.RouteTarget) --

    def forget_model(self, model: str) -> None:
        """A model gone from the route table (a reload removed it, and its drain ended):
        a request naming it gets 404, not 503 "no healthy replica" for good."""
        self.set_endpoints(model, ())  # its engines' pools closed, unless shared
        self.balancers.pop(model, None)

    def static_models(self) -> frozenset[str]:
        return frozenset(m.name for m in self.config.catalog.models if m.profile is None)

    def set_draining(self, draining: frozenset[Endpoint], *, skip: frozenset[str]) -> None:
        for model, balancer in self.balancers.items():
            if model not in skip:
                balancer.mark_draining(draining)

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        self.adapters = dict(adapters)

    def set_autoscaled(self, models: frozenset[str]) -> None:
        """Meter these models for the autoscaler, and hold their requests while none of
        their replicas serves; a model no longer autoscaled releases what it held."""
        self._autoscaled = models
        for model in [m for m in self.meters if m not in models and m not in self._start_hold]:
            self.meters.pop(model).may_serve()
        for model in models:
            if model not in self.meters:
                self.meters[model] = ModelMeter()

    def load_report(self) -> dict[str, RouterLoad]:
        """Each autoscaled model's load since the last report (route_feed.messages.Load)."""
        now = trio.current_time()
        self._held_unreported = False
        report = {}
        for model, meter in self.meters.items():
            if model not in self._autoscaled:
                continue  # held at start alone (hold_at_start): not the autoscaler's
            balancer = self.balancers.get(model)
            readings = [
                r.engine_load.kv_usage
                for r in (balancer.replicas if balancer else ())
                if r.engine_load is not None and r.engine_load.kv_usage is not None
            ]
            kv = sum(readings) / len(readings) if readings else None
            in_flight = self.metrics.in_flight
            sent = in_flight[model] + sum(
                in_flight[a] for a, m in self.adapters.items() if m == model
            )
            report[model] = meter.report(now, sent, kv)
        return report

    def traffic_report(self) -> tuple[Sample, ...]:
        """What it answered since the last report, by model and replica (messages.Traffic)."""
        in_flight: dict[tuple[str, str], int] = {}
        for model, n in self.metrics.in_flight.items():
            if n:
                key = (self.adapters.get(model, model), MODEL_ROW)
                in_flight[key] = in_flight.get(key, 0) + n
        for model, balancer in self.balancers.items():
            for replica in balancer.replicas:
                if replica.outstanding:
                    in_flight[(model, replica.endpoint.url)] = replica.outstanding
        return self.traffic.report(in_flight)

    def hold_at_start(self) -> None:
        """Just started (a restart): the control plane has not heard from its agents yet,
        so hold each placed model's requests as for a model at zero (same budgets and
        hold_timeout_s) until its replicas are back, rather than answer 503 "no healthy
        replica"; `end_start_hold` ends this (the wiring, after STARTUP_HOLD_S)."""
        self._start_hold = frozenset(
            m.name for m in self.config.catalog.models if m.profile is not None
        )
        for model in self._start_hold:
            self.meters.setdefault(model, ModelMeter())

    def end_start_hold(self) -> None:
        """What is still held for a model that is not autoscaled is answered now."""
        for model in self._start_hold - self._autoscaled:
            meter = self.meters.pop(model, None)
            if meter is not None:
                meter.may_serve()
        self._start_hold = frozenset()

    def table_refused(self, reason: str) -> None:
        """The route feed refused a table (route_feed.follower): counted on /metrics."""
        self.metrics.tables_refused[reason] += 1

    async def wait_load_wanted(self) -> None:
        """Until a request is held (the control plane should hear of it at once): at once
        when one was held since the last `load_report`."""
        if not self._held_unreported:
            await self._load_wanted.wait()

    def in_flight(self, endpoints: frozenset[Endpoint]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for balancer in self.balancers.values():
            for replica in balancer.replicas:
                if replica.endpoint in endpoints:
                    url = replica.endpoint.url
                    counts[url] = counts.get(url, 0) + replica.outstanding
        return counts

    def endpoints(self) -> set[Endpoint]:
        """Every replica's endpoint, all models."""
        return {r.endpoint for b in self.balancers.values() for r in b.replicas}

    def replica(self, model: str, endpoint: Endpoint) -> Replica | None:
        balancer = self.balancers.get(model)
        for replica in balancer.replicas if balancer else ():
            if replica.endpoint == endpoint:
                return replica
        return None

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
        digest = request.credential if request.head_checked else _client_key(request)
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
            self._finished(recorder, digest)

    def _finished(self, recorder: RecordingResponder, digest: str | None) -> None:
        record = recorder.record
        status = record.status
        if status in (200, 503) and record.path in _PROBES and record.method in ("GET", "HEAD"):
            return  # health probes and metrics scrapes
        named = record.model
        model = named if named in self.balancers or named in self.adapters else "-"
        metrics = self.metrics
        metrics.requests[(model, status)] += 1
        if model != "-":
            base = self.adapters.get(model, model)  # an adapter's answers are its model's
            # A replica's failed attempts were counted as they failed (_failed).
            replica = None if judge(status) is Verdict.FAILED else record.replica
            self.traffic.finished(base, replica, status, record.ttfb_s)
        # A stored response read again (GET, cancel) repeats the usage counted when made.
        if record.prompt_tokens is not None and not record.path.startswith(_STORED_READS):
            key = record.key_id if digest in self.keys and record.key_id else "-"
            metrics.tokens[(model, key, "prompt")] += record.prompt_tokens
            if record.completion_tokens is not None:
                metrics.tokens[(model, key, "completion")] += record.completion_tokens
        if 400 <= status < 500 and record.replica is None:  # refused here, not by an engine
            self._refused(record, recorder.message)
        if self.access_log is not None:
            self.access_log.write(record)

    def rejected(self, status: int, message: str) -> None:
        """A request that the HTTP server refused before routing (413, 408, malformed)."""
        record = AccessRecord(time.time(), "-", "-", "-", status=status)
        self.metrics.requests[("-", status)] += 1
        self._refused(record, message)
        if self.access_log is not None:
            self.access_log.write(record)

    def _refused(self, record: AccessRecord, message: str | None) -> None:
        """Count an auth failure; log the refusal, one line a period per status and reason."""
        reason = _auth_failure(record)
        if reason is not None:
            self.metrics.auth_failures[reason] += 1
        suppressed = self._refusal_log.allow((record.status, reason), trio.current_time())
        if suppressed is None:
            return
        detail = f"{reason}: {message}" if reason and message else message or reason or "-"
        log.warning(
            "refused %s %s with %d (%s); model=%s key_id=%s request_id=%s%s",
            record.method,
            logfmt_value(record.path[:256]),
            record.status,
            detail[:300],
            logfmt_value(record.model and record.model[:256]),
            record.key_id or "-",
            logfmt_value(record.request_id),
            f" ({suppressed} more since the last line)" if suppressed else "",
        )

    def check_head(self, request: Request) -> bool:
        """The HTTP server's head check: whether to read the body. An inference request
        without a valid key (where keys are set) is answered 401 from its head, and its
        connection closed unread. The key is hashed here once, for the whole request."""
        digest = request.credential = _client_key(request)
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
                await responder.error(401, "a valid API key is required (Authorization: Bearer)")
            else:
                await responder.whole(200, self._models(allowed))
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

    def _models(self, allowed: frozenset[str] | None) -> bytes:
        # An autoscaled model scaled to zero is listed: a request for it wakes it.
        meters = self.meters
        data = [
            self.cards.get(name) or plain_card(name)
            for name, balancer in self.balancers.items()
            if (balancer.healthy_count or name in meters) and (allowed is None or name in allowed)
        ]
        # An adapter while its model is listed, as vLLM lists one: its parent, and its
        # name as its root (its path is the node's business).
        for name, base in self.adapters.items():
            balancer = self.balancers.get(base)
            listed = balancer is not None and (balancer.healthy_count > 0 or base in meters)
            if listed and name not in self.balancers and (allowed is None or name in allowed):
                owner = (self.cards.get(base) or plain_card(base))["owned_by"]
                data.append({**plain_card(name), "owned_by": owner, "root": name, "parent": base})
        return json.dumps({"object": "list", "data": data}).encode()

    def _model_hint(self, model: str, allowed: frozenset[str] | None) -> str:
        """A "did you mean" among the models (adapters included) that this key may use and
        the router serves, never one it may not: only on the way to a 403 or 404."""
        balancers = self.balancers
        names = [*balancers, *(a for a, base in self.adapters.items() if base in balancers)]
        return did_you_mean(model, names if allowed is None else set(names) & allowed)

    def _readiness(self) -> dict[str, object]:
        return {
            "ready": self.ready and not self.draining,
            "draining": self.draining,
            "models": {name: b.healthy_count for name, b in self.balancers.items()},
        }

    async def _proxy(
        self, request: Request, responder: RecordingResponder, digest: str | None, kind: Kind
    ) -> None:
        path = request.path
        allowed = self._authorized(digest)
        if allowed is False:
            await responder.error(401, "a valid API key is required (Authorization: Bearer)")
            return
        body: dict[str, object] = {}
        if kind is Kind.FORM:
            try:
                model: object = form_model(request.header(b"content-type"), request.body)
            except FormRefused as exc:  # also where the engine could read another model
                await responder.error(400, str(exc))
                return
        else:
            try:
                parsed = json.loads(request.body)
            except (ValueError, UnicodeDecodeError) as exc:
                await responder.error(400, f"the request body is not valid JSON: {exc}")
                return
            if not isinstance(parsed, dict):
                await responder.error(400, "the request body must be a JSON object")
                return
            body = parsed
            model = body.get("model")
        if model is None:
            await responder.error(404, "no model given: set the 'model' field")
            return
        if not isinstance(model, str):
            await responder.error(400, "'model' must be a string")
            return
        responder.record.model = model
        if allowed is not None and model not in allowed:  # whether it exists or not
            hint = self._model_hint(model, allowed)
            message = f"this API key may not use the model {model!r}{hint}"
            responder.message = message
            await responder.whole(403, responder.errors.body(403, message, "model_not_allowed"))
            return
        base = model if model in self.balancers else self.adapters.get(model, "")
        balancer = self.balancers.get(base)
        if balancer is None:
            hint = self._model_hint(model, allowed)
            await responder.error(404, f"the model {model!r} does not exist{hint}")
            return
        meter = self.meters.get(base)
        if meter is not None:
            meter.arrived(trio.current_time())
        pinned: Replica | None = None
        body_for: Callable[[Replica], bytes] | None = None
        if path == RESPONSES:
            # A follow-up goes where the response it continues is stored; each response
            # is given an id that names its replica (stored.py).
            previous = body.get("previous_response_id")
            holder = holder_of(previous)
            if holder is not None:
                pinned = _holder(model, balancer, holder)
                if pinned is None:
                    await _response_gone(responder, str(previous))
                    return

            def body_for(replica: Replica) -> bytes:
                return with_response_id(body, mint(model, replica.rid))

        session_value = request.header(self.tuning.session_header.encode())
        session = session_value.decode("latin-1") if session_value else None
        prompt: PromptKey | None = None
        policy = balancer.policy
        if policy.reads_prompt and session is None and path in (_CHAT, _COMPLETIONS):
            # Hashed once per request, and only where the policy reads it.
            prompt = policy.prompt_key(body, path == _CHAT)
            if prompt is not None and policy.wants_tokens(balancer.replicas):
                prompt = await self._tokenized(model, balancer, body, path == _CHAT, prompt)
        metrics = self.metrics
        metrics.in_flight[model] += 1
        try:  # counted in llmgw_requests_total by handle, with the status sent
            if meter is not None and not balancer.healthy_count:
                stream = body.get("stream") is True
                # Held with its raw body alone, not beside its parsed form (about twice
                # its size) nor the prompt's whole text: parsed again once a replica may
                # serve (`body_for` reads `body` then).
                body = parsed = {}
                if prompt is not None:
                    prompt = attrs.evolve(prompt, text=prompt.text[: prompt.size])
                size = len(request.body)
                if not await self._held(model, balancer, meter, responder, size, stream):
                    return
                if kind is Kind.JSON:
                    body = json.loads(request.body)  # valid: it was parsed before
            await self._forward(
                model,
                balancer,
                request,
                responder,
                body.get("stream") is True,
                session,
                prompt,
                pinned=pinned,
                body_for=body_for,
            )
        finally:
            metrics.in_flight[model] -= 1

    async def _tokenized(
        self, model: str, balancer: Balancer, body: dict[str, object], chat: bool, prompt: PromptKey
    ) -> PromptKey:
        """The prompt with its token ids, as an engine of the model tokenizes it (None
        when none could say: the policy then decides without them)."""
        lora = model if model in self.adapters else None
        replicas = [r for r in balancer.replicas if r.available]
        if not replicas:
            return prompt
        # In turn: one engine does not tokenize the whole fleet's prompts.
        self._tokenize_turn += 1
        ask = self.pools[replicas[self._tokenize_turn % len(replicas)].endpoint]
        tokens = await self.tokenizer.tokens(ask, model, body, chat, prompt)
        return attrs.evolve(prompt, tokens=tokens, lora=lora)

    async def _held(
        self,
        model: str,
        balancer: Balancer,
        meter: ModelMeter,
        responder: RecordingResponder,
        size: int,
        stream: bool,
    ) -> bool:
        """Hold a request for an autoscaled model that no replica serves (scaled to zero,
        or all starting) until one does, oldest first: True once one may serve it; False
        when it was answered 503 with Retry-After (the model's queue or a byte budget is
        full, or `hold_timeout_s` passed). `size`: its body's bytes.

        A `stream` request, once held, is sent its answer's head and a comment at once,
        then a `: ping` every HELD_PING_S: its client sees bytes while the model wakes
        (and a proxy's idle timeout is not reached); past `hold_timeout_s` its stream ends
        with an error event, and the engine's answer is relayed as events after it
        (RecordingResponder.early)."""
        tuning = self.tuning
        held_bytes = sum(m.held_bytes for m in self.meters.values())
        refused = hold_refusal(model, meter, size, held_bytes, tuning)
        if refused is not None:
            return await self._unheld(model, responder, *refused)
        meter.held += 1
        meter.held_bytes += size
        metrics = self.metrics
        metrics.held[model] += 1
        metrics.held_bytes[model] += size
        self._held_unreported = True
        self._load_wanted.set()
        self._load_wanted = trio.Event()
        started = trio.current_time()
        try:
            with trio.move_on_after(tuning.hold_timeout_s):
                if stream:
                    await responder.start_early()
                    waiting = f"waiting for a replica of {escaped(model)} to start"
                    await responder.comment(waiting.encode())
                ping_s = HELD_PING_S if stream else math.inf
                while self.meters.get(model) is meter and not balancer.healthy_count:
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
        return await self._unheld(model, responder, "timeout", message)

    async def _unheld(
        self, model: str, responder: RecordingResponder, reason: str, message: str
    ) -> bool:
        self.metrics.held_refused[(model, reason)] += 1
        self._log_5xx(model, None, 503, message)
        body = responder.errors.body(503, message, None)
        retry = (b"retry-after", b"%d" % HOLD_RETRY_AFTER_S)
        await responder.whole(503, body, [*_content_type_of(body), retry])
        return False

    async def _stored(
        self, request: Request, responder: RecordingResponder, digest: str | None
    ) -> None:
        """`GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: relayed to
        the replica that stored the response, as its id names it, and nowhere else."""
        allowed = self._authorized(digest)
        if allowed is False:
            await responder.error(401, "a valid API key is required (Authorization: Bearer)")
            return
        response_id = stored_path_id(request.path)
        if response_id is None:
            await responder.error(404, _no_route(request.path, frozenset()))
            return
        if request.method not in (b"GET", b"DELETE", b"POST"):
            await responder.error(405, "a stored response takes GET, DELETE or POST")
            return
        holder = holder_of(response_id)
        found = None if holder is None else self._holding(holder, allowed)
        if found is None:
            await _response_gone(responder, response_id)
            return
        model, balancer, replica = found
        responder.record.model = model
        self.metrics.in_flight[model] += 1
        try:
            await self._forward(
                model, balancer, request, responder, False, None, None, pinned=replica
            )
        finally:
            self.metrics.in_flight[model] -= 1

    def _holding(
        self, holder: Holder, allowed: frozenset[str] | None
    ) -> tuple[str, Balancer, Replica] | None:
        """The replica `holder` names, of a model (or an adapter: its base's replicas)
        the key may use."""
        served = [*self.balancers.items()]
        served += [(name, self.balancers[base]) for name, base in self.adapters.items()
                   if base in self.balancers]  # fmt: skip
        for model, balancer in served:
            if allowed is None or model in allowed:
                replica = _holder(model, balancer, holder)
                if replica is not None:
                    return model, balancer, replica
        return None

    async def _forward(
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
    ) -> int:
        """Relay the request to a replica, retrying others before the first byte. A
        `pinned` replica is tried alone (it holds what the request names); `body_for`
        gives the body each replica tried is sent, the request's own by default."""
        tuning = self.tuning
        headers = _end_to_end(request.headers)
        tried: list[Replica] = []
        last: _Refusal | None = None
        for attempt in range(1 + tuning.retries):
            if pinned is not None:
                choice = None if tried else Choice(pinned, Decision.STORED_RESPONSE)
            else:
                choice = balancer.choose(
                    exclude=tried, session=session, now=trio.current_time(), prompt=prompt
                )
            if choice is None:
                break
            replica = choice.replica
            self.metrics.chose(model, choice, prompt, first=not attempt)
            responder.record.cached_predicted = choice.matched_tokens
            if attempt:
                self.metrics.retries[model] += 1
            tried.append(replica)
            _served_by(responder, replica)
            balancer.sent(replica)
            try:
                started = time.monotonic()
                try:
                    exchange = await self.pools[replica.endpoint].open(
                        request.method,
                        request.target,
                        headers,
                        request.body if body_for is None else body_for(replica),
                        tuning.first_byte_timeout_s,
                    )
                except UpstreamError as exc:
                    status = 504 if exc.timed_out else 502
                    body = responder.errors.body(status, str(exc), None)
                    last = _Refusal(status, body, replica, str(exc))
                    self._failed(model, balancer, replica, str(exc))
                    continue
                try:
                    ttfb = time.monotonic() - started
                    status = exchange.status
                    verdict = judge(status)
                    if verdict is not Verdict.RELAY:
                        try:
                            text = await exchange.read_body(_ERROR_BODY_LIMIT)
                        except UpstreamError:
                            message = f"{replica.endpoint} answered {status}"
                            text = responder.errors.body(502, message, None)
                        why = f"answered {status}"
                        retry_after = _header(exchange.headers, b"retry-after")
                        last = _Refusal(status, text, replica, why, retry_after)
                        if verdict is Verdict.FAILED:
                            self._failed(model, balancer, replica, why)
                        else:  # the engine is alive and says so: not a failure
                            pause = busy_pause_s(retry_after)
                            balancer.busy(replica, pause, trio.current_time())
                        continue
                    self.metrics.ttfb[model].observe(ttfb)
                    if self.meters:
                        meter = self.meters.get(self.adapters.get(model, model))
                        if meter is not None:
                            meter.first_byte(ttfb)
                    await self._relay(model, balancer, replica, exchange, responder, stream)
                    self.metrics.latency[model].observe(time.monotonic() - started)
                    return status
                finally:
                    exchange.release()
            finally:
                balancer.finished(replica)
        if last is None:
            message = f"no healthy replica for the model {model!r}"
            self._log_5xx(model, None, 503, message)
            await responder.error(503, message)
            return 503
        self._log_5xx(model, last.replica, last.status, last.why)
        answer_headers = _content_type_of(last.body)
        if last.retry_after:
            answer_headers = [*answer_headers, (b"retry-after", last.retry_after)]
        await responder.whole(last.status, last.body, answer_headers)
        return last.status

    async def _relay(
        self,
        model: str,
        balancer: Balancer,
        replica: Replica,
        exchange: Exchange,
        responder: RecordingResponder,
        stream: bool,
    ) -> None:
        headers = _end_to_end(exchange.headers)
        if exchange.status >= 500:  # an answer such as 501, relayed as the engine gave it
            self._log_5xx(model, replica, exchange.status, "relayed the engine's answer")
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
                self._failed(model, balancer, replica, str(exc))
                self._log_5xx(model, replica, 502, f"the answer broke off: {exc}")
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
            self._failed(model, balancer, replica, str(exc))
            self._log_5xx(model, replica, 502, f"the answer broke off after its head: {exc}")
            sse = _header(exchange.headers, b"content-type").startswith(b"text/event-stream")
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

    def _log_5xx(self, model: str, replica: Replica | None, status: int, why: str) -> None:
        """One line per 5xx sent or relayed, at most one a period for each model and replica."""
        where = str(replica.endpoint) if replica is not None else "-"
        suppressed = self._5xx_log.allow((model, where, status), trio.current_time())
        if suppressed is None:
            return
        more = f" ({suppressed} more since the last line)" if suppressed else ""
        # `why` may quote the engine's own answer: escaped, one line whatever it sent.
        log.warning("%d for %s from replica %s: %s%s", status, model, where, escaped(why), more)

    def _failed(self, model: str, balancer: Balancer, replica: Replica, why: str) -> None:
        self.traffic.failed(self.adapters.get(model, model), replica.endpoint.url)
        if balancer.failed(replica, trio.current_time()):
            self.metrics.ejections[(model, replica.endpoint.url)] += 1
            log.warning(
                "ejected %s for %s after %d failures in a row (last: %s)",
                replica.endpoint,
                model,
                replica.failures,
                why,
            )


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


@attrs.frozen
class _Refusal:
    """The last answer that was not relayed, what the client gets if no replica does better."""

    status: int
    body: bytes
    replica: Replica
    why: str
    retry_after: bytes = b""


def _holder(model: str, balancer: Balancer, holder: Holder) -> Replica | None:
    """The model's replica that `holder` names, available or not: only it holds the
    response, and what it answers (or its failure) is the truth."""
    if holder.model_tag != model_tag(model):
        return None
    for replica in balancer.replicas:
        if replica.rid == holder.rid:
            return replica
    return None


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


def _served_by(responder: Responder, replica: Replica) -> None:
    if isinstance(responder, RecordingResponder):
        responder.record.replica = replica.endpoint.url


def _client_key(request: Request) -> str | None:
    """The digest of a client's API key: `Authorization: Bearer`, or where Anthropic's
    clients send it, `x-api-key` (the first, when both are given)."""
    authorization = x_api_key = None
    for name, value in request.headers:  # one look through the headers
        if name == b"authorization":
            if authorization is None:
                authorization = value
        elif name == b"x-api-key" and x_api_key is None:
            x_api_key = value
    return client_key_digest(authorization, x_api_key)


def _end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers that cross the router, either way: not hop-by-hop ones (the router
    frames what it sends itself, so never the other side's Content-Length or
    Transfer-Encoding), not their lookalikes with `_` for `-` (a peer that reads `_` as
    `-` would take `transfer_encoding` for framing), nor those the Connection header
    names (RFC 9110 section 7.6.1), nor a client's key (`x-api-key`, `api-key`), nor the
    rewrite headers (`x-original-url` and the like)."""
    kept = []
    connection = None  # one pass: a second one for Connection would double its cost
    for name, value in headers:
        if name not in _NOT_FORWARDED:
            kept.append((name, value))
        elif name == b"connection":
            connection = value if connection is None else connection + b"," + value
    if connection is None or connection in _PLAIN_CONNECTION:
        return kept
    named = {t.strip().lower() for t in connection.split(b",")}
    named |= {name.replace(b"-", b"_") for name in named}
    return [(k, v) for k, v in kept if k not in named]


_STORED_READS = (RESPONSES + b"/").decode()


def _auth_failure(record: AccessRecord) -> str | None:
    """The llmgw_auth_failures_total reason of an answer the router made itself."""
    if record.status == 403:
        return "model_not_allowed"
    if record.status != 401:
        return None
    if record.path == "/metrics":
        return "metrics_token"
    return "missing_key" if record.key_id is None else "invalid_key"


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key == name:
            return value
    return b""


def _content_type_of(body: bytes) -> list[tuple[bytes, bytes]]:
    return JSON if body[:1] == b"{" else [(b"content-type", b"text/plain")]
