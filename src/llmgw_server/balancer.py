"""Choosing a replica: pure decisions, time passed in.

Least outstanding requests over available replicas (power of two choices once
there are many), optional session affinity, and ejection after consecutive
failures until a health probe brings the replica back.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from collections.abc import Collection

import attrs

from llmgw_core.catalog import Endpoint

_P2C_ABOVE = 4  # below this many candidates a full scan is as cheap as sampling
_AFFINITY_MAX = 100_000
_BUSY_MIN_S = 1.0  # a 429/503 without Retry-After still sets the replica aside this long
_BUSY_MAX_S = 60.0  # an engine cannot take itself out for longer with one header


class Verdict(enum.Enum):
    """What an engine's answer, before its body, says about the replica."""

    RELAY = "relay"  # the engine's answer to this request (2xx, 3xx, any 4xx, 501, ...)
    FAILED = "failed"  # a sign of a broken replica: tried elsewhere, counted towards ejection
    BUSY = "busy"  # alive but asking for a pause: tried elsewhere, never counted


_VERDICTS = {500: Verdict.FAILED, 502: Verdict.FAILED, 504: Verdict.FAILED}
_VERDICTS |= {429: Verdict.BUSY, 503: Verdict.BUSY}


def judge(status: int) -> Verdict:
    return _VERDICTS.get(status, Verdict.RELAY)


def busy_pause_s(retry_after: bytes) -> float:
    """How long a replica that answered 429/503 is passed over: its Retry-After in
    seconds, within bounds (the HTTP-date form and nonsense count as none)."""
    try:
        value = float(retry_after)
    except ValueError:
        value = 0.0
    if value != value:  # NaN
        value = 0.0
    return min(max(value, _BUSY_MIN_S), _BUSY_MAX_S)


@attrs.define(eq=False, slots=True)
class Replica:
    endpoint: Endpoint
    outstanding: int = 0
    healthy: bool = True  # what the last health probe said
    ejected: bool = False  # too many consecutive failures; waits for a good probe
    probe_after: float = 0.0  # when an ejected replica may be probed again
    failures: int = 0  # consecutive
    draining: bool = False  # takes no new requests; those in flight finish
    busy_until: float = 0.0  # it answered 429/503 with Retry-After: others go first until then

    @property
    def available(self) -> bool:
        return self.healthy and not self.ejected and not self.draining


@attrs.define(eq=False)
class Balancer:
    """The replicas of one model."""

    replicas: list[Replica]
    eject_after_failures: int = 3
    eject_cooldown_s: float = 10.0
    rng: random.Random = attrs.field(factory=random.Random)
    _affinity: OrderedDict[str, Replica] = attrs.field(factory=OrderedDict)
    _turn: int = 0
    _busy_until: float = 0.0  # the latest busy_until of any replica: no filter after it

    def pick(
        self,
        *,
        exclude: Collection[Replica] = (),
        session: str | None = None,
        now: float | None = None,
    ) -> Replica | None:
        """A replica for one request; given `now`, busy ones only when no other is left."""
        if session is not None:
            pinned = self._affinity.get(session)
            if (
                pinned is not None
                and pinned.available
                and pinned not in exclude
                and (now is None or pinned.busy_until <= now)
            ):
                self._affinity.move_to_end(session)
                return pinned
        candidates = [r for r in self.replicas if r.available and r not in exclude]
        if not candidates:
            return None
        if now is not None and self._busy_until > now:
            # The engine asked for a pause; it still answers, so it is not ruled out.
            rested = [r for r in candidates if r.busy_until <= now]
            candidates = rested or candidates
        if len(candidates) > _P2C_ABOVE:
            a, b = self.rng.sample(candidates, 2)
            chosen = a if a.outstanding <= b.outstanding else b
        else:
            # Rotate the starting point so ties do not always land on the first replica.
            self._turn = (self._turn + 1) % len(candidates)
            rotated = candidates[self._turn :] + candidates[: self._turn]
            chosen = min(rotated, key=lambda r: r.outstanding)
        if session is not None:
            self._affinity[session] = chosen
            self._affinity.move_to_end(session)
            if len(self._affinity) > _AFFINITY_MAX:
                self._affinity.popitem(last=False)
        return chosen

    def set_endpoints(self, endpoints: Collection[Endpoint]) -> list[Replica]:
        """Follow a new replica set; known endpoints keep their state. Returns the removed."""
        known: dict[Endpoint, Replica] = {r.endpoint: r for r in self.replicas}
        self.replicas = [known.pop(e) if e in known else Replica(e) for e in endpoints]
        removed = list(known.values())
        for session, replica in list(self._affinity.items()):
            if replica in removed:
                del self._affinity[session]
        return removed

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0

    def busy(self, replica: Replica, retry_after_s: float, now: float) -> None:
        """It answered 429/503: alive, but others go first for `retry_after_s`."""
        replica.busy_until = max(replica.busy_until, now + retry_after_s)
        self._busy_until = max(self._busy_until, replica.busy_until)

    def failed(self, replica: Replica, now: float) -> bool:
        """Count a failure; returns True when it ejects the replica."""
        replica.failures += 1
        if not replica.ejected and replica.failures >= self.eject_after_failures:
            replica.ejected = True
            replica.probe_after = now + self.eject_cooldown_s
            return True
        return False

    def due_for_probe(self, replica: Replica, now: float) -> bool:
        return not replica.ejected or now >= replica.probe_after

    def probed(self, replica: Replica, ok: bool, now: float) -> None:
        if replica.ejected:
            if ok:
                replica.ejected = False
                replica.failures = 0
                replica.healthy = True
            else:
                replica.probe_after = now + self.eject_cooldown_s
            return
        replica.healthy = ok

    @property
    def healthy_count(self) -> int:
        return sum(1 for r in self.replicas if r.available)
