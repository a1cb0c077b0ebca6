"""The Prometheus text format, written once for every /metrics page (the router's, the
control plane's, a workers' parent's): label sets, metric family headers, histograms."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

# Seconds: from a fast cached answer to a long generation.
SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0
)  # fmt: skip


def escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels(**named: str) -> str:
    """`{a="x",b="y"}`, values escaped, in the order given."""
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in named.items()) + "}"


def family(name: str, kind: str, help_text: str) -> tuple[str, str]:
    """A metric family's HELP and TYPE lines, which precede its samples once."""
    return f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"


class Histogram:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...] = SECONDS_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self, name: str, labels: str) -> Iterable[str]:
        """Its samples: cumulative buckets with `le` last, then the sum and the count."""
        inner = labels[1:-1]
        sep = "," if inner else ""
        total = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            total += count
            yield f'{name}_bucket{{{inner}{sep}le="{bound}"}} {total}'
        total += self.counts[-1]
        yield f'{name}_bucket{{{inner}{sep}le="+Inf"}} {total}'
        yield f"{name}_sum{labels} {self.sum:.6f}"
        yield f"{name}_count{labels} {total}"
