"""The router's metrics, rendered in the Prometheus text format."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable

from llmgw_core.catalog import Endpoint
from llmgw_server.balancer import Balancer
from llmgw_server.upstream import Pool

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(_BUCKETS, value)] += 1
        self.sum += value

    def render(self, name: str, labels: str) -> Iterable[str]:
        inner = labels[1:-1]
        sep = "," if inner else ""
        total = 0
        for bound, count in zip(_BUCKETS, self.counts, strict=False):
            total += count
            yield f'{name}_bucket{{{inner}{sep}le="{bound}"}} {total}'
        total += self.counts[-1]
        yield f'{name}_bucket{{{inner}{sep}le="+Inf"}} {total}'
        yield f"{name}_sum{labels} {self.sum:.6f}"
        yield f"{name}_count{labels} {total}"


class RouterMetrics:
    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.retries: defaultdict[str, int] = defaultdict(int)
        self.ejections: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.latency: defaultdict[str, Histogram] = defaultdict(Histogram)
        self.ttfb: defaultdict[str, Histogram] = defaultdict(Histogram)
        self.tokens: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.auth_failures: defaultdict[str, int] = defaultdict(int)

    def render(self, balancers: dict[str, Balancer], pools: dict[Endpoint, Pool]) -> bytes:
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        family(
            "llmgw_requests_total",
            "counter",
            "Requests answered, by model (- when no model of this router was named) and HTTP "
            "status (0: the client went away before the answer ended); health probes and "
            "metrics scrapes are not counted.",
        )
        for (model, status), n in sorted(self.requests.items()):
            out.append(f"llmgw_requests_total{_labels(model=model, status=str(status))} {n}")
        self._render_access(out, family)
        family("llmgw_requests_in_flight", "gauge", "Requests being answered now.")
        for model, n in sorted(self.in_flight.items()):
            out.append(f"llmgw_requests_in_flight{_labels(model=model)} {n}")
        family("llmgw_upstream_retries_total", "counter", "Attempts made on another replica.")
        for model, n in sorted(self.retries.items()):
            out.append(f"llmgw_upstream_retries_total{_labels(model=model)} {n}")
        family(
            "llmgw_upstream_stale_connections_total",
            "counter",
            "Requests sent again on a fresh connection after the engine had closed a pooled one.",
        )
        for pool in sorted(pools.values(), key=lambda p: p.endpoint.url):
            labels = _labels(endpoint=pool.endpoint.url)
            out.append(f"llmgw_upstream_stale_connections_total{labels} {pool.stale_retries}")
        family("llmgw_replica_ejections_total", "counter", "Replicas ejected after failures.")
        for (model, endpoint), n in sorted(self.ejections.items()):
            out.append(
                f"llmgw_replica_ejections_total{_labels(model=model, endpoint=endpoint)} {n}"
            )
        family(
            "llmgw_upstream_latency_seconds",
            "histogram",
            "Time from sending to the engine's last byte.",
        )
        for model, hist in sorted(self.latency.items()):
            out.extend(hist.render("llmgw_upstream_latency_seconds", _labels(model=model)))
        family(
            "llmgw_upstream_ttfb_seconds",
            "histogram",
            "Time from sending to the engine's response head.",
        )
        for model, hist in sorted(self.ttfb.items()):
            out.extend(hist.render("llmgw_upstream_ttfb_seconds", _labels(model=model)))
        family("llmgw_replica_available", "gauge", "1 when a replica takes requests.")
        for model, balancer in sorted(balancers.items()):
            for r in balancer.replicas:
                labels = _labels(model=model, endpoint=r.endpoint.url)
                out.append(f"llmgw_replica_available{labels} {int(r.available)}")
        family("llmgw_replica_outstanding", "gauge", "Requests outstanding on a replica.")
        for model, balancer in sorted(balancers.items()):
            for r in balancer.replicas:
                labels = _labels(model=model, endpoint=r.endpoint.url)
                out.append(f"llmgw_replica_outstanding{labels} {r.outstanding}")
        return ("\n".join(out) + "\n").encode()

    def _render_access(self, out: list[str], family: Callable[[str, str, str], None]) -> None:
        family(
            "llmgw_tokens_total",
            "counter",
            "Tokens in the engines' usage reports, by model, API key id and kind "
            "(prompt or completion).",
        )
        for (model, key_id, kind), n in sorted(self.tokens.items()):
            out.append(f"llmgw_tokens_total{_labels(model=model, key_id=key_id, kind=kind)} {n}")
        family(
            "llmgw_auth_failures_total",
            "counter",
            "Requests refused for their credentials: missing_key, invalid_key, "
            "model_not_allowed, metrics_token.",
        )
        for reason, n in sorted(self.auth_failures.items()):
            out.append(f"llmgw_auth_failures_total{_labels(reason=reason)} {n}")
