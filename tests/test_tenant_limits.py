"""A tenant's limits (llmgw_core.tenant_limits): whatever is admitted, settled, waited
and reconfigured, no 60 s holds more than a limit save by settlements raised after the
fact, a refusal comes only when the request would not fit, and a client coming back
when told is admitted (one slot earlier it is not)."""

from __future__ import annotations

import math

import attrs
import httpx2
import hypothesis.strategies as st
import openai
import pytest
from hypothesis import event, given
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from openai._models import FinalRequestOptions

from llmgw_core.tenant_limits import (
    IN_FLIGHT_RETRY_S,
    MIN_RETRY_S,
    SLOT_S,
    WINDOW_S,
    Charge,
    Limits,
    RateHeaders,
    Refusal,
    Shares,
    SlidingWindow,
    TenantLimiter,
    Ticket,
    format_reset,
    retry_after_values,
)

# ---------------------------------------------------------------- SlidingWindow


def test_an_empty_window_takes_up_to_its_limit() -> None:
    window = SlidingWindow(10)
    assert window.used(5.0) == 0 and window.room(5.0) == 10
    assert window.fits(10, 5.0)
    window.charge(4, 5.0)
    window.charge(6, 5.5)
    assert window.used(5.5) == 10 and window.room(5.5) == 0
    assert not window.fits(1, 5.5)
    assert window.fits(0, 5.5)


def test_a_charge_is_held_until_its_slot_is_a_window_old() -> None:
    # Charged at 10.0 and 10.999, both in slot 10 ([10, 11)): held while any time of
    # that slot is within 60 s, to 71.0, not 70.0 (conservative by under a slot).
    window = SlidingWindow(10)
    first = window.charge(3, 10.0)
    window.charge(4, 10.999)
    assert first == Charge(10)
    assert window.used(70.0) == 7
    assert window.used(70.999) == 7
    assert window.used(71.0) == 0


def test_charges_leave_slot_by_slot() -> None:
    window = SlidingWindow(100)
    for t in range(5):
        window.charge(t + 1, t + 0.5)  # 1 at 0.5, 2 at 1.5, ... 5 at 4.5
    assert window.used(60.0) == 15
    assert window.used(61.0) == 14
    assert window.used(63.25) == 9
    assert window.used(65.0) == 0


def test_wait_is_exact_to_the_slot_boundary() -> None:
    window = SlidingWindow(10)
    window.charge(6, 0.5)
    window.charge(4, 20.25)
    assert window.wait(4, 30.0) == pytest.approx(31.0)  # slot 0 leaves at 61.0
    assert not window.fits(4, 60.999)
    assert window.fits(4, 30.0 + window.wait(4, 30.0))
    assert window.wait(7, 61.0) == pytest.approx(20.0)  # then slot 20, at 81.0
    assert not window.fits(7, 80.9)
    assert window.fits(7, 81.0)
    assert window.wait(7, 81.0) == 0


def test_wait_needs_only_the_slots_that_make_room() -> None:
    window = SlidingWindow(10)
    window.charge(2, 0.0)
    window.charge(2, 1.0)
    window.charge(2, 2.0)
    window.charge(4, 3.0)
    assert window.wait(3, 10.0) == pytest.approx(52.0)  # slots 0 and 1 gone: 62.0
    assert window.wait(1, 10.0) == pytest.approx(51.0)
    assert window.wait(10, 10.0) == pytest.approx(54.0)  # all gone: 64.0


def test_wait_comes_true_from_times_the_float_subtraction_rounds() -> None:
    # 61 - 0.1 rounds; 0.1 + (61 - 0.1) must still land in the window starting at slot 1.
    for now in (0.1, 0.3, 0.7, 1e-9, 12345.678):
        window = SlidingWindow(1)
        window.charge(1, now)
        wait = window.wait(1, now)
        assert math.floor((now + wait - WINDOW_S) / SLOT_S) == math.floor(now) + 1
        assert window.fits(1, now + wait)


