"""Choosing a replica: pure decisions, time passed in.

Three ways to balance (`[router] balancing`): cache_aware (see cache_aware), least
outstanding requests over available replicas (power of two choices once there are
many), or round robin. In every mode a request with a session header goes to the
replica that ranks highest for its session by rendezvous hashing: every router process
sends a session to the same replica, with no memory shared or kept, and when that
replica goes it moves to the next in its ranking (and back when it returns). Replicas
are ejected after consecutive failures until a health probe brings them back.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Collection

import attrs

from llmgw_core.catalog import Endpoint
from llmgw_core.config import CacheAwareSection
from llmgw_server.router import cache_aware
from llmgw_server.router.cache_aware import Decision
from llmgw_server.router.load_signals import LoadSignal
from llmgw_server.router.prefix import PrefixIndex, PromptKey, rendezvous, stable_hash

_P2C_ABOVE = 4  # below this many candidates a full scan is as cheap as sampling
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
    engine_load: LoadSignal | None = None  # the engine's last reading of its own load
    engine_load_at: float = 0.0  # when it was read
    outstanding_at_load: int = 0  # this router's outstanding requests when it was read
    prefixes: PrefixIndex | None = None  # what was sent here (cache_aware only)
    share: float = 0.0  # the recent share of the model's requests sent here
    rid: int = attrs.field(init=False)  # its name in rendezvous hashing, the same everywhere

    def __attrs_post_init__(self) -> None:
        self.rid = stable_hash(self.endpoint.url)

    @property
    def available(self) -> bool:
        return self.healthy and not self.ejected and not self.draining


@attrs.frozen(slots=True)
class Choice:
    replica: Replica
    decision: Decision
    matched_bytes: int = 0  # how much of the prompt this router believes the replica holds


@attrs.define(eq=False)
class Balancer:
    """The replicas of one model."""

    replicas: list[Replica]
    eject_after_failures: int = 3
    eject_cooldown_s: float = 10.0
    rng: random.Random = attrs.field(factory=random.Random)
    # A bare Balancer balances by least outstanding; the config's default is cache_aware.
    balancing: str = "least_outstanding"
    tuning: CacheAwareSection = attrs.field(factory=CacheAwareSection)
    _turn: int = 0
    _busy_until: float = 0.0  # the latest busy_until of any replica: no filter after it

    def __attrs_post_init__(self) -> None:
        for replica in self.replicas:
            self._adopt(replica, len(self.replicas))

    @property
    def cache_aware(self) -> bool:
        return self.balancing == "cache_aware"

    def _adopt(self, replica: Replica, count: int) -> None:
        if self.cache_aware and replica.prefixes is None:
            replica.prefixes = PrefixIndex(self.tuning.index_blocks, self.tuning.index_ttl_s)
            replica.share = 1.0 / count

    def pick(
        self,
        *,
        exclude: Collection[Replica] = (),
        session: str | None = None,
        now: float | None = None,
        prompt: PromptKey | None = None,
    ) -> Replica | None:
        """A replica for one request; given `now`, busy ones only when no other is left."""
        choice = self.choose(exclude=exclude, session=session, now=now, prompt=prompt)
        return None if choice is None else choice.replica

    def choose(
        self,
        *,
        exclude: Collection[Replica] = (),
        session: str | None = None,
        now: float | None = None,
        prompt: PromptKey | None = None,
    ) -> Choice | None:
        """A replica for one request and why; `prompt` is used by cache_aware alone."""
        candidates = [r for r in self.replicas if r.available and r not in exclude]
        if not candidates:
            return None
        if now is not None and self._busy_until > now:
            # The engine asked for a pause; it still answers, so it is not ruled out.
            rested = [r for r in candidates if r.busy_until <= now]
            candidates = rested or candidates
        matched = 0
        if session is not None:
            key = stable_hash(session)
            chosen = max(candidates, key=lambda r: rendezvous(key, r.rid))
            decision = Decision.SESSION
        elif self.cache_aware:
            chosen, decision, matched = cache_aware.choose(candidates, prompt, self.tuning, now)
        elif self.balancing == "round_robin":
            self._turn = (self._turn + 1) % len(candidates)
            chosen = candidates[self._turn]
            decision = Decision.ROUND_ROBIN
        else:
            chosen = self._least_outstanding(candidates)
            decision = Decision.LEAST_OUTSTANDING
        if self.cache_aware:
            cache_aware.assigned(self.replicas, chosen)
            if prompt is not None and chosen.prefixes is not None:
                chosen.prefixes.record(prompt, 0.0 if now is None else now)
        return Choice(chosen, decision, matched)

    def _least_outstanding(self, candidates: list[Replica]) -> Replica:
        if len(candidates) > _P2C_ABOVE:
            a, b = self.rng.sample(candidates, 2)
            return a if a.outstanding <= b.outstanding else b
        # Rotate the starting point so ties do not always land on the first replica.
        self._turn = (self._turn + 1) % len(candidates)
        rotated = candidates[self._turn :] + candidates[: self._turn]
        return min(rotated, key=lambda r: r.outstanding)

    def set_endpoints(self, endpoints: Collection[Endpoint]) -> list[Replica]:
        """Follow a new replica set; known endpoints keep their state. Returns the removed."""
        known: dict[Endpoint, Replica] = {r.endpoint: r for r in self.replicas}
        self.replicas = [known.pop(e) if e in known else Replica(e) for e in endpoints]
        for replica in self.replicas:
            self._adopt(replica, len(self.replicas))
        return list(known.values())

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
            _forget(replica)
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
        if replica.healthy and not ok:
            _forget(replica)
        replica.healthy = ok

    @property
    def healthy_count(self) -> int:
        return sum(1 for r in self.replicas if r.available)


def _forget(replica: Replica) -> None:
    """A replica that failed may come back as a fresh engine: its cache is not counted on."""
    if replica.prefixes is not None:
        replica.prefixes.clear()
