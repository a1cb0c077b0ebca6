"""How many replicas a model wants, from what its routers and engines measure (issue 23).

Pure: readings and the time in, a count and its reason out; no trio, no sockets. One
`Autoscaler` per autoscaled model, owned by the control plane, fed a `ModelLoad` each
cycle (the routers' in-flight and held requests and TTFT, all routers together; the
engines' own KV-cache use and queues).

The rule, after Kubernetes' HPA and llm-d's saturation scaler:
- each target gives the replicas it needs now: in flight (held ones too: they will be
  once a replica serves) / target_in_flight; KV use
  spread over target_kv_use; one more than now while the TTFT p90 misses its objective
  (and none fewer while it is within 80% of it);
- up at once, to what the most demanding target needs (within `max`);
- down only to the most that any reading of the last `scale_down_after_s` needed, and
  only once that window has passed since the last change: a spike inside the window
  holds the replicas, and replicas never come and go faster than the window;
- to zero (`min = 0`) only after `idle_to_zero_s` with no request in flight or held
  (that is its window: nothing is left to serve); a held request (the router queues it
  while no replica serves) wakes the model at once.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable

import attrs

from llmgw_core.autoscaling import Autoscale

# While the TTFT p90 is above this share of its objective, no replica is given back: the
# remaining ones would miss it.
TTFT_HOLD_SHARE = 0.8
# One reading a cycle is kept for the down window; a bound whatever the cycle.
MAX_READINGS = 4096


@attrs.frozen(slots=True)
class ModelLoad:
    """One cycle's readings of a model, all routers and replicas together."""

    in_flight: int = 0  # requests the routers have sent and not finished
    held: int = 0  # requests a router holds while no replica serves (scale from zero)
    ttft_p90_ms: float | None = None  # over the last cycle; None: no request finished
    kv_use: float | None = None  # the ready replicas' mean KV-cache use (0-1); None: unread
    last_request_at: float | None = None  # when a request last arrived; None: never


class Reason(enum.StrEnum):
    IN_FLIGHT = "in flight"
    KV_USE = "KV-cache use"
    TTFT = "TTFT p90"
    WOKEN = "a request woke it"
    IDLE = "idle"
    WINDOW = "held by the down window"
    BOUNDS = "bounds"
    STEADY = "steady"


_TARGETS = frozenset({Reason.IN_FLIGHT, Reason.KV_USE, Reason.TTFT})


@attrs.frozen(slots=True)
class Need:
    """What the readings need now, and which target said so."""

    replicas: int
    reason: Reason
    detail: str


@attrs.frozen(slots=True)
class Decision:
    desired: int
    reason: Reason
    detail: str  # for status, explain and the page: "in flight 37 over 2 replicas: ..."


def need_now(spec: Autoscale, load: ModelLoad, current: int, now: float) -> Need:
    """The replicas the readings need at `now`, within [min, max], ignoring the windows."""
    if load.held or load.in_flight:
        floor = max(spec.min, 1)
    elif spec.min == 0 and _idle_for(load, now) >= spec.idle_to_zero_s:
        return Need(0, Reason.IDLE, f"no request for {spec.idle_to_zero_s:g} s")
    else:
        floor = max(spec.min, 1) if current else spec.min
    # Woken while it had none, or still waking: a router holds requests only while no
    # replica serves it there (the page said "steady" beside "0 -> 1" before, issue 36).
    if load.held or (current == 0 and load.in_flight):
        waiting = "" if current == 0 else " until a replica serves"
        base = Need(max(floor, 1), Reason.WOKEN, f"{load.held} request(s) held{waiting}")
    elif floor > spec.min and load.in_flight:
        base = Need(floor, Reason.STEADY, f"{load.in_flight} in flight: at least {floor}")
    elif floor > spec.min:  # min = 0, a replica up, no request lately
        base = Need(floor, Reason.STEADY, f"kept until idle for {spec.idle_to_zero_s:g} s")
    else:
        base = Need(floor, Reason.STEADY, f"at its floor ({spec.min})")
    needs = []
    if spec.target_in_flight is not None:
        count = math.ceil((load.in_flight + load.held) / spec.target_in_flight - 1e-9)
        held = f" and {load.held} held" if load.held else ""
        detail = f"{load.in_flight} in flight{held}, target {spec.target_in_flight:g} a replica"
        needs.append(Need(count, Reason.IN_FLIGHT, detail))
    if spec.target_kv_use is not None and load.kv_use is not None and current:
        count = math.ceil(current * load.kv_use / spec.target_kv_use - 1e-9)
        detail = f"KV use {load.kv_use:.2f} on {current}, target {spec.target_kv_use:g}"
        needs.append(Need(count, Reason.KV_USE, detail))
    if spec.ttft_p90_ms is not None and load.ttft_p90_ms is not None and current:
        detail = f"TTFT p90 {load.ttft_p90_ms:.0f} ms, objective {spec.ttft_p90_ms:g} ms"
        if load.ttft_p90_ms > spec.ttft_p90_ms:
            needs.append(Need(current + 1, Reason.TTFT, detail))
        elif load.ttft_p90_ms > TTFT_HOLD_SHARE * spec.ttft_p90_ms:
            needs.append(Need(current, Reason.TTFT, detail))
    # The first of equals is said: a wake before the targets, the targets before the
    # floor under load (the reader wants the load's words, not "at its floor"), and the
    # floor before them with none ("at its floor (0)", not "0 in flight: wants 0").
    loaded = load.in_flight or load.held
    needs = [*needs, base] if loaded and base.reason is not Reason.WOKEN else [base, *needs]
    top = max(needs, key=lambda n: n.replicas)
    if top.replicas > spec.max:
        return Need(spec.max, Reason.BOUNDS, f"{top.detail}: wants {top.replicas}, max {spec.max}")
    if top.reason in _TARGETS:
        return attrs.evolve(top, detail=f"{top.detail}: wants {top.replicas}")
    return top