def test_an_amount_above_the_limit_fits_an_empty_window_only() -> None:
    window = SlidingWindow(10)
    assert window.fits(25, 0.0)
    window.charge(25, 0.0)
    assert window.room(0.0) == -15
    assert not window.fits(25, 30.0)
    assert not window.fits(1, 30.0)
    assert window.wait(25, 30.0) == pytest.approx(31.0)  # until the window is empty
    assert window.fits(25, 61.0)


def test_settling_down_frees_room_in_the_charge_slot() -> None:
    window = SlidingWindow(10)
    charge = window.charge(8, 1.0)
    window.charge(1, 2.0)
    window.adjust(charge, -5, 30.0)
    assert window.used(30.0) == 4
    assert window.fits(6, 30.0)
    # The slot keeps what is left, and leaves when it would have.
    assert window.used(61.5) == 4
    assert window.used(62.0) == 1
    assert window.used(63.0) == 0


def test_settling_down_never_takes_a_slot_below_zero() -> None:
    window = SlidingWindow(10)
    charge = window.charge(3, 1.0)
    window.charge(2, 5.0)
    window.adjust(charge, -7, 6.0)
    assert window.used(6.0) == 2
    window.charge(8, 6.0)
    assert window.used(6.0) == 10


def test_settling_up_raises_the_charge_past_the_limit() -> None:
    window = SlidingWindow(10)
    charge = window.charge(8, 1.0)
    window.adjust(charge, 5, 20.0)
    assert window.used(20.0) == 13
    assert window.room(20.0) == -3
    assert window.wait(1, 20.0) == pytest.approx(42.0)  # the raised slot leaves at 62.0
    assert window.used(62.0) == 0


def test_settling_after_the_slot_left_charges_a_rise_now_and_drops_a_fall() -> None:
    window = SlidingWindow(10)
    up = window.charge(4, 1.0)
    down = window.charge(4, 1.5)
    window.adjust(up, 3, 100.0)  # a debt: charged to slot 100
    assert window.used(100.0) == 3
    window.adjust(down, -4, 100.0)  # slot 1 is long gone: nothing to free
    assert window.used(100.0) == 3
    assert window.used(160.9) == 3
    assert window.used(161.0) == 0


def test_a_new_limit_applies_to_what_was_charged() -> None:
    window = SlidingWindow(10)
    window.charge(8, 0.0)
    window.limit = 5
    assert window.room(1.0) == -3
    assert not window.fits(1, 1.0)
    assert window.wait(1, 1.0) == pytest.approx(60.0)
    window.limit = 100
    assert window.fits(92, 1.0) and not window.fits(93, 1.0)
    window.limit = math.inf
    assert window.fits(10**9, 1.0) and window.wait(10**9, 1.0) == 0
    with pytest.raises(ValueError):
        window.limit = 0
    with pytest.raises(ValueError):
        window.limit = math.nan
    with pytest.raises(AttributeError):
        window.window_s = 30.0  # type: ignore[misc]


def test_a_clock_stepping_back_frees_nothing() -> None:
    window = SlidingWindow(10)
    window.charge(6, 100.0)
    assert window.used(50.0) == 6
    assert window.used(200.0) == 0
    window.charge(4, 300.0)
    late = window.charge(5, 250.0)  # 50 s behind: charged at the latest time seen
    assert late == Charge(300)
    assert window.used(100.0) == 9
    assert window.used(360.9) == 9
    # A wait is from the caller's own clock: 61 s from 300, 111 s from 250.
    assert window.wait(10, 250.0) == pytest.approx(111.0)
    assert window.used(361.0) == 0


def test_reset_is_when_the_window_holds_nothing() -> None:
    window = SlidingWindow(10)
    assert window.reset_s(0.0) == 0
    older = window.charge(2, 0.5)
    newer = window.charge(3, 20.5)
    assert window.reset_s(30.0) == pytest.approx(51.0)
    window.adjust(newer, -3, 30.0)  # the newest slot emptied: the older one decides
    assert window.reset_s(30.0) == pytest.approx(31.0)
    window.adjust(older, -2, 30.0)
    assert window.reset_s(30.0) == 0


