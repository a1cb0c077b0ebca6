"""What a router answered, by model and replica, for the fleet page's traffic (issue 36).

The request path calls `finished` once a request, from the access record the router
fills anyway (model, replica, status, time to first byte): two dict lookups and a few
additions; and `failed` for each attempt on a replica that failed (its 5xx, or no
answer), which the router tried elsewhere: a replica answering 500s shows although its
clients got their answers from another. The route feed's reporter takes `report` every
TRAFFIC_INTERVAL_S, which starts the next interval. Bounds: `MAX_ROWS` models and
replicas an interval (more are counted in `left_out`), `MAX_TTFT_SAMPLES` first-byte
times a row an interval (the latest kept).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping

import attrs

from llmgw_core.traffic import MODEL_ROW, Sample

log = logging.getLogger("llmgw.traffic")

MAX_ROWS = 4096  # route_feed.messages.MAX_TRAFFIC_ROWS: what one frame may carry
MAX_TTFT_SAMPLES = 1024


@attrs.define(slots=True)
class _Counts:
    requests: int = 0
    e4xx: int = 0
    e5xx: int = 0
    ttft_s: deque[float] = attrs.field(factory=lambda: deque(maxlen=MAX_TTFT_SAMPLES))


class TrafficMeter:
    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], _Counts] = {}
        self.left_out = 0  # answers of rows past MAX_ROWS, since the start

    def finished(self, model: str, replica: str | None, status: int, ttfb_s: float | None) -> None:
        """One answer for `model` (from `replica`'s URL; None: the router answered)."""
        self._count((model, MODEL_ROW), status, ttfb_s)
        if replica is not None:
            self._count((model, replica), status, ttfb_s)

    def failed(self, model: str, replica: str) -> None:
        """An attempt on `replica` that failed (5xx, no answer): tried elsewhere, if anywhere;
        the client's answer is counted by `finished`."""
        self._count((model, replica), 500, None)

    def _count(self, key: tuple[str, str], status: int, ttfb_s: float | None) -> None:
        row = self._rows.get(key)
        if row is None:
            if len(self._rows) >= MAX_ROWS:
                if not self.left_out:
                    log.warning(
                        "more than %d models and replicas answered within a traffic report's "
                        "interval: the fleet page misses the others' (said once)",
                        MAX_ROWS,
                    )
                self.left_out += 1
                return
            row = self._rows[key] = _Counts()
        row.requests += 1
        if status >= 500:
            row.e5xx += 1
        elif status >= 400:
            row.e4xx += 1
        elif ttfb_s is not None and status:
            row.ttft_s.append(ttfb_s)

    def report(
        self, in_flight: Mapping[tuple[str, str], int], limit: int = MAX_ROWS
    ) -> tuple[Sample, ...]:
        """This interval's rows (consumed), with `in_flight` now by (model, replica URL or
        MODEL_ROW); a row with no answer and nothing in flight is left out, and past
        `limit` the replicas with the fewest errors and requests are."""
        rows, self._rows = self._rows, {}
        out = []
        for key in rows.keys() | {k for k, n in in_flight.items() if n}:
            counts = rows.get(key) or _Counts()
            out.append(
                Sample(
                    key[0],
                    key[1],
                    counts.requests,
                    counts.e4xx,
                    counts.e5xx,
                    _p90_ms(counts.ttft_s),
                    in_flight.get(key, 0),
                )
            )
        out.sort(key=lambda s: (s.replica != MODEL_ROW, -s.e5xx, -s.requests, s.model, s.replica))
        return tuple(out[:limit])


def _p90_ms(samples: deque[float]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)] * 1000, 1)
