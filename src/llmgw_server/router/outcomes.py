"""What each answer leaves behind once sent: its count on /metrics, its replica's
traffic, its tokens by key, a refusal's log line, and the access log's line."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import trio

from llmgw_core.ratelog import RateLimit
from llmgw_server.router.access_log import AccessRecord, logfmt_value
from llmgw_server.router.balancer import Verdict, judge
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.recorder import LineWriter, RecordingResponder
from llmgw_server.router.served import ServedModels
from llmgw_server.router.stored import RESPONSES

log = logging.getLogger("llmgw.router")

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # answered, neither logged nor counted
_STORED_READS = (RESPONSES + b"/").decode()


class Outcomes:
    def __init__(
        self,
        metrics: RouterMetrics,
        served: ServedModels,
        keys: Mapping[str, frozenset[str] | None],
        access_log: LineWriter | None,
    ) -> None:
        self.metrics = metrics
        self.served = served
        self.keys = keys  # digest -> the models it may use; a reload replaces it
        self.access_log = access_log
        self._refusal_log = RateLimit(period_s=10.0)

    def finished(self, recorder: RecordingResponder, digest: str | None) -> None:
        """A request's answer is sent (or the client went away)."""
        record = recorder.record
        status = record.status
        if status in (200, 503) and record.path in PROBES and record.method in ("GET", "HEAD"):
            return  # health probes and metrics scrapes
        served = self.served
        named = record.model
        model = named if named in served.balancers or named in served.adapters else "-"
        metrics = self.metrics
        metrics.requests[(model, status)] += 1
        if model != "-":
            base = served.adapters.get(model, model)  # an adapter's answers are its model's
            # A replica's failed attempts were counted as they failed (Forwarder.failed).
            replica = None if judge(status) is Verdict.FAILED else record.replica
            served.traffic.finished(base, replica, status, record.ttfb_s)
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

    def rejected(self, record: AccessRecord, message: str) -> None:
        """A request that the HTTP server refused before routing (413, 408, malformed)."""
        self.metrics.requests[("-", record.status)] += 1
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


def _auth_failure(record: AccessRecord) -> str | None:
    """The llmgw_auth_failures_total reason of an answer the router made itself."""
    if record.status == 403:
        return "model_not_allowed"
    if record.status != 401:
        return None
    if record.path == "/metrics":
        return "metrics_token"
    return "missing_key" if record.key_id is None else "invalid_key"