def test_a_window_not_a_whole_number_of_slots() -> None:
    # 10 s in slots of 3: a window intersects 4 or 5 of them (a ring of 5).
    window = SlidingWindow(5, window_s=10.0, slot_s=3.0)
    window.charge(5, 0.0)  # slot 0: [0, 3), held while it meets (now - 10, now]: to 13
    assert window.used(12.9) == 5
    assert window.used(13.0) == 0
    window.charge(5, 13.0)  # slot 4: [12, 15), to 25
    assert window.wait(1, 14.0) == pytest.approx(11.0)
    assert window.used(24.9) == 5 and window.used(25.0) == 0


def test_a_window_refuses_what_makes_no_sense() -> None:
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError):
            SlidingWindow(bad)
    with pytest.raises(ValueError):
        SlidingWindow(10, slot_s=0)
    with pytest.raises(ValueError):
        SlidingWindow(10).charge(-1, 0.0)


# ---------------------------------------------------------------- TenantLimiter


def test_limits_say_whether_any_is_set() -> None:
    assert Limits().unlimited
    assert not Limits(max_in_flight=1).unlimited
    with pytest.raises(ValueError):
        Limits(requests_per_minute=0)


def test_admitting_charges_a_request_its_tokens_and_a_place_in_flight() -> None:
    limiter = TenantLimiter(Limits(requests_per_minute=3, tokens_per_minute=1000, max_in_flight=5))
    ticket = limiter.admit(400, 1.0)
    assert isinstance(ticket, Ticket) and ticket.reserved == 400
    assert limiter.in_flight == 1
    assert limiter.headers(1.0) == RateHeaders(
        limit_requests=3,
        remaining_requests=2,
        reset_requests_s=61.0,  # slot 1 leaves at 62.0
        limit_tokens=1000,
        remaining_tokens=600,
        reset_tokens_s=61.0,
    )


def test_requests_per_minute_refuses_until_the_oldest_leaves() -> None:
    limiter = TenantLimiter(Limits(requests_per_minute=2))
    assert isinstance(limiter.admit(0, 0.25), Ticket)
    assert isinstance(limiter.admit(0, 10.5), Ticket)
    refusal = limiter.admit(0, 30.0)
    assert isinstance(refusal, Refusal) and refusal.which == "requests"
    assert refusal.retry_after_s == pytest.approx(31.0)
    assert isinstance(limiter.admit(0, 30.0 + refusal.retry_after_s - SLOT_S), Refusal)
    assert isinstance(limiter.admit(0, 30.0 + refusal.retry_after_s), Ticket)


def test_tokens_per_minute_refuses_until_enough_leave() -> None:
    limiter = TenantLimiter(Limits(tokens_per_minute=1000))
    for t, tokens in ((0.0, 300), (5.5, 300), (12.0, 300)):
        assert isinstance(limiter.admit(tokens, t), Ticket)
    refusal = limiter.admit(500, 20.0)
    assert isinstance(refusal, Refusal) and refusal.which == "tokens"
    assert refusal.retry_after_s == pytest.approx(46.0)  # slot 5 leaves at 66.0
    assert isinstance(limiter.admit(500, 20.0 + refusal.retry_after_s - SLOT_S), Refusal)
    assert isinstance(limiter.admit(500, 20.0 + refusal.retry_after_s), Ticket)


def test_in_flight_refuses_for_a_second_until_an_answer_ends() -> None:
    limiter = TenantLimiter(Limits(max_in_flight=1))
    ticket = limiter.admit(10, 0.0)
    assert isinstance(ticket, Ticket)
    assert limiter.admit(10, 0.0) == Refusal("in_flight", IN_FLIGHT_RETRY_S)
    limiter.settle(ticket, 12, 0.5)
    assert limiter.in_flight == 0
    assert isinstance(limiter.admit(10, 0.5), Ticket)


def test_a_refusal_names_the_longest_wait() -> None:
    limiter = TenantLimiter(Limits(requests_per_minute=1, tokens_per_minute=100, max_in_flight=1))
    assert isinstance(limiter.admit(100, 0.0), Ticket)
    # All three are full: the windows' 61 s outlast in flight's 1 s.
    refusal = limiter.admit(10, 0.0)
    assert isinstance(refusal, Refusal) and refusal.which in ("requests", "tokens")
    assert refusal.retry_after_s == pytest.approx(61.0)
    limiter.set_limits(Limits(requests_per_minute=5, tokens_per_minute=1000, max_in_flight=1))
    assert limiter.admit(10, 0.0) == Refusal("in_flight", IN_FLIGHT_RETRY_S)


