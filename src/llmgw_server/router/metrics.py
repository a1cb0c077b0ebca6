"""The router's metrics, rendered in the Prometheus text format."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from llmgw_core.catalog import Endpoint
from llmgw_core.config import CacheAwareSection
from llmgw_core.prometheus import Histogram, family
from llmgw_core.prometheus import labels as _labels
from llmgw_server.router.balancer import Balancer, Choice
from llmgw_server.router.load_signals import LoadSignal
from llmgw_server.router.policies import decisions_help
from llmgw_server.router.prefix import PromptKey
from llmgw_server.router.upstream import Pool

_BYTE_BUCKETS = (0.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0)
# A held request waits for an engine to start: seconds to minutes.
_HELD_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.requests: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.in_flight: defaultdict[str, int] = defaultdict(int)
        self.retries: defaultdict[str, int] = defaultdict(int)
        # Streams broken after their head: (model, cause, outcome) (router.forwarding).
        self.migrations: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.ejections: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.latency: defaultdict[str, Histogram] = defaultdict(Histogram)
        self.ttfb: defaultdict[str, Histogram] = defaultdict(Histogram)
        self.tokens: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.auth_failures: defaultdict[str, int] = defaultdict(int)
        self.decisions: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.prompt_bytes: defaultdict[str, int] = defaultdict(int)
        self.matched_bytes: defaultdict[str, int] = defaultdict(int)
        self.match: defaultdict[str, Histogram] = defaultdict(lambda: Histogram(_BYTE_BUCKETS))
        self.engine_errors: defaultdict[str, int] = defaultdict(int)
        # /tokenize answers refused for more ids than their prompt allows (router.tokenizer).
        self.tokenize_refused: Counter[str] = Counter()
        # Requests held while no replica of their autoscaled model served (router.meter).
        self.held: defaultdict[str, int] = defaultdict(int)
        self.held_bytes: defaultdict[str, int] = defaultdict(int)  # their bodies'
        # Requests answered 503 instead of held, or after: by model and reason (meter).
        self.held_refused: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.queued: defaultdict[str, Histogram] = defaultdict(lambda: Histogram(_HELD_BUCKETS))
        # Route tables the feed refused, by reason (route_feed.follower): stale_epoch.
        self.tables_refused: Counter[str] = Counter({"stale_epoch": 0})

    def chose(self, model: str, choice: Choice, prompt: PromptKey | None, *, first: bool) -> None:
        self.decisions[(model, choice.decision.value)] += 1
        if prompt is not None and first:
            self.prompt_bytes[model] += prompt.size
            self.matched_bytes[model] += choice.matched_bytes
            self.match[model].observe(choice.matched_bytes)

    def render(
        self,
        balancers: dict[str, Balancer],
        pools: dict[Endpoint, Pool],
        now: float = 0.0,
        tuning: CacheAwareSection | None = None,
        policy_metrics: Callable[[Sequence[str]], list[str]] | None = None,
    ) -> bytes:
        """`policy_metrics`: the balancing policy's own families, given every replica's
        URL (its needs' `metrics`)."""
        out: list[str] = []

        out += family(
            "llmgw_requests_total",
            "counter",
            "Requests answered, by model (- when no model of this router was named) and HTTP "
            "status (0: the client went away before the answer ended); health probes and "
            "metrics scrapes are not counted.",
        )
        for (model, status), n in sorted(self.requests.items()):
            out.append(f"llmgw_requests_total{_labels(model=model, status=str(status))} {n}")
        self._render_access(out)
        out += family("llmgw_requests_in_flight", "gauge", "Requests being answered now.")
        for model, n in sorted(self.in_flight.items()):
            out.append(f"llmgw_requests_in_flight{_labels(model=model)} {n}")
        out += family(
            "llmgw_requests_held",
            "gauge",
            "Requests held now because no replica of their autoscaled model serves.",
        )
        for model, n in sorted(self.held.items()):
            out.append(f"llmgw_requests_held{_labels(model=model)} {n}")
        out += family(
            "llmgw_requests_held_bytes",
            "gauge",
            "Bytes of the bodies of the requests held now (within hold_max_bytes_per_model "
            "a model, and hold_max_bytes for all of this process's).",
        )
        for model, n in sorted(self.held_bytes.items()):
            out.append(f"llmgw_requests_held_bytes{_labels(model=model)} {n}")
        out += family(
            "llmgw_requests_held_refused_total",
            "counter",
            "Requests for an autoscaled model that no replica serves answered 503 with "
            "Retry-After, by reason: count (hold_max_per_model), model_bytes "
            "(hold_max_bytes_per_model), process_bytes (hold_max_bytes), timeout "
            "(held for hold_timeout_s).",
        )
        for (model, reason), n in sorted(self.held_refused.items()):
            labels = _labels(model=model, reason=reason)
            out.append(f"llmgw_requests_held_refused_total{labels} {n}")
        out += family(
            "llmgw_request_queued_seconds",
            "histogram",
            "How long requests were held for a replica of their autoscaled model (released "
            "or refused with 503).",
        )
        for model, hist in sorted(self.queued.items()):
            out.extend(hist.render("llmgw_request_queued_seconds", _labels(model=model)))
        out += family(
            "llmgw_route_tables_refused_total",
            "counter",
            "Route tables refused, by reason: stale_epoch (sent by a control plane whose "
            "leadership is older than one this router followed: it no longer leads).",
        )
        for reason, n in sorted(self.tables_refused.items()):
            out.append(f"llmgw_route_tables_refused_total{_labels(reason=reason)} {n}")
        out += family(
            "llmgw_upstream_retries_total", "counter", "Attempts made on another replica."
        )
        for model, n in sorted(self.retries.items()):
            out.append(f"llmgw_upstream_retries_total{_labels(model=model)} {n}")
        out += family(
            "llmgw_stream_migrations_total",
            "counter",
            "Streams whose engine broke them after their head, by cause (broke, silent, "
            "drain, lost) and outcome: continued on another replica, or not: unsafe (see the "
            "stream's error event), limit (migrate_max), failed (no replica continued it), "
            "spent (its output budget was used: the stream ended).",
        )
        for (model, cause, outcome), n in sorted(self.migrations.items()):
            labels = _labels(model=model, cause=cause, outcome=outcome)
            out.append(f"llmgw_stream_migrations_total{labels} {n}")
        out += family(
            "llmgw_upstream_stale_connections_total",
            "counter",
            "Requests sent again on a fresh connection after the engine had closed a pooled one.",
        )
        for pool in sorted(pools.values(), key=lambda p: p.endpoint.url):
            labels = _labels(endpoint=pool.endpoint.url)
            out.append(f"llmgw_upstream_stale_connections_total{labels} {pool.stale_retries}")
        out += family(
            "llmgw_replica_ejections_total", "counter", "Replicas ejected after failures."
        )
        for (model, endpoint), n in sorted(self.ejections.items()):
            out.append(
                f"llmgw_replica_ejections_total{_labels(model=model, endpoint=endpoint)} {n}"
            )
        out += family(
            "llmgw_upstream_latency_seconds",
            "histogram",
            "Time from sending to the engine's last byte.",
        )
        for model, hist in sorted(self.latency.items()):
            out.extend(hist.render("llmgw_upstream_latency_seconds", _labels(model=model)))
        out += family(
            "llmgw_upstream_ttfb_seconds",
            "histogram",
            "Time from sending to the engine's response head.",
        )
        for model, hist in sorted(self.ttfb.items()):
            out.extend(hist.render("llmgw_upstream_ttfb_seconds", _labels(model=model)))
        out += family("llmgw_replica_available", "gauge", "1 when a replica takes requests.")
        for model, balancer in sorted(balancers.items()):
            for r in balancer.replicas:
                labels = _labels(model=model, endpoint=r.endpoint.url)
                out.append(f"llmgw_replica_available{labels} {int(r.available)}")
        out += family("llmgw_replica_outstanding", "gauge", "Requests outstanding on a replica.")
        for model, balancer in sorted(balancers.items()):
            for r in balancer.replicas:
                labels = _labels(model=model, endpoint=r.endpoint.url)
                out.append(f"llmgw_replica_outstanding{labels} {r.outstanding}")
        tuning = tuning or CacheAwareSection()
        self._render_balancing(out, balancers, now, tuning, policy_metrics)
        return ("\n".join(out) + "\n").encode()

    def _render_access(self, out: list[str]) -> None:
        out += family(
            "llmgw_tokens_total",
            "counter",
            "Tokens in the engines' usage reports, by model, API key id and kind "
            "(prompt or completion).",
        )
        for (model, key_id, kind), n in sorted(self.tokens.items()):
            out.append(f"llmgw_tokens_total{_labels(model=model, key_id=key_id, kind=kind)} {n}")
        out += family(
            "llmgw_auth_failures_total",
            "counter",
            "Requests refused for their credentials: missing_key, invalid_key, "
            "model_not_allowed, metrics_token.",
        )
        for reason, n in sorted(self.auth_failures.items()):
            out.append(f"llmgw_auth_failures_total{_labels(reason=reason)} {n}")

    def _render_balancing(
        self,
        out: list[str],
        balancers: dict[str, Balancer],
        now: float,
        tuning: CacheAwareSection,
        policy_metrics: Callable[[Sequence[str]], list[str]] | None,
    ) -> None:
        # Every policy's decisions, each as its module declares it.
        out += family("llmgw_balancing_decisions_total", "counter", decisions_help())
        for (model, kind), n in sorted(self.decisions.items()):
            out.append(f"llmgw_balancing_decisions_total{_labels(model=model, kind=kind)} {n}")
        out += family(
            "llmgw_prefix_prompt_bytes_total",
            "counter",
            "Bytes of canonical prompt text hashed for cache-aware balancing.",
        )
        for model, n in sorted(self.prompt_bytes.items()):
            out.append(f"llmgw_prefix_prompt_bytes_total{_labels(model=model)} {n}")
        out += family(
            "llmgw_prefix_matched_bytes_total",
            "counter",
            "Of those, the bytes the chosen replica held, as far as this router knows.",
        )
        for model, n in sorted(self.matched_bytes.items()):
            out.append(f"llmgw_prefix_matched_bytes_total{_labels(model=model)} {n}")
        out += family(
            "llmgw_prefix_hit_ratio",
            "gauge",
            "Matched bytes over prompt bytes since the start.",
        )
        for model, n in sorted(self.prompt_bytes.items()):
            ratio = self.matched_bytes[model] / n if n else 0.0
            out.append(f"llmgw_prefix_hit_ratio{_labels(model=model)} {ratio:.6f}")
        out += family(
            "llmgw_prefix_match_bytes",
            "histogram",
            "Per request, the prompt bytes the chosen replica held.",
        )
        for model, hist in sorted(self.match.items()):
            out.extend(hist.render("llmgw_prefix_match_bytes", _labels(model=model)))
        out += family(
            "llmgw_prefix_index_entries",
            "gauge",
            "Prefix entries remembered for a replica (bounded by index_blocks).",
        )
        for model, balancer in sorted(balancers.items()):
            for r in balancer.replicas:
                entries = balancer.policy.remembered(r)
                if entries is not None:
                    labels = _labels(model=model, endpoint=r.endpoint.url)
                    out.append(f"llmgw_prefix_index_entries{labels} {entries}")
        if policy_metrics is not None:
            out += policy_metrics([r.endpoint.url for b in balancers.values() for r in b.replicas])
        out += family(
            "llmgw_tokenize_refused_total",
            "counter",
            "/tokenize answers refused for holding more token ids than their prompt's bytes "
            "allow (balancing = precise); the request was routed without token ids.",
        )
        for url, n in sorted(self.tokenize_refused.items()):
            out.append(f"llmgw_tokenize_refused_total{_labels(endpoint=url)} {n}")
        fresh = [
            (model, r)
            for model, balancer in sorted(balancers.items())
            for r in balancer.replicas
            if r.engine_load is not None and now - r.engine_load_at <= tuning.metrics_max_age_s
        ]
        out += family(
            "llmgw_engine_load_fresh",
            "gauge",
            "1 when the engine's own load reading is recent enough to be used.",
        )
        fresh_ids = {id(r) for _, r in fresh}
        for model, balancer in sorted(balancers.items()):
            for r in balancer.replicas:
                labels = _labels(model=model, endpoint=r.endpoint.url)
                out.append(f"llmgw_engine_load_fresh{labels} {int(id(r) in fresh_ids)}")
        gauges: tuple[tuple[str, str, Callable[[LoadSignal], float | None]], ...] = (
            ("llmgw_engine_requests_running", "Running requests, as the engine reports.",
             lambda s: s.running),
            ("llmgw_engine_requests_waiting", "Waiting requests, as the engine reports.",
             lambda s: s.waiting),
            ("llmgw_engine_kv_cache_usage", "KV-cache use, 0 to 1, as the engine reports.",
             lambda s: s.kv_usage),
        )  # fmt: skip
        for name, help_text, value in gauges:
            out += family(name, "gauge", help_text)
            for model, r in fresh:
                assert r.engine_load is not None
                v = value(r.engine_load)
                if v is not None:
                    labels = _labels(model=model, endpoint=r.endpoint.url)
                    out.append(f"{name}{labels} {v:g}")
        out += family(
            "llmgw_engine_metrics_errors_total",
            "counter",
            "Engine /metrics reads that failed or held no load we know.",
        )
        for endpoint, n in sorted(self.engine_errors.items()):
            out.append(f"llmgw_engine_metrics_errors_total{_labels(endpoint=endpoint)} {n}")
