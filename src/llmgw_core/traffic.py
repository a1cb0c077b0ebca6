"""Each model's and replica's traffic as the routers report it, for the fleet page (issue 36).

Pure: the route hub adds every router's `Traffic` report (`add`, with the wall-clock
time) and the page's stream reads `view`. A report covers its router's last
`interval_s`; reports are summed into buckets of `BUCKET_S`: requests, 4xx and 5xx
answers add up; a bucket's TTFT p90 is the slowest router's p90 (routers cannot
merge percentiles, so the page shows an upper bound); its in flight is the
time-average of the routers' totals (each report's count weighs interval_s/BUCKET_S).

Bounded: a model's series keeps `MODEL_KEEP` buckets (an hour), a replica's
`REPLICA_KEEP` (its last minute: enough to see which one fails now); at most
`MAX_SERIES` series (models and replicas), a new one past that is counted in
`dropped`; a series with nothing for an hour goes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import attrs

BUCKET_S = 10.0
MODEL_KEEP = 360  # an hour of a model's buckets
REPLICA_KEEP = 7  # a replica's last minute (ALERT_WINDOW_S) and the bucket under way
MAX_SERIES = 20_000  # models and replicas (see docs/control-plane.md for the memory)
ALERT_WINDOW_S = 60.0  # a replica's 5xx share is judged over its last minute
ALERT_SHARE = 0.05  # more than 5% of its answers were 5xx ...
ALERT_MIN_REQUESTS = 5  # ... out of at least this many: one 500 of two is no pattern
PAGE_REPLICAS = 50  # replicas of a model the page is sent, the worst first
MODEL_ROW = "*"  # a report's replica for its model's total (refusals without a replica too)


@attrs.frozen(slots=True)
class Sample:
    """One router's counts for one model (replica MODEL_ROW) or replica over its interval."""

    model: str
    replica: str
    requests: int
    e4xx: int
    e5xx: int
    ttft_p90_ms: float | None
    in_flight: int


@attrs.define(slots=True)
class Bucket:
    start: float  # wall-clock time, a multiple of BUCKET_S
    requests: int = 0
    e4xx: int = 0
    e5xx: int = 0
    ttft_p90_ms: float | None = None
    in_flight: float = 0.0  # time-averaged, all routers


class TrafficStore:
    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self._series: dict[tuple[str, str], deque[Bucket]] = {}
        self._max_series = max_series
        self.dropped = 0  # reports of series past max_series, left out
        self.version = 0  # bumped by each report: the page's cue to look again
        self._latest = 0.0  # the newest bucket's start

    def add(self, now: float, interval_s: float, samples: Iterable[Sample]) -> None:
        start = now - now % BUCKET_S
        self.version += 1
        if start > self._latest:
            self._latest = start
            self._forget(now)
        weight = min(interval_s / BUCKET_S, 1.0)
        for s in samples:
            key = (s.model, s.replica)
            series = self._series.get(key)
            if series is None:
                if len(self._series) >= self._max_series:
                    self.dropped += 1
                    continue
                keep = MODEL_KEEP if s.replica == MODEL_ROW else REPLICA_KEEP
                series = self._series[key] = deque(maxlen=keep)
            if not series or series[-1].start < start:
                series.append(Bucket(start))
            bucket = series[-1]  # a report from before it (a clock step back) counts in it
            bucket.requests += s.requests
            bucket.e4xx += s.e4xx
            bucket.e5xx += s.e5xx
            if s.ttft_p90_ms is not None:
                bucket.ttft_p90_ms = max(bucket.ttft_p90_ms or 0.0, s.ttft_p90_ms)
            bucket.in_flight += s.in_flight * weight

    def _forget(self, now: float) -> None:
        old = now - MODEL_KEEP * BUCKET_S
        for key in [k for k, series in self._series.items() if series[-1].start < old]:
            del self._series[key]

    def failing(self, model: str, replica: str, now: float) -> bool:
        """Whether the replica's 5xx share over its last ALERT_WINDOW_S passes ALERT_SHARE."""
        requests, _, e5xx = _totals(self._series.get((model, replica), ()), now - ALERT_WINDOW_S)
        return requests >= ALERT_MIN_REQUESTS and e5xx > ALERT_SHARE * requests

    def view(self, now: float) -> dict[str, Any]:
        """What the page draws: each model's buckets and its replicas' (the failing first,
        then the busiest, PAGE_REPLICAS at most), with each one's last-minute figures."""
        models: dict[str, Any] = {}
        replicas: dict[str, list[tuple[str, deque[Bucket]]]] = {}
        for (model, replica), series in self._series.items():
            if replica == MODEL_ROW:
                models[model] = _doc(series, now)
            else:
                replicas.setdefault(model, []).append((replica, series))
        for model, rows in replicas.items():
            doc = models.setdefault(model, _doc((), now))
            # A replica's figures only: its buckets stay here (`failing` reads them).
            docs = [dict(_doc(series, now, points=False), url=url) for url, series in rows]
            for d in docs:
                d["failing"] = self.failing(model, d["url"], now)
            docs.sort(key=lambda d: (not d["failing"], -d["minute"]["requests"], d["url"]))
            doc["replicas"] = docs[:PAGE_REPLICAS]
            doc["replicas_left_out"] = max(len(docs) - PAGE_REPLICAS, 0)
        return {
            "bucket_s": BUCKET_S,
            "now": now,
            "models": models,
            "dropped": self.dropped,
            "alert": {"window_s": ALERT_WINDOW_S, "share": ALERT_SHARE},
        }


def _totals(series: Iterable[Bucket], since: float) -> tuple[int, int, int]:
    requests = e4xx = e5xx = 0
    for b in series:
        if b.start + BUCKET_S > since:
            requests, e4xx, e5xx = requests + b.requests, e4xx + b.e4xx, e5xx + b.e5xx
    return requests, e4xx, e5xx


def _doc(series: Iterable[Bucket], now: float, points: bool = True) -> dict[str, Any]:
    buckets = list(series)
    requests, e4xx, e5xx = _totals(buckets, now - ALERT_WINDOW_S)
    recent = [b for b in buckets if b.start + BUCKET_S > now - ALERT_WINDOW_S]
    ttfts = [b.ttft_p90_ms for b in recent if b.ttft_p90_ms is not None]
    return {
        # Columns, not objects: an hour of a model is 360 rows of 6 numbers.
        "points": [
            [b.start, b.requests, b.e4xx, b.e5xx, b.ttft_p90_ms, b.in_flight]
            for b in (buckets if points else ())
        ],
        "minute": {
            "requests": requests,
            "rps": requests / ALERT_WINDOW_S,
            "e4xx": e4xx,
            "e5xx": e5xx,
            "ttft_p90_ms": max(ttfts) if ttfts else None,
            # The bucket under way has only part of its reports: the one before counts too.
            "in_flight": round(max((b.in_flight for b in recent[-2:]), default=0.0), 2),
        },
    }