def test_a_refusal_waits_at_least_the_minimum() -> None:
    limiter = TenantLimiter(Limits(requests_per_minute=1))
    assert isinstance(limiter.admit(0, 0.0), Ticket)
    now = 61.0 - 1e-7  # slot 0 leaves in 100 ns
    refusal = limiter.admit(0, now)
    assert refusal == Refusal("requests", MIN_RETRY_S)
    assert isinstance(limiter.admit(0, now + MIN_RETRY_S), Ticket)


def test_more_tokens_than_the_whole_limit_run_alone() -> None:
    limiter = TenantLimiter(Limits(tokens_per_minute=1000))
    assert isinstance(limiter.admit(5000, 0.0), Ticket)
    refusal = limiter.admit(1, 1.0)
    assert isinstance(refusal, Refusal) and refusal.which == "tokens"
    assert limiter.headers(1.0).remaining_tokens == 0
    assert isinstance(limiter.admit(5000, 61.0), Ticket)  # alone in its window again


def test_settling_replaces_the_reservation_once() -> None:
    limiter = TenantLimiter(Limits(tokens_per_minute=1000))
    ticket = limiter.admit(800, 0.0)
    assert isinstance(ticket, Ticket)
    limiter.settle(ticket, 300, 10.0)
    assert limiter.tokens.used(10.0) == 300 and limiter.in_flight == 0
    limiter.settle(ticket, 900, 11.0)  # settled already: nothing
    assert limiter.tokens.used(11.0) == 300 and limiter.in_flight == 0
    other = limiter.admit(100, 12.0)
    assert isinstance(other, Ticket)
    limiter.settle(other, 1200, 13.0)  # longer than reserved: past the limit
    assert limiter.tokens.used(13.0) == 1500
    assert limiter.headers(13.0).remaining_tokens == 0
    assert isinstance(limiter.admit(0, 13.0), Refusal)


def test_a_settlement_after_the_window_charges_its_rise_now() -> None:
    limiter = TenantLimiter(Limits(tokens_per_minute=1000))
    ticket = limiter.admit(100, 0.0)
    assert isinstance(ticket, Ticket)
    limiter.settle(ticket, 700, 90.0)  # a 90 s stream reserved too little
    assert limiter.tokens.used(90.0) == 600
    assert limiter.headers(90.0).remaining_tokens == 400


def test_new_limits_apply_to_the_minute_past() -> None:
    limiter = TenantLimiter(Limits())
    for t in range(4):
        assert isinstance(limiter.admit(100, float(t)), Ticket)
    assert limiter.headers(4.0) == RateHeaders(None, None, None, None, None, None)
    limiter.set_limits(Limits(requests_per_minute=4, tokens_per_minute=350, max_in_flight=4))
    headers = limiter.headers(4.0)
    assert (headers.remaining_requests, headers.remaining_tokens) == (0, 0)
    assert headers.reset_requests_s == pytest.approx(60.0)
    refusal = limiter.admit(10, 4.0)
    assert isinstance(refusal, Refusal) and refusal.which == "requests"
    limiter.set_limits(Limits(requests_per_minute=10))
    assert isinstance(limiter.admit(10, 4.0), Ticket)
    assert limiter.headers(4.0).limit_tokens is None


# ---------------------------------------------------------------- the headers' values


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0004, "1ms"),
        (0.006, "6ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (0.9991, "1s"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.0001, "59.001s"),
        (60.0, "1m0s"),
        (61.0, "1m1s"),
        (90.5, "1m30.5s"),
        (360.0, "6m0s"),
        (3600.0, "1h0m0s"),
        (3725.25, "1h2m5.25s"),
    ],
)
def test_format_reset_writes_what_openai_sends(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "values"),
    [
        (MIN_RETRY_S, (b"1", b"1")),
        (0.0001, (b"1", b"1")),
        (0.5, (b"1", b"500")),
        (1.0, (b"1", b"1000")),
        (1.5, (b"2", b"1500")),
        (31.0000001, (b"32", b"31001")),
        (61.0, (b"61", b"61000")),
    ],
)
def test_retry_after_values(seconds: float, values: tuple[bytes, bytes]) -> None:
    assert retry_after_values(seconds) == values


