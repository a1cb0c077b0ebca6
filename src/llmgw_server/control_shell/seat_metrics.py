"""The seat's own metrics: leadership and the store, on every control plane's /metrics
(a standby's alone, a leader's after its plane's)."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Protocol

from llmgw_core.prometheus import Histogram
from llmgw_core.prometheus import family as family_header
from llmgw_core.prometheus import labels as _labels
from llmgw_server.control.hello_answer import COME_BACK, HANDSHAKE, LEADER, THIS_LEADER

# The store's operations named on /metrics: a bounded set whatever the client calls.
_OPS = frozenset({"grant", "keepalive", "revoke", "get", "range", "put", "delete", "txn", "watch"})
_RECENT = 64  # latencies kept for status's median


class Leading(Protocol):
    @property
    def leading(self) -> bool: ...

    @property
    def epoch(self) -> int: ...


class SeatMetrics:
    def __init__(self) -> None:
        self.changes = 0  # leaderships this process began or ended
        self.epoch = 0
        self.store = defaultdict[str, Histogram](Histogram)
        self._recent: deque[float] = deque(maxlen=_RECENT)
        # Agents' hellos answered before any TLS (Seat._answer_agent), by answer.
        self.hellos_answered = dict.fromkeys((LEADER, THIS_LEADER, COME_BACK, HANDSHAKE), 0)

    def store_request(self, op: str, seconds: float) -> None:
        self.store[op if op in _OPS else "other"].observe(seconds)
        self._recent.append(seconds)

    def began(self, epoch: int) -> None:
        self.changes += 1
        self.epoch = epoch

    def ended(self) -> None:
        self.changes += 1

    def latency_ms(self) -> float | None:
        """The median of the store's last requests, in milliseconds."""
        if not self._recent:
            return None
        ordered = sorted(self._recent)
        return round(ordered[len(ordered) // 2] * 1000, 2)

    def render(self, leadership: Leading) -> bytes:
        out: list[str] = []
        out += family_header(
            "llmgw_control_leader", "gauge", "1 while this control plane leads the fleet."
        )
        out.append(f"llmgw_control_leader {int(leadership.leading)}")
        out += family_header(
            "llmgw_control_epoch", "gauge", "The epoch of the leadership this process knows."
        )
        out.append(f"llmgw_control_epoch {leadership.epoch}")
        out += family_header(
            "llmgw_control_leadership_changes_total",
            "counter",
            "Leaderships this control plane began or ended.",
        )
        out.append(f"llmgw_control_leadership_changes_total {self.changes}")
        out += family_header(
            "llmgw_store_request_seconds", "histogram", "The store's (etcd's) answer times."
        )
        for op, histogram in sorted(self.store.items()):
            out += histogram.render("llmgw_store_request_seconds", _labels(op=op))
        out += family_header(
            "llmgw_control_agent_hellos_answered_total",
            "counter",
            "Agents' TLS hellos answered before any handshake: sent to the leader another "
            "control plane is (leader) or this one is (this_leader), or told to come back "
            "while no leader newer than the one they lost is known (come_back); or, the "
            "first of those that lost one leader, taken through their handshake here "
            "(handshake: held through the election, or served by this leader).",
        )
        for answer, count in self.hellos_answered.items():
            out.append(f"llmgw_control_agent_hellos_answered_total{_labels(answer=answer)} {count}")
        return ("\n".join(out) + "\n").encode()
