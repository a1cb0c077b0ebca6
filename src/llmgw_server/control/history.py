"""Each autoscaled model's last hour, for the fleet page's charts (issue 23).

Pure: the control plane's shell records a point per model every `POINT_EVERY_S` (the
routers' combined requests a second and TTFT p90, the replicas serving and desired) and
the page's stream reads what it has not sent yet (`since`). Bounded: `KEEP` points a
model (an hour), for the models autoscaled now.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping

import attrs

POINT_EVERY_S = 10.0
KEEP = 360  # an hour at one point every 10 s


@attrs.frozen(slots=True)
class Point:
    at: float  # wall-clock time (time.time())
    rps: float  # requests that arrived a second since the point before, all routers
    ttft_p90_ms: float | None  # the slowest router's; None: no request finished
    serving: int  # replicas serving
    desired: int


class History:
    def __init__(self, every_s: float = POINT_EVERY_S, keep: int = KEEP) -> None:
        self.every_s = every_s
        self.seq = 0  # points recorded so far, all models together: a reader's cursor
        self._series: dict[str, deque[tuple[int, Point]]] = {}
        self._keep = keep
        self._last: float | None = None

    def due(self, now: float) -> bool:
        return self._last is None or now - self._last >= self.every_s

    def record(self, now: float, points: Mapping[str, Point], models: Collection[str]) -> None:
        """A point for each of `points`; the series of models no longer in `models` go."""
        self._last = now
        for name in [m for m in self._series if m not in models]:
            del self._series[name]
        for name, point in points.items():
            self.seq += 1
            series = self._series.setdefault(name, deque(maxlen=self._keep))
            series.append((self.seq, point))

    def since(self, seq: int) -> dict[str, list[Point]]:
        """Each model's points recorded after cursor `seq` (0: all it keeps)."""
        out: dict[str, list[Point]] = {}
        for name, series in self._series.items():
            if series and series[-1][0] > seq:
                out[name] = [p for n, p in series if n > seq]
        return out
