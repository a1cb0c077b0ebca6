"""How often each agent heartbeats, and how long its silence may last.

A heartbeat costs the control plane a few hundred microseconds (TLS, the frame, its
ack), so a fixed interval makes the fleet's total grow with it: 10,000 nodes every
5 s are 2,000 a second, more than the control plane's core gives while thousands
register. As Nomad does (`max_heartbeats_per_second`), the interval a node is given
when it registers grows with the number of nodes connected then, so that they
heartbeat at most `[control] heartbeats_per_s` a second in all, and never more often
than the base interval (5 s). The price is the time to notice a silent node: three
of its intervals, and never sooner than `unreachable_after_s`. A stream that closes
is noticed at once whatever the interval.

An agent of protocol 2 or later is told its new interval (a `Pace`, answering one of
its heartbeats) once the fleet's has grown to 1.5 times its own or shrunk to half: a
fleet that grew node by node stays within 1.5 times the bound, and each node hears
of it a few times as the fleet grows tenfold. An older agent keeps the interval of
its registration until it registers again (in a storm from nothing, the first nodes
keep the short ones: at 10,000 nodes and 200 a second, 660 a second in all, against
2,000 with a fixed 5 s).
"""

from __future__ import annotations

import math

# A node is unreachable after this many of its intervals without a word.
BEATS_TO_UNREACHABLE = 3.0


def heartbeat_interval(connected: int, base_s: float, per_s: float) -> float:
    """The interval for a node registering with `connected` nodes (itself included)."""
    # Up to the next tenth of a second, never down: the bound holds.
    return max(base_s, math.ceil(round(connected / per_s * 10, 6)) / 10)


def unreachable_after(interval_s: float, configured_s: float) -> float:
    """How long a node given `interval_s` may be silent before it is unreachable."""
    return max(configured_s, BEATS_TO_UNREACHABLE * interval_s)


def new_pace(current_s: float, wanted_s: float) -> bool:
    """Whether a node at `current_s` is told `wanted_s`, the fleet's interval now."""
    return wanted_s >= 1.5 * current_s or wanted_s <= current_s / 2
