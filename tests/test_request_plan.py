"""The request path's plan (router.request_plan), driven without sockets: whatever the
balancer picks and whatever the engines answer, a request is never sent again once its
answer is relayed, never to one replica twice, at most 1 + retries times, and a
pinned request to its replica alone; only a model with no serving replica is held."""

from __future__ import annotations

from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import given
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmgw_core.catalog import Endpoint
from llmgw_server.router.balancer import Verdict, judge
from llmgw_server.router.policies import Choice
from llmgw_server.router.policies.cache_aware import FALLBACK
from llmgw_server.router.policies.policy import STORED_RESPONSE
from llmgw_server.router.policies.round_robin import ROUND_ROBIN
from llmgw_server.router.replica import Replica
from llmgw_server.router.request_plan import (
    RELAYED,
    Admission,
    Attempts,
    GiveUp,
    Refusal,
    Relayed,
    Send,
    admit,
)

STATUSES = st.sampled_from([200, 201, 400, 404, 429, 500, 501, 502, 503, 504])


def replicas(n: int) -> list[Replica]:
    return [Replica(Endpoint("127.0.0.1", 9000 + k)) for k in range(n)]


class RequestAttempts(RuleBasedStateMachine):
    """One request's attempts over a model's replicas, with a balancer that may pick
    anything (a tried replica too, or none) and engines that may answer anything."""

    @initialize(
        n=st.integers(1, 6), retries=st.integers(0, 4), pin=st.one_of(st.none(), st.integers(0, 5))
    )
    def start(self, n: int, retries: int, pin: int | None) -> None:
        self.replicas = replicas(n)
        self.pinned = None if pin is None else self.replicas[pin % n]
        self.plan = Attempts(1 + retries, self.pinned)
        self.limit = 1 + retries
        self.sent: list[Replica] = []
        self.awaiting: Replica | None = None  # sent, its outcome not yet told
        self.relayed = False
        self.last: Refusal | None = None
        self.ended = False

    def _next(self, choose: object) -> Send | GiveUp | Relayed:
        step = self.plan.next(choose)  # type: ignore[arg-type]
        if isinstance(step, Send):
            assert not self.relayed, "sent again after the answer was relayed"
            assert not self.ended, "sent again after giving up"
            assert step.choice.replica not in self.sent, "one replica tried twice"
            assert step.attempt == len(self.sent)
            if self.pinned is not None:
                assert step.choice.replica is self.pinned
                assert step.choice.decision is STORED_RESPONSE
            self.sent.append(step.choice.replica)
            self.awaiting = step.choice.replica
        elif isinstance(step, GiveUp):
            assert not self.relayed
            assert step.last is self.last
            self.ended = True
        else:
            assert step is RELAYED and self.relayed
        return step

    @precondition(lambda self: self.awaiting is None)
    @rule(pick=st.integers(0, 5))
    def balancer_picks_one_not_excluded(self, pick: int) -> None:
        def choose(exclude: Sequence[Replica]) -> Choice | None:
            left = [r for r in self.replicas if r not in exclude]
            return Choice(left[pick % len(left)], ROUND_ROBIN) if left else None

        self._next(choose)

    @precondition(lambda self: self.awaiting is None)
    @rule(pick=st.integers(0, 5))
    def balancer_picks_anything(self, pick: int) -> None:
        """A buggy policy: it may pick a replica already tried."""
        self._next(lambda _: Choice(self.replicas[pick % len(self.replicas)], FALLBACK))

    @precondition(lambda self: self.awaiting is None)
    @rule()
    def balancer_has_none(self) -> None:
        step = self._next(lambda _: None)
        if self.pinned is None:
            assert not isinstance(step, Send)

    @precondition(lambda self: self.awaiting is not None)
    @rule(timed_out=st.booleans())
    def unreachable(self, timed_out: bool) -> None:
        assert self.awaiting is not None
        status = 504 if timed_out else 502
        self.last = Refusal(status, b"{}", self.awaiting, "connection refused")
        self.plan.refused(self.last)
        self.awaiting = None

    @precondition(lambda self: self.awaiting is not None)
    @rule(status=STATUSES)
    def engine_answers(self, status: int) -> None:
        assert self.awaiting is not None
        verdict = self.plan.answered(status)
        assert verdict is judge(status)
        if verdict is Verdict.RELAY:
            self.relayed = True
        else:
            self.last = Refusal(status, b"{}", self.awaiting, f"answered {status}")
            self.plan.refused(self.last)
        self.awaiting = None

    @invariant()
    def within_the_limit(self) -> None:
        assert len(self.sent) <= self.limit
        if self.pinned is not None:
            assert len(self.sent) <= 1


TestRequestAttempts = RequestAttempts.TestCase


def test_gives_up_after_one_plus_retries_sends() -> None:
    fleet = replicas(6)
    plan = Attempts(3)
    sent = []
    while True:
        step = plan.next(lambda ex: Choice(next(r for r in fleet if r not in ex), FALLBACK))
        if not isinstance(step, Send):
            break
        sent.append(step.choice.replica)
        assert plan.answered(502) is Verdict.FAILED
        plan.refused(Refusal(502, b"", step.choice.replica, "answered 502"))
    assert len(sent) == 3 == len(set(sent))
    assert isinstance(step, GiveUp) and step.last is not None and step.last.replica is sent[-1]


def test_no_replica_at_all_gives_up_with_nothing_to_relay() -> None:
    step = Attempts(3).next(lambda _: None)
    assert step == GiveUp(None)  # the shell answers 503 "no healthy replica"


@given(held_model=st.booleans(), serving=st.integers(0, 8))
def test_only_a_held_model_without_a_serving_replica_is_held(
    held_model: bool, serving: int
) -> None:
    admission = admit(held_model, serving)
    assert (admission is Admission.HOLD) == (held_model and serving == 0)