@given(st.floats(min_value=0, max_value=WINDOW_S + SLOT_S, allow_subnormal=False))
def test_retry_after_is_never_early(seconds: float) -> None:
    whole, ms = (int(value) for value in retry_after_values(seconds))
    assert whole >= max(1, seconds) and whole - 1 < max(1, seconds)
    assert ms / 1000 >= seconds and ms >= 1
    assert ms <= max(1, math.ceil(seconds * 1000) + 1)


def test_the_openai_client_sleeps_what_retry_after_ms_says() -> None:
    # The client's private methods (openai/_base_client.py), as retry_after_values'
    # docstring describes them: our values are read as we mean them.
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    for seconds in (MIN_RETRY_S, 0.25, 1.5, 31.0000001, WINDOW_S + SLOT_S):
        whole, ms = retry_after_values(seconds)
        headers = httpx2.Headers({"retry-after": whole.decode(), "retry-after-ms": ms.decode()})
        assert client._should_retry(httpx2.Response(429, headers=headers))
        slept = client._calculate_retry_timeout(2, options, headers)
        assert slept == int(ms) / 1000 and slept >= seconds
        alone = httpx2.Headers({"retry-after": whole.decode()})  # a client reading seconds
        assert client._calculate_retry_timeout(2, options, alone) == int(whole) >= seconds
    # What a 0 or a wait over 120 s would do: back off on its own, or not retry at all.
    zero = httpx2.Headers({"retry-after-ms": "0"})
    assert client._calculate_retry_timeout(2, options, zero) <= 0.5
    assert not client._should_retry(httpx2.Response(429, headers={"retry-after-ms": "120001"}))


# ---------------------------------------------------------------- one tenant's traffic


@attrs.define
class Charged:
    """One charge of the tenant's tokens, as the model keeps it."""

    seq: int  # when, in the order of events
    at: float  # the time it was charged (the latest time the limiter had seen)
    slot: int
    amount: float  # with its settlement, if its slot took it
    debt: bool = False  # a settlement's rise charged after its slot left
    rises: list[tuple[int, float]] = attrs.Factory(list)  # (seq, delta) raised in its slot


@attrs.define
class Admitted:
    seq: int
    at: float
    tokens: int
    limits: Limits


LIMITS = st.builds(
    Limits,
    st.none() | st.integers(1, 6),
    st.none() | st.integers(50, 600),
    st.none() | st.integers(1, 4),
)
STEPS = st.sampled_from(
    [0.0, 0.001, 0.125, 0.5, 0.999, 1.0, 7.25, 30.0, 59.0, 59.875, 60.0, 61.0, 120.0]
)


