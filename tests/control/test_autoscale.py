"""The autoscaler's decision (issue 23): a pure function of the readings, the time and
the replicas it has, property-tested over random specs and load: never outside
[min, max], never below what the load needs now, up at once, down only after a whole
window that said fewer would do, to zero only when idle, woken by a held request."""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmgw_core.autoscaling import Autoscale
from llmgw_core.config_schema import structure
from llmgw_core.tomlshape import ConfigError
from llmgw_server.control.autoscale import Autoscaler, Decision, ModelLoad, Reason, need_now


def _spec_of(
    low: int,
    span: int,
    flight: float | None,
    kv: float | None,
    ttft: float | None,
    window: float,
    idle: float,
) -> Autoscale:
    if flight is None and kv is None and ttft is None:
        flight = 1.0  # a spec needs a target
    return Autoscale(
        max=max(low + span, 1), min=low, target_in_flight=flight, target_kv_use=kv,
        ttft_p90_ms=ttft, scale_down_after_s=window, idle_to_zero_s=idle,
    )  # fmt: skip


specs = st.builds(
    _spec_of,
    low=st.integers(0, 3),
    span=st.integers(0, 6),
    flight=st.one_of(st.none(), st.sampled_from([0.5, 1.0, 4.0, 8.0])),
    kv=st.one_of(st.none(), st.sampled_from([0.5, 0.8, 0.9])),
    ttft=st.one_of(st.none(), st.sampled_from([200.0, 1000.0])),
    window=st.sampled_from([0.0, 30.0, 300.0]),
    idle=st.sampled_from([1.0, 60.0, 600.0]),
)


