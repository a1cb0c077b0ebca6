"""Each tenant's limits in this router process: the request plan's admission step
(router.front calls it once a request's model is known, before any wait or attempt).

Who a request belongs to is its key's business alone (`[[auth.keys]] tenant`,
llmgw_core.tenancy_config); `Tenancy.tenant_of` says. A tenant with no limits costs a
request two dictionary lookups and nothing else. A limited one's request reserves its
expected tokens (`reservation`: its prompt's, counted by an engine's tokenizer where the
balancing policy asked one, else estimated from the body's size; and `max_tokens`, or
`[router] reserve_output_tokens` where it names none, within the model's context), is
refused with 429 past a limit (`Refused`: which limit, and when it would fit), and is
settled when its answer ends with what the engine's usage says was used (`settle`):
a stream's own usage, else its events counted, one token each; a client that left is
charged what was generated until then; an answer no engine gave (every replica refused,
none reachable) is charged no tokens.

Limits are kept per tenant and per tenant and model (`[[tenants.models]]`); a request
must fit both. Cost: O(1) a request (llmgw_core.tenant_limits), whatever the number of
tenants; memory: two windows of 61 slots per limited tenant, and per limited model of
one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

import attrs

from llmgw_core.config import Config
from llmgw_core.prometheus import family, labels
from llmgw_core.tenancy_config import DEFAULT_TENANT, LimitFields, TenantEntry
from llmgw_core.tenant_limits import (
    IN_FLIGHT_RETRY_S,
    Limits,
    Refusal,
    Shares,
    TenantLimiter,
    Ticket,
    format_reset,
    retry_after_values,
)
from llmgw_server.router.access_log import AccessRecord

# Bytes of a request body per prompt token, for a prompt no tokenizer counted: English
# text is about 4 bytes a token in the engines' tokenizers, and the body's JSON adds to
# it, so this overestimates a little (the reservation is settled with the usage).
BYTES_PER_TOKEN = 4
# The answer lengths a body may name: chat's (and the newer name), the Responses API's,
# the Messages API's is max_tokens too.
_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# Paths whose answers generate tokens; the others (embeddings, rerank, tokenize, ...)
# reserve their prompt's alone.
GENERATING = frozenset(
    {b"/v1/chat/completions", b"/v1/completions", b"/v1/responses", b"/v1/messages"}
)
REASONS = ("requests", "tokens", "in_flight", "queue_full", "queue_timeout")


def reservation(
    path: bytes,
    body: dict[str, object],
    size: int,
    counted: int | None,
    reserve_output: int,
    context: int | None,
) -> tuple[int, int]:
    """(prompt tokens, output tokens) a request reserves: its prompt `counted` by a
    tokenizer or estimated from its body's `size`, and the answer's bound as the body
    names it (else `reserve_output`), within the model's `context` where it is known
    (a huge max_tokens reserves no more than the model could ever generate)."""
    prompt = counted if counted is not None else -(-size // BYTES_PER_TOKEN)
    output = 0
    if path in GENERATING:
        output = reserve_output
        for name in _OUTPUT_FIELDS:
            named = body.get(name)
            if type(named) is int and named >= 0:
                output = named
                break
    if context is not None:
        prompt = min(prompt, context)
        output = min(output, max(context - prompt, 1))
    return prompt, output


def charged_tokens(record: AccessRecord, events: int, admitted: Admitted) -> int:
    """What a request used, once its answer ended (or its client left): the engine's
    usage where it sent one; else a stream's events relayed, one token each, beside its
    prompt's reservation; nothing where no engine answered; the reservation for an
    answer that said nothing of its usage."""
    prompt, completion = record.prompt_tokens, record.completion_tokens
    if prompt is not None and completion is not None:
        return prompt + completion
    if record.ttfb_s is None or record.replica is None or record.status >= 400:
        return 0 if completion is None else (prompt or 0) + completion
    if events:
        return (prompt if prompt is not None else admitted.prompt) + events
    return admitted.reserved if prompt is None else prompt + (completion or 0)


def _limits(fields: LimitFields) -> Limits:
    return Limits(fields.requests_per_minute, fields.tokens_per_minute, fields.max_in_flight)


def _kept(limiter: TenantLimiter | None, fields: LimitFields) -> TenantLimiter:
    """The limiter of `fields`: the one there was, with its history, if any."""
    if limiter is None:
        return TenantLimiter(_limits(fields))
    limiter.set_limits(_limits(fields))
    return limiter


@attrs.define(slots=True, eq=False)
class Admitted:
    """A limited tenant's admitted request, until `Tenancy.settle`."""

    tenant: str
    reserved: int
    holds: tuple[tuple[TenantLimiter, Ticket], ...]
    headers: list[tuple[bytes, bytes]]
    prompt: int = 0  # of `reserved`, the prompt's tokens (the rest: its answer's bound)


