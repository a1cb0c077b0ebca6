"""The answer to an agent's hello before any TLS (control.hello_answer), over random
histories of elections, hellos and time: an agent that lost its leader is never sent to a
leader of an epoch at or below the one it lost; no lost epoch is given more handshakes
than the budget's, nor one address more than its share, whatever epochs the hellos
claim and in whatever order; a control
plane sends agents to itself only while it leads with its term begun; the budget's
memory is bounded; asking spends nothing (a waiting hello is asked again and again)."""

from __future__ import annotations

from collections import Counter

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hypothesis_profiles import profile_times
from llmgw_core.agent_lane import come_back_s, not_leader_url
from llmgw_server.control.hello_answer import (
    COME_BACK,
    HANDSHAKE,
    LEADER,
    THIS_LEADER,
    HandshakeBudget,
    HelloAnswer,
    HelloStanding,
    LeaderChecks,
    answer_hello,
)

HERE = "wss://cp-a.example:8081/v1/agent"
OTHER = "wss://cp-b.example:8081/v1/agent"
RECHECK_S = 1.0
epochs = st.integers(0, 12)  # few, so that hellos and leaderships meet
sources = st.sampled_from(["10.0.0.1", "10.0.0.2", "2001:db8::/64"])


class HelloMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.standing = HelloStanding(HERE, False, False, 0, None, False, 2.0)
        self.budget = HandshakeBudget()
        self.checks = LeaderChecks(RECHECK_S)
        self.now = 0.0
        self.given: Counter[int] = Counter()  # handshakes given, per lost epoch
        self.given_to: Counter[tuple[int, str]] = Counter()  # and per source

    @initialize(per_lost=st.integers(1, 6), per_source=st.integers(1, 3), kept=st.integers(1, 4))
    def a_small_budget(self, per_lost: int, per_source: int, kept: int) -> None:
        self.budget = HandshakeBudget(per_lost=per_lost, per_source=per_source, kept=kept)

    @rule(
        epoch=epochs,
        who=st.sampled_from(["nobody", "here", "other"]),
        term_begun=st.booleans(),
        store_ok=st.booleans(),
    )
    def the_election_changes(self, epoch: int, who: str, term_begun: bool, store_ok: bool) -> None:
        leading = who == "here"
        self.standing = HelloStanding(
            here=HERE,
            leading=leading,
            term_begun=leading and term_begun,
            epoch=0 if who == "nobody" else epoch,
            leader={"nobody": None, "here": HERE, "other": OTHER}[who],
            store_ok=store_ok,
            lease_ttl_s=2.0,
        )

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    def ask(self, lost: int | None, source: str) -> HelloAnswer:
        before = attrs.evolve(
            self.budget,
            spent=dict(self.budget.spent),
            by_source={e: Counter(c) for e, c in self.budget.by_source.items()},
        )
        checks_before = attrs.evolve(self.checks)
        answer = answer_hello(lost, source, self.standing, self.budget, self.checks, self.now)
        assert self.budget == before and self.checks == checks_before  # asking is free
        return answer

    @rule(lost=epochs, source=sources, asked=st.integers(1, 3))
    def an_agent_that_lost_its_leader_says_hello(self, lost: int, source: str, asked: int) -> None:
        # A hello that waits for the election is asked again; only the answer given counts.
        for _ in range(asked):
            answer = self.ask(lost, source)
        s = self.standing
        named = None if answer.line is None else not_leader_url(answer.line)
        if named is not None:
            assert s.store_ok and s.epoch > lost, (answer, s)
            assert named == (HERE if answer.answer == THIS_LEADER else s.leader)
            assert answer.answer in (LEADER, THIS_LEADER)
        if answer.answer == THIS_LEADER:
            assert s.leading and s.term_begun
        if answer.answer == LEADER:
            assert not s.leading and named is not None and named != HERE
        if answer.answer == COME_BACK:
            assert answer.line is not None and come_back_s(answer.line) is not None
            assert self.budget.left(lost, source) == 0
        if answer.answer == HANDSHAKE:
            assert answer.line is None and answer.spend == lost
        else:
            assert answer.spend is None
        newer_known = s.store_ok and s.leader is not None and s.epoch > lost
        if not newer_known and self.budget.left(lost, source) > 0:
            assert answer.answer == HANDSHAKE  # the first of them, at once
        if answer.check_leader is not None:
            assert not s.leading and s.store_ok and s.epoch <= lost
            assert answer.check_leader == s.leader
            assert self.checks.due(s.epoch, self.now)
            self.checks.checked(s.epoch, self.now)
        if answer.spend is not None:
            self.budget.spend(answer.spend, source)
            self.given[answer.spend] += 1
            self.given_to[answer.spend, source] += 1

    @rule(source=sources)
    def an_agent_that_lost_no_leader_says_hello(self, source: str) -> None:
        answer = self.ask(None, source)
        s = self.standing
        assert answer.spend is None and answer.check_leader is None
        if answer.line is None:
            assert answer.answer is None
        else:
            assert answer.answer == LEADER and not s.leading and s.store_ok
            assert not_leader_url(answer.line) == s.leader != HERE

    @invariant()
    def no_lost_epoch_gets_more_than_its_budget(self) -> None:
        assert all(count <= self.budget.per_lost for count in self.given.values())
        assert all(count <= self.budget.per_source for count in self.given_to.values())
        assert all(
            self.budget.spent.get(lost, self.budget.per_lost) >= count
            for lost, count in self.given.items()
        )

    @invariant()
    def the_budget_keeps_a_bounded_count_of_lost_epochs(self) -> None:
        assert len(self.budget.spent) <= self.budget.kept
        assert self.budget.by_source.keys() == self.budget.spent.keys()
        for lost, by_source in self.budget.by_source.items():
            assert by_source.total() == self.budget.spent[lost] <= self.budget.per_lost

    @precondition(lambda self: bool(self.given))
    @invariant()
    def a_dropped_epoch_has_nothing_left(self) -> None:
        for lost in self.given:
            if lost not in self.budget.spent:
                assert all(self.budget.left(lost, s) == 0 for s in ("10.0.0.1", "10.0.0.9"))


HelloMachine.TestCase.settings = settings(max_examples=profile_times(5), stateful_step_count=60)
test_hello_answers = HelloMachine.TestCase


def test_claimed_epochs_never_free_a_budget_spent() -> None:
    """Hellos claiming ever newer epochs push the oldest counts out: those epochs have
    nothing left, where a fresh count would give them the budget again."""
    budget = HandshakeBudget(per_lost=2, kept=2)
    budget.spend(5, "a")
    budget.spend(5, "b")
    assert budget.left(5, "c") == 0
    budget.spend(6, "a")
    budget.spend(7, "a")  # 5's count is dropped
    assert 5 not in budget.spent and budget.left(5, "c") == 0 and budget.left(4, "c") == 0
    assert budget.left(6, "c") == 1 and budget.left(8, "c") == 2
    assert budget.left(3, "c") == 0  # older than every epoch kept, the table full


def test_one_address_takes_its_share_and_others_the_rest() -> None:
    budget = HandshakeBudget(per_lost=5, per_source=2)
    budget.spend(5, "a")
    budget.spend(5, "a")
    assert budget.left(5, "a") == 0 and budget.left(6, "a") == 2
    assert budget.left(5, "b") == 2
    budget.spend(5, "b")
    budget.spend(5, "c")
    assert budget.left(5, "b") == 1 and budget.left(5, "d") == 1  # the epoch's last one