class AutoscalerMachine(RuleBasedStateMachine):
    """Time and load move at random; every decision is checked against its readings."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.last_request_at: float | None = None
        self.needs: list[tuple[float, int]] = []  # (time, what the load needed then)
        self.last_change = 0.0

    @initialize(spec=specs, running=st.one_of(st.none(), st.integers(0, 10)))
    def begin(self, spec: Autoscale, running: int | None) -> None:
        self.spec = spec
        self.scaler = Autoscaler.start(spec, self.now, running)
        self.decision: Decision | None = None
        note(f"{spec}, starting at {self.scaler.desired}")

    @rule(
        dt=st.sampled_from([0.5, 5.0, 10.0, 40.0, 200.0, 700.0]),
        in_flight=st.sampled_from([0, 0, 1, 3, 9, 30, 100]),
        held=st.sampled_from([0, 0, 0, 1, 4]),
        ttft=st.one_of(st.none(), st.sampled_from([50.0, 190.0, 400.0, 5000.0])),
        kv=st.one_of(st.none(), st.sampled_from([0.0, 0.3, 0.85, 1.0])),
    )
    def cycle(
        self, dt: float, in_flight: int, held: int, ttft: float | None, kv: float | None
    ) -> None:
        self.now += dt
        if in_flight or held:
            self.last_request_at = self.now
        load = ModelLoad(in_flight, held, ttft, kv, self.last_request_at)
        before = self.scaler.desired
        need = need_now(self.spec, load, before, self.now)
        self.needs.append((self.now, need.replicas))
        decision = self.scaler.decide(load, self.now)
        note(f"t={self.now} {load} had {before}: {decision}")
        spec, after = self.spec, decision.desired
        assert after == self.scaler.desired
        # Never below what the load needs now (its targets on the replicas left).
        assert after >= need.replicas
        # Up at once.
        if need.replicas > before:
            assert after == need.replicas
        # A request in flight or held always has a replica coming.
        if in_flight or held:
            assert after >= 1
        if after < before:
            if decision.reason is Reason.IDLE:
                assert after == 0 and not in_flight and not held
                assert self.last_request_at is None or (
                    self.now - self.last_request_at >= spec.idle_to_zero_s
                )
            else:
                # A whole window since the last change, and every need in it fits.
                window = spec.scale_down_after_s
                assert self.now - self.last_change >= window
                recent = [n for t, n in self.needs if t >= self.now - window]
                assert max(recent) <= after, recent
        if after != before:
            self.last_change = self.now
        self.decision = decision

    @invariant()
    def within_bounds(self) -> None:
        if hasattr(self, "scaler"):
            assert self.spec.min <= self.scaler.desired <= self.spec.max


TestAutoscalerMachine = AutoscalerMachine.TestCase


def _spec(**kw: object) -> Autoscale:
    return Autoscale(**{"max": 8, "min": 1, "scale_down_after_s": 300.0, **kw})  # type: ignore[arg-type]


def test_a_spike_inside_the_window_holds_the_replicas() -> None:
    scaler = Autoscaler.start(_spec(target_in_flight=4.0), 0.0)
    assert scaler.decide(ModelLoad(in_flight=16, last_request_at=0), 0.0).desired == 4
    for t in range(10, 301, 10):  # quiet, but a window since the spike has not passed
        decision = scaler.decide(ModelLoad(in_flight=2, last_request_at=t), float(t))
        assert (decision.desired, decision.reason) == (4, Reason.WINDOW), t
    assert scaler.decide(ModelLoad(in_flight=2, last_request_at=301), 301.0).desired == 1
    # A spike again: up at once, and it holds the next window.
    assert scaler.decide(ModelLoad(in_flight=12, last_request_at=310), 310.0).desired == 3
    assert scaler.decide(ModelLoad(in_flight=0, last_request_at=310), 610.0).desired == 3
    assert scaler.decide(ModelLoad(in_flight=0, last_request_at=310), 620.0).desired == 1


def test_to_zero_when_idle_and_woken_by_a_held_request() -> None:
    scaler = Autoscaler.start(_spec(min=0, target_in_flight=4.0, idle_to_zero_s=60.0), 0.0)
    assert scaler.decide(ModelLoad(in_flight=1, last_request_at=0), 0.0).desired == 1
    assert scaler.decide(ModelLoad(last_request_at=0), 59.0).desired == 1
    idle = scaler.decide(ModelLoad(last_request_at=0), 60.0)
    assert (idle.desired, idle.reason) == (0, Reason.IDLE)
    assert scaler.decide(ModelLoad(last_request_at=0), 1000.0).desired == 0
    woken = scaler.decide(ModelLoad(held=3, last_request_at=1001), 1001.0)
    assert (woken.desired, woken.reason) == (1, Reason.WOKEN)


def test_its_words_name_the_load_under_load_and_the_wait_while_waking() -> None:
    """Issue 36: under steady load a min = 0 model said "at its floor" (the floor is 0),
    and "steady: at its floor" while requests were held for its first replica."""
    spec = _spec(min=0, target_in_flight=4.0, idle_to_zero_s=60.0)
    scaler = Autoscaler.start(spec, 0.0, 2)
    down = scaler.decide(ModelLoad(in_flight=3, last_request_at=300), 300.0)
    assert (down.desired, down.reason) == (1, Reason.IN_FLIGHT)
    assert down.detail == "3 in flight, target 4 a replica: wants 1"
    woken = need_now(spec, ModelLoad(held=2, last_request_at=0), 0, 0)
    assert (woken.replicas, woken.reason, woken.detail) == (1, Reason.WOKEN, "2 request(s) held")
    waking = need_now(spec, ModelLoad(held=2, last_request_at=0), 1, 0)
    assert (waking.reason, waking.detail) == (
        Reason.WOKEN,
        "2 request(s) held until a replica serves",
    )
    kv_only = _spec(min=0, target_kv_use=0.8, idle_to_zero_s=60.0)
    busy = need_now(kv_only, ModelLoad(in_flight=2, last_request_at=0), 1, 0)
    assert (busy.replicas, busy.reason, busy.detail) == (
        1,
        Reason.STEADY,
        "2 in flight: at least 1",
    )
    at_zero = need_now(spec, ModelLoad(last_request_at=0), 0, 30)
    assert (at_zero.replicas, at_zero.reason, at_zero.detail) == (
        0,
        Reason.STEADY,
        "at its floor (0)",
    )
    lately = need_now(spec, ModelLoad(last_request_at=0), 1, 30)
    assert (lately.replicas, lately.detail) == (1, "kept until idle for 60 s")
    quiet = need_now(_spec(min=2, target_in_flight=4.0), ModelLoad(last_request_at=0), 2, 0)
    assert (quiet.replicas, quiet.detail) == (2, "at its floor (2)")


def test_each_target_asks_what_it_needs_within_max() -> None:
    spec = _spec(target_kv_use=0.8, ttft_p90_ms=500.0, max=4)
    assert need_now(spec, ModelLoad(kv_use=0.96, last_request_at=0), 2, 0).replicas == 3
    slow = need_now(spec, ModelLoad(ttft_p90_ms=900.0, last_request_at=0), 2, 0)
    assert (slow.replicas, slow.reason) == (3, Reason.TTFT)
    near = need_now(spec, ModelLoad(ttft_p90_ms=450.0, last_request_at=0), 2, 0)
    assert near.replicas == 2  # within 80% of the objective: none given back
    capped = need_now(spec, ModelLoad(kv_use=1.0, last_request_at=0), 4, 0)
    assert (capped.replicas, capped.reason) == (4, Reason.BOUNDS)
    assert "wants 5, max 4" in capped.detail


@given(spec=specs, running=st.integers(0, 20))
def test_a_start_is_within_bounds(spec: Autoscale, running: int) -> None:
    assert spec.min <= Autoscaler.start(spec, 0.0, running).desired <= spec.max


def test_a_spec_needs_a_target_and_min_at_most_max() -> None:
    for data, words in (
        ({"max": 2}, "needs a target"),
        ({"max": 2, "min": 3, "target_in_flight": 1.0}, "more than max"),
        ({"max": 0, "target_in_flight": 1.0}, "max"),
        ({"max": 2, "target_kv_use": 1.5}, "target_kv_use"),
    ):
        with pytest.raises(ConfigError) as caught:
            structure(data, Autoscale, file="f.toml", path="models[0].autoscale")
        assert words in str(caught.value), (data, str(caught.value))
    spec = structure({"max": 3, "min": 0, "ttft_p90_ms": 500}, Autoscale, file="f.toml")
    assert (spec.min, spec.max, spec.ttft_p90_ms, spec.scale_down_after_s) == (0, 3, 500, 300)