def _idle_for(load: ModelLoad, now: float) -> float:
    return math.inf if load.last_request_at is None else now - load.last_request_at


@attrs.define
class Autoscaler:
    """One model's replica count over time; the state between cycles is its own."""

    spec: Autoscale
    desired: int
    changed_at: float  # when `desired` last changed (or the autoscaler began)
    # (time, replicas needed) of the readings inside the down window, oldest first.
    _readings: deque[tuple[float, int]] = attrs.field(factory=lambda: deque(maxlen=MAX_READINGS))
    last: Decision | None = None

    @classmethod
    def start(cls, spec: Autoscale, now: float, current: int | None = None) -> Autoscaler:
        """Begin at `current` replicas (those running), or at `min` (at least one)."""
        start = max(spec.min, 1) if current is None else current
        return cls(spec, min(max(start, spec.min), spec.max), now)

    @classmethod
    def resume(
        cls,
        spec: Autoscale,
        desired: int,
        changed_at: float,
        window: Iterable[tuple[float, int]] = (),
    ) -> Autoscaler:
        """Go on from a count another control plane decided (control.persisted): its
        last change and the readings of `window` still count in the down window."""
        scaler = cls(spec, min(max(desired, spec.min), spec.max), changed_at)
        scaler._readings.extend(sorted(window))
        return scaler

    def window(self) -> list[tuple[float, int]]:
        """The readings that can still hold replicas, oldest first: each needs more than
        every later one (a later reading that needs as many outlives it in the window),
        so there is at most one per count. O(readings)."""
        kept: list[tuple[float, int]] = []
        for at, n in reversed(self._readings):
            if not kept or n > kept[-1][1]:
                kept.append((at, n))
        kept.reverse()
        return kept

    def decide(self, load: ModelLoad, now: float) -> Decision:
        """This cycle's count: up at once, down only as the window allows."""
        spec = self.spec
        need = need_now(spec, load, self.desired, now)
        readings = self._readings
        readings.append((now, need.replicas))
        while readings[0][0] < now - spec.scale_down_after_s:  # this one stays
            readings.popleft()
        current = self.desired
        if need.replicas > current:
            decision = Decision(need.replicas, need.reason, need.detail)
        elif need.replicas == current or need.reason is Reason.IDLE:
            # Idle for idle_to_zero_s: that was the window, nothing is in flight.
            decision = Decision(need.replicas, need.reason, need.detail)
        else:
            held = max(n for _, n in readings)
            settled = now - self.changed_at >= spec.scale_down_after_s
            if not settled or held >= current:
                window = f"{spec.scale_down_after_s:g} s"
                detail = f"{need.detail}; fewer would do, but not for {window} yet"
                decision = Decision(current, Reason.WINDOW, detail)
            else:
                decision = Decision(held, need.reason, need.detail)
        if decision.desired != current:
            self.desired = decision.desired
            self.changed_at = now
        self.last = decision
        return decision