class TenantTraffic(RuleBasedStateMachine):
    """A tenant's admissions, settlements (down, up, late, twice), clocks stepping on and
    back and limits changing, against a model keeping every charge."""

    @initialize(limits=LIMITS, start=st.sampled_from([0.0, 0.25, 1000.5, 123456.75]))
    def start(self, limits: Limits, start: float) -> None:
        self.limiter = TenantLimiter(limits)
        self.limits = limits
        self.now = start  # the caller's clock
        self.latest = start  # the latest time the limiter has seen
        self.seq = 0
        self.requests: list[Charged] = []
        self.tokens: list[Charged] = []
        self.admitted: list[Admitted] = []
        self.open: list[tuple[Ticket, Charged]] = []
        self.settled: list[Ticket] = []
        self.in_flight = 0
        # In flight above max_in_flight: only what ran when a lower limit came, and fewer
        # as those end.
        self.excess = 0
        # The last refusal (time, tokens, refusal), while nothing has changed since.
        self.refused: tuple[float, int, Refusal] | None = None

    def _tick(self) -> int:
        self.seq += 1
        return self.seq

    def _see(self, now: float) -> float:
        self.latest = max(self.latest, now)
        return self.latest

    @staticmethod
    def _used(log: list[Charged], at: float) -> float:
        """What the slots that intersect (at - 60, at] hold."""
        first = math.floor((at - WINDOW_S) / SLOT_S)
        return sum(c.amount for c in log if c.slot >= first)

    def _fits(self, tokens: int, at: float) -> dict[str, bool]:
        limits = self.limits
        rpm, tpm, most = (
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.max_in_flight,
        )
        return {
            "in_flight": most is None or self.in_flight < most,
            "requests": rpm is None or self._used(self.requests, at) + 1 <= rpm,
            "tokens": tpm is None or self._used(self.tokens, at) + min(tokens, tpm) <= tpm,
        }

    def _admit(self, tokens: int) -> Ticket | Refusal:
        at = self._see(self.now)
        fits = self._fits(tokens, at)
        result = self.limiter.admit(tokens, self.now)
        if isinstance(result, Ticket):
            assert all(fits.values()), f"admitted though {fits}"
            assert result.reserved == tokens and not result.settled
            seq = self._tick()
            slot = math.floor(at / SLOT_S)
            self.requests.append(Charged(seq, at, slot, 1))
            charged = Charged(seq, at, slot, tokens)
            self.tokens.append(charged)
            self.admitted.append(Admitted(seq, at, tokens, self.limits))
            self.open.append((result, charged))
            self.in_flight += 1
            most = self.limits.max_in_flight
            assert most is None or self.in_flight <= most
            self.refused = None
            return result
        assert not fits[result.which], f"refused for {result.which} though {fits}"
        # At most a window and a slot from the latest time seen (a clock behind it waits
        # the difference too).
        assert MIN_RETRY_S <= result.retry_after_s <= WINDOW_S + SLOT_S + (at - self.now) + 1e-9
        if result.which == "in_flight":
            assert result.retry_after_s == IN_FLIGHT_RETRY_S
        self.refused = (self.now, tokens, result)
        event(f"refused: {result.which}")
        return result

    @rule(tokens=st.integers(0, 700))
    def admit(self, tokens: int) -> None:
        self._admit(tokens)

    @precondition(lambda self: self.refused is not None)
    @rule()
    def come_back_when_told(self) -> None:
        assert self.refused is not None
        refused_at, tokens, refusal = self.refused
        told = refused_at + refusal.retry_after_s
        early = told - SLOT_S
        if refusal.which != "in_flight" and refusal.retry_after_s > SLOT_S and early >= self.latest:
            # One slot earlier the limit named still refuses it (the wait is the least).
            window = self.limiter.requests if refusal.which == "requests" else self.limiter.tokens
            assert not window.fits(1 if refusal.which == "requests" else tokens, early)
            event("one slot early: refused")
            self._see(early)
        self.now = told
        result = self._admit(tokens)
        if isinstance(result, Refusal):
            # Only in flight can still be full: answers end when they end.
            assert result.which == "in_flight", f"told {refusal}, then {result}"
        event(f"came back when told: {type(result).__name__}")

    @precondition(lambda self: self.open)
    @rule(data=st.data(), actual=st.integers(0, 800))
    def settle(self, data: st.DataObject, actual: int) -> None:
        ticket, charged = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        self.limiter.settle(ticket, actual, self.now)
        at = self._see(self.now)
        seq = self._tick()
        delta = actual - ticket.reserved
        if charged.slot >= math.floor((at - WINDOW_S) / SLOT_S):
            charged.amount += delta
            if delta > 0:
                charged.rises.append((seq, delta))
        elif delta > 0:
            event("a rise after the slot left")
            self.tokens.append(Charged(seq, at, math.floor(at / SLOT_S), delta, debt=True))
        self.in_flight -= 1
        self.excess = min(self.excess, self.in_flight)
        self.settled.append(ticket)
        self.refused = None

    @precondition(lambda self: self.settled)
    @rule(data=st.data(), actual=st.integers(0, 800))
    def settle_again(self, data: st.DataObject, actual: int) -> None:
        ticket = data.draw(st.sampled_from(self.settled))
        before = (self.limiter.tokens.used(self.now), self.limiter.in_flight)
        self.limiter.settle(ticket, actual, self.now)
        assert (self.limiter.tokens.used(self.now), self.limiter.in_flight) == before
        self._see(self.now)

    @rule(step=STEPS)
    def time_passes(self, step: float) -> None:
        self.now += step

    @rule(step=STEPS)
    def clock_steps_back(self, step: float) -> None:
        self.now -= step

    @rule(limits=LIMITS)
    def limits_change(self, limits: Limits) -> None:
        self.limiter.set_limits(limits)
        self.limits = limits
        self.excess = self.in_flight
        self.refused = None

    @invariant()
    def windows_hold_what_the_model_says(self) -> None:
        if not hasattr(self, "limiter"):
            return
        headers = self.limiter.headers(self.now)
        at = self._see(self.now)
        assert self.limiter.in_flight == self.in_flight
        assert self.limiter.requests.used(self.now) == self._used(self.requests, at)
        assert self.limiter.tokens.used(self.now) == self._used(self.tokens, at)
        rpm, tpm = self.limits.requests_per_minute, self.limits.tokens_per_minute
        if rpm is None:
            assert headers.remaining_requests is None and headers.reset_requests_s is None
        else:
            assert headers.remaining_requests == max(0, rpm - self._used(self.requests, at))
            assert headers.reset_requests_s is not None
            self._check_reset(self.requests, at, headers.reset_requests_s)
        if tpm is None:
            assert headers.remaining_tokens is None and headers.reset_tokens_s is None
        else:
            assert headers.remaining_tokens == max(0, math.floor(tpm - self._used(self.tokens, at)))
            assert headers.reset_tokens_s is not None
            self._check_reset(self.tokens, at, headers.reset_tokens_s)

    def _check_reset(self, log: list[Charged], at: float, reset_s: float) -> None:
        assert 0 <= reset_s <= WINDOW_S + SLOT_S + (at - self.now) + 1e-9
        assert self._used(log, max(at, self.now + reset_s)) == 0
        if reset_s > SLOT_S:
            assert self._used(log, max(at, self.now + reset_s - SLOT_S)) > 0

    @invariant()
    def no_minute_holds_more_than_the_limit_save_late_rises(self) -> None:
        """For each admission, the 60 s ending at it: what was charged in it by then, at
        the charges' own times and with every settlement since applied, is within the
        limit then in force (an amount above it alone in its window), but for what
        settlements raised after it."""
        if not hasattr(self, "limiter"):
            return
        for admission in self.admitted:
            since = admission.at - WINDOW_S
            rpm = admission.limits.requests_per_minute
            if rpm is not None:
                count = sum(1 for c in self.requests if c.seq <= admission.seq and since < c.at)
                assert count <= rpm
            tpm = admission.limits.tokens_per_minute
            if tpm is not None:
                held = 0.0
                for c in self.tokens:
                    if c.seq <= admission.seq and since < c.at:
                        held += c.amount - sum(d for seq, d in c.rises if seq > admission.seq)
                assert held <= tpm + max(0, admission.tokens - tpm)

    @invariant()
    def in_flight_within_its_limit(self) -> None:
        if not hasattr(self, "limiter"):
            return
        most = self.limits.max_in_flight
        assert most is None or self.in_flight <= max(most, self.excess)


