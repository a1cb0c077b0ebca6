"""What a request does next, decided from what has happened to it: the request path's
plan, pure as the control core is (events in, a step out; no trio, no sockets).

A request routed to a model goes through these steps, each decided here and carried
out by the router's shell (router.front, router.forwarding, router.holding):

1. **admission** (`admit`): forward it, or hold it while its model has no serving
   replica (only an autoscaled model, or one held at a restart, is held; every other
   model's request is forwarded, and answered 503 if no replica is there); a request
   to hold is refused when the model's queue or a byte budget is full
   (meter.hold_refusal). The coming per-tenant limits and queues are steps of this
   decision.
2. **attempts** (`Attempts`): pick a replica (the balancer's policy chooses; the plan
   keeps it from choosing one already tried, and stops after `1 + retries`), send, and
   from the engine's answer head decide: relay it, or try another replica (a refusal
   kept as what the client gets if none does better). Once the client has had a byte
   of an answer nothing is tried again, unless the answer is a stream that broke:
3. **continue** (`Attempts.broke`): a stream whose engine died after its head goes on
   from another replica, as a continuation (router.continuation), at most
   `max_migrations` times a request; each continuation has its own `1 + retries`
   attempts, never on the replica that broke the stream.
4. **give up**: with the last refusal, or 503 when no replica was available at all.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import attrs

from llmgw_server.router.balancer import Verdict, judge
from llmgw_server.router.policies import Choice
from llmgw_server.router.policies.policy import STORED_RESPONSE
from llmgw_server.router.replica import Replica


class Admission(enum.Enum):
    FORWARD = "forward"  # pick a replica now
    HOLD = "hold"  # wait for a replica of the model to serve, within the hold's bounds


def admit(held_model: bool, serving: int) -> Admission:
    """Whether a request for a model is forwarded now or held: `held_model` says the
    model's requests are held while none of its `serving` replicas serves (autoscaled,
    or placed and held at a restart). Whether the hold's bounds leave it a place is
    meter.hold_refusal's decision, next."""
    if held_model and not serving:
        return Admission.HOLD
    return Admission.FORWARD


@attrs.frozen(slots=True)
class Refusal:
    """An answer that was not relayed: what the client gets if no replica does better."""

    status: int
    body: bytes
    replica: Replica
    why: str
    retry_after: bytes = b""


@attrs.frozen(slots=True)
class Send:
    """Send the request to `choice.replica`: attempt number `attempt` (0: the first)."""

    choice: Choice
    attempt: int


@attrs.frozen(slots=True)
class GiveUp:
    """No more attempts: answer `last` (None: no replica was available, 503)."""

    last: Refusal | None


@attrs.frozen(slots=True)
class Relayed:
    """The client has the answer of the last attempt: nothing more is tried."""


RELAYED = Relayed()

Chooser = Callable[[Sequence[Replica]], Choice | None]


@attrs.define(slots=True)
class Attempts:
    """One request's attempts on a model's replicas. At most `limit` sends, never the
    same replica twice, none after `relay`; a `pinned` replica (the one that holds what
    the request names) is the only one ever sent to."""

    limit: int
    pinned: Replica | None = None
    max_migrations: int = 0
    tried: list[Replica] = attrs.Factory(list)
    last: Refusal | None = None
    relayed: bool = False
    gave_up: bool = False  # final: nothing is sent after a give-up
    migrations: int = 0  # continuations begun: the client has had a stream's head
    _per_turn: int = 0  # the attempts each continuation has: the first turn's limit

    def broke(self) -> bool:
        """The relayed stream broke after its head: whether another replica may continue
        it (the next steps send continuations; a give-up then ends the stream)."""
        if not self.relayed or self.pinned is not None:
            return False
        if self.migrations >= self.max_migrations:
            return False
        if not self.migrations:
            self._per_turn = self.limit
        self.migrations += 1
        self.relayed = False
        self.last = None
        # Only the replica that broke it is passed over: one tried at an earlier seam may
        # serve again (an engine restarted in its place); one that is down is not chosen.
        self.tried = self.tried[-1:]
        self.limit = 1 + self._per_turn
        return True

    def next(self, choose: Chooser) -> Send | GiveUp | Relayed:
        """The next step: a send to the replica `choose` picks among those not tried
        (it is given them to exclude), give up, or nothing once an answer is relayed."""
        if self.relayed:
            return RELAYED
        tried = self.tried
        choice: Choice | None = None
        if not self.gave_up and len(tried) < self.limit:
            if self.pinned is None:
                choice = choose(tried)
            elif not tried:
                choice = Choice(self.pinned, STORED_RESPONSE)
        if choice is None or choice.replica in tried:
            self.gave_up = True
            return GiveUp(self.last)
        tried.append(choice.replica)
        return Send(choice, len(tried) - 1)

    def answered(self, status: int) -> Verdict:
        """The engine answered with `status`: RELAY ends the attempts (the client gets
        it); otherwise the shell reads the refusal and says `refused`."""
        verdict = judge(status)
        if verdict is Verdict.RELAY:
            self.relayed = True
        return verdict

    def refused(self, refusal: Refusal) -> None:
        """An attempt ended without an answer to relay (unreachable, failed, busy)."""
        self.last = refusal
