"""Choosing a replica: pure decisions, time passed in.

Ways to balance (`[router] balancing`), each a policy in policies/ (one module each:
cache_aware, precise, least outstanding requests over available replicas, round robin,
and any other found there). In every mode a request with a session header goes to the
replica that ranks highest for its session by rendezvous hashing: every router process
sends a session to the same replica, with no memory shared or kept, and when that
replica goes it moves to the next in its ranking (and back when it returns). Replicas
are ejected after consecutive failures until a health probe brings them back.

The balancer owns its replicas' state (see replica.py for who writes which field): the
router, the health prober and the route table's follower change it through its methods.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Collection, Container
from typing import Any

import attrs

from llmgw_core.catalog import Endpoint
from llmgw_server.router.policies import Choice, Decision, Policy, policy_for
from llmgw_server.router.policies.policy import SESSION
from llmgw_server.router.prefix import PromptKey, rendezvous, stable_hash
from llmgw_server.router.replica import Replica

__all__ = ["Balancer", "Choice", "Decision", "Replica", "Verdict", "busy_pause_s", "judge"]

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


@attrs.define(eq=False)
class Balancer:
    """The replicas of one model."""

    replicas: list[Replica]
    eject_after_failures: int = 3
    eject_cooldown_s: float = 10.0
    rng: random.Random = attrs.field(factory=random.Random)
    # A bare Balancer balances by least outstanding; the config's default is cache_aware.
    balancing: str = "least_outstanding"
    tuning: Any = None  # the policy's config section (None: its defaults)
    # The policy's per-process state (its needs' `shared`: precise's index of what the
    # engines hold), None: a fresh one where it needs one.
    shared: Any = None
    policy: Policy = attrs.field(init=False)
    _busy_until: float = 0.0  # the latest busy_until of any replica: no filter after it

    def __attrs_post_init__(self) -> None:
        self.policy = policy_for(self.balancing, self.tuning, self.rng, self.shared)
        self.policy.follow(self.replicas)

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
        """A replica for one request and why; `prompt` is for a policy that reads it."""
        candidates = [r for r in self.replicas if r.available and r not in exclude]
        if not candidates:
            return None
        if now is not None and self._busy_until > now:
            # The engine asked for a pause; it still answers, so it is not ruled out.
            rested = [r for r in candidates if r.busy_until <= now]
            candidates = rested or candidates
        if session is not None:
            key = stable_hash(session)
            chosen = max(candidates, key=lambda r: rendezvous(key, r.rid))
            choice = Choice(chosen, SESSION)
        else:
            choice = self.policy.choose(candidates, prompt, now)
        self.policy.chosen(choice.replica, prompt, now)
        return choice

    def set_endpoints(self, endpoints: Collection[Endpoint]) -> list[Replica]:
        """Follow a new replica set; known endpoints keep their state. Returns the removed."""
        known: dict[Endpoint, Replica] = {r.endpoint: r for r in self.replicas}
        self.replicas = [known.pop(e) if e in known else Replica(e) for e in endpoints]
        self.policy.follow(self.replicas)
        return list(known.values())

    def mark_draining(self, draining: Container[Endpoint]) -> None:
        """The replicas whose endpoints are in `draining` take no new requests; the
        others do again (the route table's word)."""
        for replica in self.replicas:
            replica.draining = replica.endpoint in draining

    def sent(self, replica: Replica) -> None:
        """A request went to `replica`: outstanding until `finished`."""
        replica.outstanding += 1

    def finished(self, replica: Replica) -> None:
        """A request sent to `replica` is over, however it ended."""
        replica.outstanding -= 1

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
            self.policy.forget(replica)
            return True
        return False

    def due_for_probe(self, replica: Replica, now: float) -> bool:
        return not replica.ejected or now >= replica.probe_after

    def probed(self, replica: Replica, ok: bool, now: float, asked_at: float | None = None) -> None:
        """What a health probe sent at `asked_at` (default `now`) answered at `now`."""
        if replica.ejected:
            if (now if asked_at is None else asked_at) < replica.probe_after:
                # Sent before the ejection (or its cooldown) ended: an answer about the
                # replica as it was then, which must not lift it early.
                return
            if ok:
                replica.ejected = False
                replica.failures = 0
                replica.healthy = True
            else:
                replica.probe_after = now + self.eject_cooldown_s
            return
        if replica.healthy and not ok:
            self.policy.forget(replica)
        replica.healthy = ok

    @property
    def healthy_count(self) -> int:
        return sum(1 for r in self.replicas if r.available)