TestTenantTraffic = TenantTraffic.TestCase


# ---------------------------------------------------------------- any window and slot


class WindowTraffic(RuleBasedStateMachine):
    """One window of any length and slot (a fractional number of slots too), charged
    only when it fits, settled, waited on, against every charge kept with its slot."""

    @initialize(
        shape=st.sampled_from([(60.0, 1.0), (10.0, 3.0), (5.0, 0.5), (1.0, 0.125), (7.5, 2.5)]),
        limit=st.integers(1, 20),
    )
    def start(self, shape: tuple[float, float], limit: int) -> None:
        self.window_s, self.slot_s = shape
        self.window = SlidingWindow(limit, self.window_s, self.slot_s)
        self.now = 0.0
        self.slots: dict[int, float] = {}  # slot k: what was charged in [k*s, (k+1)*s)
        self.handles: list[Charge] = []

    def _in_window(self, slot: int, at: float) -> bool:
        return (slot + 1) * self.slot_s > at - self.window_s  # it meets (at - window, at]

    def _used(self, at: float) -> float:
        return sum(a for slot, a in self.slots.items() if self._in_window(slot, at))

    def _fits(self, amount: int, at: float) -> bool:
        limit = self.window.limit
        return self._used(at) + min(amount, limit) <= limit

    @rule(amount=st.integers(0, 25))
    def charge_if_it_fits(self, amount: int) -> None:
        fits = self.window.fits(amount, self.now)
        assert fits == self._fits(amount, self.now)
        if fits:
            handle = self.window.charge(amount, self.now)
            assert handle == math.floor(self.now / self.slot_s)
            self.handles.append(handle)
            self.slots[handle] = self.slots.get(handle, 0) + amount

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), delta=st.integers(-25, 25))
    def adjust(self, data: st.DataObject, delta: int) -> None:
        handle = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.window.adjust(handle, delta, self.now)
        if self._in_window(handle, self.now):
            self.slots[handle] = max(0, self.slots[handle] + delta)  # a slot, not a charge
        elif delta > 0:
            now = math.floor(self.now / self.slot_s)
            self.slots[now] = self.slots.get(now, 0) + delta

    @rule(amount=st.integers(0, 25))
    def wait_is_the_least_that_fits(self, amount: int) -> None:
        wait = self.window.wait(amount, self.now)
        assert wait >= 0
        assert self._fits(amount, self.now + wait)
        if wait > 0:
            assert not self._fits(amount, self.now)
            assert wait <= self.window_s + self.slot_s
            assert not self._fits(amount, max(self.now, self.now + wait - self.slot_s))

    @rule(step=st.sampled_from([0.125, 0.5, 1.0, 2.5, 3.0, 4.875, 10.0]))
    def time_passes(self, step: float) -> None:
        self.now += step

    @rule(limit=st.integers(1, 20))
    def limit_changes(self, limit: int) -> None:
        self.window.limit = limit

    @invariant()
    def holds_what_the_model_says(self) -> None:
        if not hasattr(self, "window"):
            return
        assert self.window.used(self.now) == self._used(self.now)
        reset = self.window.reset_s(self.now)
        assert self._used(self.now + reset) == 0
        if reset > 0:
            assert self._used(self.now + reset - self.slot_s) > 0


