"""A tenant's limits at the gateway: requests a minute, tokens a minute (prompt plus
output) and requests in flight, with what a refused client is told: OpenAI's 429 with
`retry-after` / `retry-after-ms` and its `x-ratelimit-*` headers. Pure: the caller
supplies the times, seconds of a monotonic clock (one that steps back frees nothing).

The per-minute limits are sliding windows, not token buckets (token_bucket.py): a
bucket holding a minute's worth and refilled continuously lets through up to twice its
limit in some 60 s (a full bucket, then the refill), and a tenant told "60,000 tokens a
minute" may count. A window keeps what was charged in the last minute, in slots of a
second (a ring: memory and work per request do not grow with the traffic), and admits a
request only if no 60 s interval would then hold more than the limit.

Tokens are reserved on admission (the prompt's tokens, counted or estimated, and the
most the answer may add) and settled when the answer ends, with the engine's usage: the
reservation's slot gets the difference while it is still in the window. An answer
longer than reserved (an estimate of the prompt too low) is the one way past a limit:
it is charged after the fact, never refused.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, NewType

import attrs

WINDOW_S = 60.0  # the per-minute limits' window
SLOT_S = 1.0  # what a charge's time is rounded to: a window of 61 slots
# A client refused for requests in flight is told to come back in a second: when one
# ends depends on the answers (a stream may run for minutes), so no time is exact.
IN_FLIGHT_RETRY_S = 1.0
# The least retry a refusal names: a wait of 0 reads as no wait at all to the openai
# client (it falls back to its own backoff), and the window's slot arithmetic can leave
# a few nanoseconds.
MIN_RETRY_S = 0.001

# A window's handle on one charge, for its settlement: the charge's absolute slot index
# (floor(time / slot_s)). A plain int underneath, so a ticket holds no other object.
Charge = NewType("Charge", int)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:  # NaN too
        raise ValueError(f"{name} must be above 0, not {value!r}")


class SlidingWindow:
    """What was charged in the last `window_s` seconds, against `limit`.

    The rule it keeps: no interval of `window_s` holds charges (at the times they were
    made, settlements applied to the slot they settle) summing to more than `limit`,
    save by settlements raising a charge after the fact. A charge's time is known only
    to its slot, so admission counts every slot that intersects (now - window_s, now]:
    a charge made at the start of a slot is held up to `slot_s` longer than the rule
    needs, never shorter. The longest wait is therefore window_s + slot_s (from the
    latest time seen: a caller whose clock is behind it is told the difference too).

    An amount above the limit is taken as the limit: it fits an empty window (and fills
    it), else a request larger than the whole limit could never run.

    `limit` may be changed at any time (a reload; this process's share of a limit
    shared with others): what was charged stays charged. math.inf: unlimited, the
    charges still kept, for a limit set later.

    The sums are kept as running totals, exact for whole amounts (tokens, requests);
    fractional amounts are as exact as float addition.
    """

    # A plain class with slots, not attrs: attrs' __setattr__ (for the validated limit)
    # would run on each of the four fields every request writes, 13 us a request.
    __slots__ = (
        "_amounts",
        "_head",
        "_latest",
        "_limit",
        "_plain",
        "_slot_s",
        "_span",
        "_total",
        "_window_s",
    )

    def __init__(self, limit: float, window_s: float = WINDOW_S, slot_s: float = SLOT_S) -> None:
        for name, value in (("window_s", window_s), ("slot_s", slot_s)):
            _check_positive(name, value)
        self._window_s = window_s
        self._slot_s = slot_s
        self.limit = limit
        # A window (now - window_s, now] intersects at most ceil(window_s / slot_s) + 1
        # slots: the ring holds slots head - len + 1 .. head.
        self._amounts = [0.0] * (math.ceil(window_s / slot_s) + 1)
        # Slots of a second and a window of whole seconds (the limits' own shape): the
        # window at any time in the newest slot intersects every slot of the ring, so
        # what it holds is the ring's sum (floor(t - W) = floor(t) - W, exactly).
        self._plain = slot_s == 1.0 and float(window_s).is_integer()
        self._span = len(self._amounts) - 1
        self._total = 0.0  # the ring's sum
        self._head: int | None = None  # the newest slot
        self._latest = -math.inf  # the latest `now` seen

    @property
    def limit(self) -> float:
        return self._limit

    @limit.setter
    def limit(self, value: float) -> None:
        _check_positive("limit", value)
        self._limit = value

    @property
    def window_s(self) -> float:
        return self._window_s

    @property
    def slot_s(self) -> float:
        return self._slot_s

    def __repr__(self) -> str:
        shape = f"window_s={self._window_s!r}, slot_s={self._slot_s!r}"
        return f"SlidingWindow(limit={self._limit!r}, {shape})"

    def _advance(self, now: float) -> int:
        """Brings the ring up to `now` (never back); returns the newest slot."""
        if now > self._latest:
            self._latest = now
        slot = math.floor(self._latest / self._slot_s)
        head = self._head
        if head is None:
            self._head = slot
        elif slot > head:
            amounts = self._amounts
            size = len(amounts)
            # Oldest first: wait() subtracts the leaving slots in this order, so that
            # the total it predicts is the very float this arrives at.
            for index in range(head + 1, min(slot, head + size) + 1):
                position = index % size
                self._total -= amounts[position]
                amounts[position] = 0.0
            self._head = slot
        return slot

    def _first(self, now: float, head: int) -> int:
        """The oldest slot the window at `now` intersects: one of the ring's two oldest
        (the oldest is out when window_s / slot_s is fractional)."""
        oldest = head - len(self._amounts) + 1
        return min(max(math.floor((now - self._window_s) / self._slot_s), oldest), oldest + 1)

    def _used(self, head: int) -> tuple[float, int]:
        """The window's sum at the latest time seen, and its oldest slot."""
        if self._plain:
            return self._total, head - self._span
        first = self._first(self._latest, head)
        if first == head - len(self._amounts) + 1:
            return self._total, first
        return self._total - self._amounts[(first - 1) % len(self._amounts)], first

    def used(self, now: float) -> float:
        """What the window holds at `now`."""
        return self._used(self._advance(now))[0]

    def room(self, now: float) -> float:
        """What may still be charged: below 0 after a settlement raised a charge."""
        return self._limit - self.used(now)

    def fits(self, amount: float, now: float) -> bool:
        """Whether `amount` (taken as the limit where above it) may be charged now."""
        used = self._used(self._advance(now))[0]
        return used + min(amount, self._limit) <= self._limit

    def charge(self, amount: float, now: float) -> Charge:
        """Charges `amount` at `now`, fitting or not (the caller asked `fits`)."""
        if amount < 0:
            raise ValueError(f"a charge is never negative, not {amount!r}")
        head = self._advance(now)
        self._amounts[head % len(self._amounts)] += amount
        self._total += amount
        return Charge(head)

    def adjust(self, charge: Charge, delta: float, now: float) -> None:
        """A settlement: `delta` added to `charge`. While its slot is in the window the
        slot takes it (never below 0: it frees what the slot holds, no more); once the
        slot has left, a rise is charged now (a debt: the tokens were used, however
        late they are told) and a fall is dropped (nothing is left to free)."""
        head = self._advance(now)
        amounts = self._amounts
        first = head - self._span if self._plain else self._first(self._latest, head)
        if first <= charge <= head:
            position = charge % len(amounts)
            before = amounts[position]
            after = max(0.0, before + delta)
            amounts[position] = after
            self._total += after - before
        elif delta > 0:
            amounts[head % len(amounts)] += delta
            self._total += delta

    def _until(self, first: int, now: float) -> float:
        """Seconds from `now` until the window starts at slot `first` or later: exact,
        in that the window at now + the answer starts there (nudged up by the ulps
        that float rounding of the subtraction can lose)."""
        wait = first * self._slot_s + self._window_s - now
        for _ in range(64):
            at = now + wait
            if math.floor((at - self._window_s) / self._slot_s) >= first:
                break
            # A step both sums feel: the larger of the two ulps (a wait larger than the
            # time, from a clock behind, would round a step of the time's ulp away).
            wait += max(math.ulp(at), math.ulp(wait))
        return max(wait, 0.0)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` (taken as the limit where above it) fits, if nothing
        else is charged meanwhile; 0 if it fits now. The slots leave oldest first, each
        at the end of its last window; the answer is the moment the one that makes
        room leaves."""
        head = self._advance(now)
        used, first = self._used(head)
        amount = min(amount, self._limit)
        # The test is fits' own, on the very floats _advance will leave: exact.
        if used + amount <= self._limit:
            return 0.0
        amounts = self._amounts
        size = len(amounts)
        slot = first
        while slot <= head:
            used -= amounts[slot % size]
            slot += 1
            if used + amount <= self._limit:
                break
        # Whole amounts always fit once every slot is gone; fractional ones may miss by
        # a rounding, and then the window is empty anyway.
        return self._until(slot, now)

    def reset_s(self, now: float) -> float:
        """Seconds until the window holds nothing: OpenAI's x-ratelimit-reset-*, "the
        time until the rate limit resets to its initial state". 0 if it is empty."""
        head = self._advance(now)
        used, first = self._used(head)
        if used <= 0:
            return 0.0
        amounts = self._amounts
        size = len(amounts)
        # Newest first: under load the newest slot holds something and this stops at once.
        for slot in range(head, first - 1, -1):
            if amounts[slot % size] > 0:
                return self._until(slot + 1, now)
        return 0.0


def _at_least_one(
    _instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be at least 1 or None (unlimited), not {value}")


@attrs.frozen
class Limits:
    """One tenant's limits in this process; None: unlimited. A limit of 0 is no limit
    a window can keep (its one request would always fit an empty window): a tenant
    allowed nothing is refused before it gets here."""

    requests_per_minute: int | None = attrs.field(default=None, validator=_at_least_one)
    tokens_per_minute: int | None = attrs.field(default=None, validator=_at_least_one)
    max_in_flight: int | None = attrs.field(default=None, validator=_at_least_one)

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_in_flight is None
        )


def _window_limit(limit: int | None) -> float:
    return math.inf if limit is None else float(limit)


# The least share a process enforces: a window's limit must be above 0.
SHARE_FLOOR = 1e-6


class After(NamedTuple):
    """Each window's room and time until it is empty, right after an admission at `at`."""

    at: float
    requests_room: float
    requests_reset_s: float
    tokens_room: float
    tokens_reset_s: float


@attrs.frozen
class Shares:
    """A process's shares of a tenant's limits (None: that limit's share is not known:
    the whole limit)."""

    requests: float | None = None
    tokens: float | None = None
    in_flight: float | None = None


def _shared(limit: float, share: float | None) -> float:
    if share is None or limit == math.inf:  # no share, or nothing to share
        return limit
    return min(limit, max(share, SHARE_FLOOR))


@attrs.define
class Ticket:
    """An admitted request's hold on its tenant's limits, until `settle`."""

    reserved: int  # the tokens charged on admission
    charge: Charge  # where they were charged, for the settlement
    settled: bool = False


@attrs.frozen
class Refusal:
    """A request that does not fit: `which` limit keeps it out longest, and how long
    until it would fit (if nothing else is admitted meanwhile): at least MIN_RETRY_S,
    at most a window and a slot (61 s: a charge made at the start of a slot is held
    until that slot's end is a window old), IN_FLIGHT_RETRY_S for in_flight alone."""

    which: Literal["requests", "tokens", "in_flight"]
    retry_after_s: float


@attrs.frozen
class RateHeaders:
    """Values for OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}
    headers; None where that limit is not set (the header is not sent)."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None


@attrs.define
class TenantLimiter:
    """One tenant's limits in this process. Charges are kept with no limit set too, so
    that `set_limits` (a reload, or the router's share of a limit shared with other
    processes changing) applies a new limit to the minute that has passed."""

    limits: Limits
    requests: SlidingWindow = attrs.field(init=False)
    tokens: SlidingWindow = attrs.field(init=False)
    in_flight: int = attrs.field(init=False, default=0)
    shares: Shares | None = attrs.field(init=False, default=None)
    in_flight_cap: float = attrs.field(init=False, default=math.inf)
    # What an admission left (room and reset of each window, at `at`), for the answer's
    # headers without looking at the windows again.
    after: After | None = attrs.field(init=False, default=None)
    # What was refused lately: the demand beyond this process's share, which its hub
    # reads to move shares where they are wanted (in flight: over a few seconds).
    refused_requests: SlidingWindow = attrs.field(
        init=False, factory=lambda: SlidingWindow(math.inf)
    )
    refused_tokens: SlidingWindow = attrs.field(init=False, factory=lambda: SlidingWindow(math.inf))
    refused_in_flight: SlidingWindow = attrs.field(
        init=False, factory=lambda: SlidingWindow(math.inf, window_s=5.0)
    )

    def __attrs_post_init__(self) -> None:
        self.requests = SlidingWindow(_window_limit(self.limits.requests_per_minute))
        self.tokens = SlidingWindow(_window_limit(self.limits.tokens_per_minute))
        self._enforce()

    def set_limits(self, limits: Limits) -> None:
        """New limits from now on; what was charged, and what is in flight, stays (a
        lower max_in_flight refuses until enough answers end)."""
        self.limits = limits
        self._enforce()

    def set_shares(self, shares: Shares | None) -> None:
        """This process's shares of the limits, which other processes enforce together
        with it (None: it enforces the whole limits itself). A share is never above its
        limit, and never below SHARE_FLOOR: a window that holds nothing still takes one
        request, whatever its size (see SlidingWindow), so a process with a share of
        almost nothing admits at most one request a window beyond it."""
        self.shares = shares
        self._enforce()

    def _enforce(self) -> None:
        limits, shares = self.limits, self.shares
        rpm, tpm = (
            _window_limit(limits.requests_per_minute),
            _window_limit(limits.tokens_per_minute),
        )
        cap = math.inf if limits.max_in_flight is None else float(limits.max_in_flight)
        if shares is not None:
            rpm = _shared(rpm, shares.requests)
            tpm = _shared(tpm, shares.tokens)
            cap = _shared(cap, shares.in_flight)
        self.requests.limit, self.tokens.limit, self.in_flight_cap = rpm, tpm, cap

    def below_limit(self, which: str) -> bool:
        """Whether this process enforces less of the limit `which` than the whole: a
        share of a limit that others enforce too, which its hub may raise."""
        if self.shares is None:
            return False
        whole = {
            "requests": _window_limit(self.limits.requests_per_minute),
            "tokens": _window_limit(self.limits.tokens_per_minute),
            "in_flight": math.inf
            if self.limits.max_in_flight is None
            else float(self.limits.max_in_flight),
        }[which]
        enforced = {
            "requests": self.requests.limit,
            "tokens": self.tokens.limit,
            "in_flight": self.in_flight_cap,
        }[which]
        return enforced < whole

    def admit(self, tokens: int, now: float) -> Ticket | Refusal:
        """Admits a request reserving `tokens` (its prompt's, counted or estimated, and
        the most its answer may add), or says why not and for how long."""
        full = self.in_flight >= self.in_flight_cap
        if not full:
            # The admission every request of a limited tenant takes, in one look at each
            # window, leaving what the answer's x-ratelimit-* headers say (`after`).
            requests, window = self.requests, self.tokens
            r_head = requests._advance(now)
            r_used = requests._used(r_head)[0]
            r_limit = requests._limit
            if r_used + min(1.0, r_limit) <= r_limit:
                t_head = window._advance(now)
                t_used = window._used(t_head)[0]
                t_limit = window._limit
                if t_used + min(tokens, t_limit) <= t_limit:
                    requests._amounts[r_head % len(requests._amounts)] += 1
                    requests._total += 1
                    window._amounts[t_head % len(window._amounts)] += tokens
                    window._total += tokens
                    self.in_flight += 1
                    self.after = After(
                        now,
                        r_limit - r_used - 1,
                        requests._until(r_head + 1, now),
                        t_limit - t_used - tokens,
                        window._until(t_head + 1, now),
                    )
                    return Ticket(tokens, Charge(t_head))
        requests_wait = self.requests.wait(1, now)
        tokens_wait = self.tokens.wait(tokens, now)
        self.refused_requests.charge(1, now)
        self.refused_tokens.charge(tokens, now)
        if full:
            self.refused_in_flight.charge(1, now)
        # It fits only when every limit lets it: the longest wait is the one to tell.
        which: Literal["requests", "tokens", "in_flight"] = "in_flight"
        wait = IN_FLIGHT_RETRY_S if full else 0.0
        if requests_wait > wait:
            which, wait = "requests", requests_wait
        if tokens_wait > wait:
            which, wait = "tokens", tokens_wait
        return Refusal(which, max(wait, MIN_RETRY_S))

    def settle(self, ticket: Ticket, actual_tokens: int, now: float) -> None:
        """The answer ended, or its client left: `actual_tokens` (prompt and what was
        generated, by the engine's usage) replace the reservation. Once per ticket: a
        second settlement (a cancel racing the end) changes nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        self.in_flight -= 1
        self.tokens.adjust(ticket.charge, actual_tokens - ticket.reserved, now)

    def cancel(self, ticket: Ticket, now: float) -> None:
        """Take back an admission that did not go ahead (another limit of the same
        request refused it): its request and tokens are no longer charged."""
        if ticket.settled:
            return
        ticket.settled = True
        self.in_flight -= 1
        self.requests.adjust(ticket.charge, -1, now)
        self.tokens.adjust(ticket.charge, -ticket.reserved, now)

    def headers(self, now: float) -> RateHeaders:
        """The x-ratelimit-* values at `now`: whole numbers floored, remaining never
        below 0 (a late settlement can leave a window above its limit)."""
        limits = self.limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        return RateHeaders(
            limit_requests=rpm,
            remaining_requests=None if rpm is None else _remaining(self.requests, now),
            reset_requests_s=None if rpm is None else self.requests.reset_s(now),
            limit_tokens=tpm,
            remaining_tokens=None if tpm is None else _remaining(self.tokens, now),
            reset_tokens_s=None if tpm is None else self.tokens.reset_s(now),
        )


def _remaining(window: SlidingWindow, now: float) -> int:
    return max(0, math.floor(window.room(now)))


def _whole_ms_up(seconds: float) -> int:
    """Milliseconds rounded up, never below `seconds` (a float product can round below
    a whole number the true one is above)."""
    ms = math.ceil(seconds * 1000)
    return ms + 1 if ms / 1000 < seconds else ms


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes x-ratelimit-reset-*: Go's Duration format at
    millisecond precision. Rounded up to the millisecond (after dropping float noise
    below a microsecond: 8.64 s is "8.64s", not "8.641s"); below a second whole
    milliseconds, "6ms"; from a second up hours, minutes and seconds with the
    seconds' fraction trimmed of zeros, the larger units only when not 0 and the
    smaller ones always after them: "1.5s", "1m0s", "1m30.5s", "1h0m0s"; 0 (or
    less) is "0s"."""
    ms = math.ceil(round(seconds * 1000, 3)) if seconds > 0 else 0
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    whole, fraction = divmod(ms, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0") if fraction else str(whole)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"


def retry_after_values(seconds: float) -> tuple[bytes, bytes]:
    """The `retry-after` (whole seconds, rounded up, at least 1) and `retry-after-ms`
    (milliseconds, rounded up, at least 1) of a 429 telling the client to wait
    `seconds`.

    What the openai Python client (3.57.0, openai/_base_client.py) does with them:
    `_parse_retry_after_header` reads `retry-after-ms` first, as a float divided by
    1000; if absent or not a number, `retry-after` as a float of seconds (fractions
    accepted), and last `retry-after` as an HTTP date. `_should_retry` then gives up at
    once, raising the 429, when that delay is finite and above MAX_RETRY_AFTER_DELAY
    (2 * 60 = 120 s); otherwise it retries a 429 (max_retries, 2 by default).
    `_calculate_retry_timeout` sleeps exactly the delay when 0 < delay <= 120 s, and
    otherwise (no header, 0, negative) its own backoff: 0.5 s doubled each retry, at
    most 8 s, less up to 25% jitter.

    So the client sleeps our retry-after-ms, to the millisecond, rounded up so it is
    never early; at least 1 ms, since 0 would put it back on its backoff; and a wait is
    at most a window and a slot (61 s), under its 120 s, so never read as "do not
    retry". retry-after is for clients that read only that one (rounded up: early
    retries are refused again).
    """
    return (
        str(max(1, math.ceil(seconds))).encode(),
        str(max(1, _whole_ms_up(seconds))).encode(),
    )
