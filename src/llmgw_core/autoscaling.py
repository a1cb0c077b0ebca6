"""`[models.autoscale]`: how many replicas a placed model may have, and what they aim at.

Shared vocabulary: the catalog reads it, the control plane's autoscaler
(llmgw_server/control/autoscale.py) decides on it. A model has either a fixed `replicas`
or an `[models.autoscale]`, never both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from llmgw_core.config_schema import Problem, rule_after, rules

# The HPA's default: a replica is given back only after the load said so for this long.
DEFAULT_SCALE_DOWN_AFTER_S = 300.0
DEFAULT_IDLE_TO_ZERO_S = 600.0
MAX_REPLICAS = 1000  # a bound on what one model may ask of the fleet


@attrs.frozen
class Autoscale:
    """Between `min` and `max` replicas, as many as the targets need.

    Targets (at least one): `target_in_flight`, requests in flight per replica (routers'
    count, all routers together); `target_kv_use`, the engines' own KV-cache use (0-1];
    `ttft_p90_ms`, an objective for the time to first byte's 90th percentile: above it,
    one more replica. Up at once; down only after every reading of
    `scale_down_after_s` said fewer would do; to zero (`min = 0`) after `idle_to_zero_s`
    without a request, and back on the next one.
    """

    max: int = attrs.field(metadata=rules(min=1, max=MAX_REPLICAS))
    min: int = attrs.field(default=1, metadata=rules(min=0, max=MAX_REPLICAS))
    target_in_flight: float | None = attrs.field(default=None, metadata=rules(min=0.01))
    target_kv_use: float | None = attrs.field(default=None, metadata=rules(min=0.01, max=1.0))
    ttft_p90_ms: float | None = attrs.field(default=None, metadata=rules(min=1.0))
    scale_down_after_s: float = attrs.field(
        default=DEFAULT_SCALE_DOWN_AFTER_S, metadata=rules(min=0.0, max=86400.0)
    )
    idle_to_zero_s: float = attrs.field(
        default=DEFAULT_IDLE_TO_ZERO_S, metadata=rules(min=1.0, max=7 * 86400.0)
    )


@rule_after(Autoscale)
def _sound(spec: Autoscale) -> None:
    if spec.min > spec.max:
        raise Problem(f"is more than max ({spec.max})", "min")
    if spec.target_in_flight is None and spec.target_kv_use is None and spec.ttft_p90_ms is None:
        raise Problem(
            "needs a target: target_in_flight (requests per replica), target_kv_use "
            "(the engines' KV-cache use, 0-1) or ttft_p90_ms (an objective)"
        )


@attrs.frozen(slots=True)
class RouterLoad:
    """One router's view of one model over its last report interval, as it reports it to
    the control plane over the route feed (route_feed.messages.Load)."""

    in_flight: int = 0  # requests sent to replicas and not finished
    held: int = 0  # requests held while no replica serves
    ttft_p90_ms: float | None = None  # of requests that got their first byte; None: none did
    idle_s: float | None = None  # since a request for the model last arrived; None: never
    kv_use: float | None = None  # the engines' own KV-cache use (0-1), as this router read it
    requests: int = 0  # requests that arrived since this router's previous report


def combine(reports: Iterable[RouterLoad]) -> RouterLoad:
    """Several routers' reports of one model as one: counts summed; the slowest p90 and
    the fullest KV cache (each router sees its own share of the requests: any of them
    missing the objective is a miss); the latest request anywhere."""
    in_flight = held = 0
    ttft: float | None = None
    kv: float | None = None
    idle: float | None = None
    requests = 0
    for r in reports:
        requests += r.requests
        in_flight += r.in_flight
        held += r.held
        if r.ttft_p90_ms is not None:
            ttft = r.ttft_p90_ms if ttft is None else max(ttft, r.ttft_p90_ms)
        if r.kv_use is not None:
            kv = r.kv_use if kv is None else max(kv, r.kv_use)
        if r.idle_s is not None:
            idle = r.idle_s if idle is None else min(idle, r.idle_s)
    return RouterLoad(in_flight, held, ttft, idle, kv, requests)


def held_counts(loads: Mapping[str, Iterable[RouterLoad]]) -> dict[str, int]:
    """Each model's requests held by all routers, as they last reported: what status and
    the page show live (the autoscaler reads them through `combine`)."""
    return {model: sum(r.held for r in reports) for model, reports in loads.items()}