TestWindowTraffic = WindowTraffic.TestCase


def test_a_processs_share_caps_each_limit_and_the_whole_limit_caps_the_share() -> None:
    limiter = TenantLimiter(Limits(requests_per_minute=10, tokens_per_minute=1000, max_in_flight=4))
    limiter.set_shares(Shares(requests=2, tokens=5000, in_flight=1))
    first = limiter.admit(100, 0.0)
    assert isinstance(first, Ticket)
    assert limiter.admit(100, 0.0) == Refusal("in_flight", IN_FLIGHT_RETRY_S)
    limiter.settle(first, 100, 0.5)
    assert isinstance(limiter.admit(100, 1.0), Ticket)  # the second of its 2 requests
    refused = limiter.admit(100, 1.0)
    assert isinstance(refused, Refusal) and refused.which == "requests"
    assert limiter.tokens.limit == 1000  # a share above the limit is the limit
    # Back to the whole limits when the shares are given up (no hub to share with).
    limiter.set_shares(None)
    assert limiter.requests.limit == 10 and limiter.in_flight_cap == 4


def test_a_share_of_almost_nothing_takes_one_request_a_window() -> None:
    limiter = TenantLimiter(Limits(tokens_per_minute=1000))
    limiter.set_shares(Shares(tokens=0.0))
    ticket = limiter.admit(400, 0.0)  # an empty window takes one request, any size
    assert isinstance(ticket, Ticket)
    limiter.settle(ticket, 400, 1.0)
    refused = limiter.admit(1, 2.0)
    assert isinstance(refused, Refusal) and refused.which == "tokens"
    assert refused.retry_after_s == pytest.approx(WINDOW_S + SLOT_S - 2.0)