@attrs.frozen
class Refused:
    """Past a limit: answer 429 with these headers (Retry-After and the x-ratelimit-*)."""

    which: str  # one of REASONS
    retry_after_s: float
    headers: list[tuple[bytes, bytes]]


@attrs.define
class TenantCounts:
    """One tenant's figures on /metrics (bounded: the config's tenants and keys)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    queued: int = 0
    refused: defaultdict[str, int] = attrs.Factory(lambda: defaultdict(int))


class Tenancy:
    def __init__(self, config: Config) -> None:
        # Every limited tenant's limiter, and every limited (tenant, model)'s, made as the
        # config is read: a process reports every limit to its hub from its start.
        self._limiters: dict[str, TenantLimiter] = {}
        self._model_limiters: dict[tuple[str, str], TenantLimiter] = {}
        # (tenant, model) -> the limiters its requests must fit: () for an unlimited one.
        self._for: dict[tuple[str, str], tuple[TenantLimiter, ...]] = {}
        self.counts: defaultdict[str, TenantCounts] = defaultdict(TenantCounts)
        # Shares of the limits from a hub (None: this process enforces the whole limits).
        self.shares: dict[str, float] | None = None
        self.shares_version = -1  # the version applied on the current connection
        self.reload(config)

    def reload(self, config: Config) -> None:
        """New tenants and limits; what each has used, and what it has in flight, stays."""
        self.tenant_of = config.auth.tenant_of
        book = config.tenants
        self.entries = book.by_name
        limiters: dict[str, TenantLimiter] = {}
        model_limiters: dict[tuple[str, str], TenantLimiter] = {}
        for entry in book.tenants:
            if entry.limited:
                limiters[entry.name] = _kept(self._limiters.get(entry.name), entry)
            for limits in entry.models:
                if limits.limited:
                    key = (entry.name, limits.model)
                    model_limiters[key] = _kept(self._model_limiters.get(key), limits)
        self._limiters, self._model_limiters = limiters, model_limiters
        self._for.clear()
        self._apply_shares()
        # Counts of tenants no longer named (a key removed) go with them.
        known = set(book.by_name) | set(self.tenant_of.values()) | {DEFAULT_TENANT}
        for name in [n for n in self.counts if n not in known]:
            del self.counts[name]

    def tenant(self, digest: str | None) -> str:
        """The tenant of a request made with the key of `digest` (None: no key)."""
        if digest is None:
            return DEFAULT_TENANT
        return self.tenant_of.get(digest, DEFAULT_TENANT)

    def entry(self, tenant: str) -> TenantEntry | None:
        return self.entries.get(tenant)

    def limiters(self, tenant: str, model: str) -> tuple[TenantLimiter, ...]:
        """What a request of `tenant` for `model` must fit (a model the router serves:
        the keys of this cache are bounded by the config's tenants and models)."""
        key = (tenant, model)
        found = self._for.get(key)
        if found is None:
            chosen = [self._limiters.get(tenant), self._model_limiters.get(key)]
            found = self._for[key] = tuple(x for x in chosen if x is not None)
        return found

    # -- shares of the limits, from a hub (route_feed: Usage up, Shares down) --------

    def _each(self) -> list[tuple[str, str, TenantLimiter]]:
        """(tenant, the limit id's tail: "" or "/<model>", limiter) of every limiter."""
        out = [(name, "", limiter) for name, limiter in self._limiters.items()]
        out += [(name, f"/{model}", lim) for (name, model), lim in self._model_limiters.items()]
        return out

    def usage(self, now: float) -> tuple[dict[str, float], ...]:
        """(totals, have, used, wanted) of every limit, by id: "<tenant>/<kind>" for a
        tenant's, "<tenant>/<kind>/<model>" for its model's; kind: requests, tokens or
        in_flight. `have` is what this process enforces: its share, or the whole limit."""
        totals: dict[str, float] = {}
        have: dict[str, float] = {}
        used: dict[str, float] = {}
        wanted: dict[str, float] = {}
        for name, tail, limiter in self._each():
            limits = limiter.limits
            for kind, total, in_use, effective, refused in (
                ("requests", limits.requests_per_minute, limiter.requests.used(now),
                 limiter.requests.limit, limiter.refused_requests.used(now)),
                ("tokens", limits.tokens_per_minute, limiter.tokens.used(now),
                 limiter.tokens.limit, limiter.refused_tokens.used(now)),
                ("in_flight", limits.max_in_flight, float(limiter.in_flight),
                 limiter.in_flight_cap, limiter.refused_in_flight.used(now)),
            ):  # fmt: skip
                if total is None:
                    continue
                limit_id = f"{name}/{kind}{tail}"
                totals[limit_id] = float(total)
                have[limit_id] = effective
                used[limit_id] = in_use
                wanted[limit_id] = in_use + refused
        return totals, have, used, wanted

    def apply_shares(self, version: int, shares: Mapping[str, float], full: bool) -> None:
        """A hub's grant: every share (`full`: a limit it does not name has 0), or the
        named changes."""
        if full or self.shares is None:
            self.shares = {}
        self.shares.update(shares)
        self.shares_version = version
        self._apply_shares(default=0.0 if full else None)

    def new_connection(self) -> None:
        """A feed to a hub (re)opened: no grant of it applied yet (the shares in effect
        stay until one is)."""
        self.shares_version = -1

    def _apply_shares(self, default: float | None = None) -> None:
        """Each limiter's shares from `self.shares`; a limit it does not name: `default`
        (0 after a full grant), or the share it had (None)."""
        shares = self.shares
        for name, tail, limiter in self._each():
            if shares is None:
                limiter.set_shares(None)
                continue
            had = limiter.shares or Shares()

            def share(kind: str, current: float | None) -> float | None:
                found = shares.get(f"{name}/{kind}{tail}")  # noqa: B023
                if found is not None:
                    return found
                return default if default is not None else current

            limiter.set_shares(
                Shares(
                    share("requests", had.requests),
                    share("tokens", had.tokens),
                    share("in_flight", had.in_flight),
                )
            )

    def admit(
        self,
        tenant: str,
        limiters: tuple[TenantLimiter, ...],
        tokens: int,
        now: float,
        again: bool = False,
    ) -> Admitted | Refused:
        """Admit a request reserving `tokens` against every one of `limiters` (not
        empty), or refuse it (nothing charged) with the longest wait among them.
        `again`: a request refused already, tried once more (not counted twice)."""
        holds: list[tuple[TenantLimiter, Ticket]] = []
        for limiter in limiters:
            outcome = limiter.admit(tokens, now)
            if isinstance(outcome, Refusal):
                for taken, ticket in holds:
                    taken.cancel(ticket, now)
                waits = [outcome.retry_after_s]
                for other in limiters:
                    if other is not limiter:
                        other_wait = _would_wait(other, tokens, now)
                        if other_wait > 0:
                            waits.append(other_wait)
                wait = max(waits)
                if not again:
                    self.counts[tenant].refused[outcome.which] += 1
                return Refused(outcome.which, wait, _headers(limiters, now))
            holds.append((limiter, outcome))
        return Admitted(tenant, tokens, tuple(holds), _headers(limiters, now))

    @staticmethod
    def shared(limiters: tuple[TenantLimiter, ...], which: str) -> bool:
        """Whether a refusal for `which` may be this process's share alone: a limit the
        router processes enforce together, of which this one has less than the whole
        (its hub raises a share where others leave room)."""
        return which in ("requests", "tokens") and any(
            limiter.below_limit(which) for limiter in limiters
        )

    def settle(self, admitted: Admitted, tokens: int, now: float) -> None:
        for limiter, ticket in admitted.holds:
            limiter.settle(ticket, tokens, now)

    def refused(self, tenant: str, why: str) -> None:
        """A request refused after admission (its queue was full, or it waited too long)."""
        self.counts[tenant].refused[why] += 1


def _would_wait(limiter: TenantLimiter, tokens: int, now: float) -> float:
    if limiter.in_flight >= limiter.in_flight_cap:
        return IN_FLIGHT_RETRY_S
    return max(limiter.requests.wait(1, now), limiter.tokens.wait(tokens, now))


def _headers(limiters: tuple[TenantLimiter, ...], now: float) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers: of each kind, the limit with the least remaining
    (what this process may still admit: its share, or the whole limit), the limit as the
    config sets it, and when the window is empty again (in whole seconds, rounded up, or
    milliseconds under one). On every answer of a limited tenant: kept cheap."""
    if len(limiters) == 1:
        limiter = limiters[0]
        after = limiter.after
        if after is not None and after.at == now:  # admitted just now: nothing to look up
            limits = limiter.limits
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            fast: list[tuple[bytes, bytes]] = []
            if rpm is not None:
                fast += _kind(b"requests", rpm, after.requests_room, after.requests_reset_s)
            if tpm is not None:
                fast += _kind(b"tokens", tpm, after.tokens_room, after.tokens_reset_s)
            return fast
    requests: tuple[int, int, float] | None = None
    tokens: tuple[int, int, float] | None = None
    for limiter in limiters:
        limits = limiter.limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        after = limiter.after
        if after is None or after.at != now:
            after = None  # a refusal's headers: looked up
        if rpm is not None:
            window = limiter.requests
            room = window.room(now) if after is None else after.requests_room
            remaining = max(0, math.floor(room))
            if requests is None or remaining < requests[0]:
                reset = window.reset_s(now) if after is None else after.requests_reset_s
                requests = (remaining, rpm, reset)
        if tpm is not None:
            window = limiter.tokens
            room = window.room(now) if after is None else after.tokens_room
            remaining = max(0, math.floor(room))
            if tokens is None or remaining < tokens[0]:
                reset = window.reset_s(now) if after is None else after.tokens_reset_s
                tokens = (remaining, tpm, reset)
    out: list[tuple[bytes, bytes]] = []
    if requests is not None:
        remaining, limit, reset = requests
        out += _kind(b"requests", limit, remaining, reset)
    if tokens is not None:
        remaining, limit, reset = tokens
        out += _kind(b"tokens", limit, remaining, reset)
    return out


def _kind(kind: bytes, limit: int, room: float, reset_s: float) -> tuple[tuple[bytes, bytes], ...]:
    """One kind's three headers: the limit, what remains (whole, never below 0), the reset."""
    return (
        (b"x-ratelimit-limit-" + kind, b"%d" % limit),
        (b"x-ratelimit-remaining-" + kind, b"%d" % max(0, room)),
        (b"x-ratelimit-reset-" + kind, _reset_text(reset_s)),
    )


_RESETS: dict[int, bytes] = {}  # whole seconds -> as OpenAI writes them (at most 62)


def _reset_text(seconds: float) -> bytes:
    if seconds < 1:
        return format_reset(seconds).encode()
    whole = math.ceil(seconds)
    text = _RESETS.get(whole)
    if text is None:
        text = format_reset(whole).encode()
        if len(_RESETS) < 1024:
            _RESETS[whole] = text
    return text


def retry_headers(seconds: float) -> list[tuple[bytes, bytes]]:
    after, after_ms = retry_after_values(seconds)
    return [(b"retry-after", after), (b"retry-after-ms", after_ms)]


def refusal_message(tenant: str, which: str, seconds: float) -> str:
    what = {
        "requests": "requests per minute",
        "tokens": "tokens per minute",
        "in_flight": "requests in flight",
        "queue_full": "requests waiting for this model",
        "queue_timeout": "wait for this model's engines",
    }[which]
    return (
        f"rate limit reached for the tenant {tenant!r}: {what}; try again in "
        f"{math.ceil(seconds * 1000) / 1000:g} s"
    )


def render_tenancy(tenancy: Tenancy, now: float) -> list[str]:
    """The tenants' families on /metrics (their label set: the config's tenants and keys)."""
    counts = tenancy.counts
    out: list[str] = []
    totals, have, _, _ = tenancy.usage(now)
    out += family(
        "llmgw_tenant_limit",
        "gauge",
        "Each limit of a tenant ([[tenants]]; per model with a model label) as the config "
        "sets it, and what this process enforces of it (`share`: the whole limit, or its "
        "share where router processes enforce the limit together).",
    )
    for limit_id in sorted(totals):
        tenant, kind, *model = limit_id.split("/", 2)
        named = {"tenant": tenant, "kind": kind, **({"model": model[0]} if model else {})}
        out.append(f"llmgw_tenant_limit{labels(**named, of='total')} {totals[limit_id]:g}")
        out.append(f"llmgw_tenant_limit{labels(**named, of='share')} {have[limit_id]:g}")
    rows = sorted(counts.items())
    out += family(
        "llmgw_tenant_requests_total",
        "counter",
        "Requests for a model this router serves, by tenant ([[tenants]], a key's own, or "
        "default), admitted or not.",
    )
    out += [f"llmgw_tenant_requests_total{labels(tenant=t)} {c.requests}" for t, c in rows]
    out += family(
        "llmgw_tenant_tokens_total",
        "counter",
        "Tokens in the engines' usage reports, by tenant and kind (prompt or completion).",
    )
    for tenant, c in rows:
        for kind, n in (("prompt", c.prompt_tokens), ("completion", c.completion_tokens)):
            out.append(f"llmgw_tenant_tokens_total{labels(tenant=tenant, kind=kind)} {n}")
    for name, help_text, field in (
        ("llmgw_tenant_requests_in_flight",
         "A tenant's requests admitted and not yet answered (queued ones included).",
         "in_flight"),
        ("llmgw_tenant_requests_queued",
         "A tenant's requests waiting now in a fair queue for a full model's replicas "
         "([router] replica_max_in_flight).",
         "queued"),
    ):  # fmt: skip
        out += family(name, "gauge", help_text)
        out += [f"{name}{labels(tenant=t)} {getattr(c, field)}" for t, c in rows]
    out += family(
        "llmgw_tenant_refused_total",
        "counter",
        "Requests answered 429 for their tenant's limits, by reason: requests "
        "(requests_per_minute), tokens (tokens_per_minute), in_flight (max_in_flight), "
        "queue_full (queue_max_per_tenant), queue_timeout (queue_max_wait_s).",
    )
    for tenant, c in rows:
        for reason in REASONS:
            n = c.refused.get(reason, 0)
            out.append(f"llmgw_tenant_refused_total{labels(tenant=tenant, reason=reason)} {n}")
    return out
