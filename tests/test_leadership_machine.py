"""The election state (control/leadership.py): each rule alone, then two or three
control planes driven through random histories against a model of etcd.

The model keeps what etcd keeps for an election: leases with the time they end, the
leader key with its create revision and lease, the store's revision, and each
candidate's watch. Requests and answers travel separately and may be delayed, lost, or
answered after their lease ended; the clock moves in small steps and in big jumps, and
a candidate may be paused (SIGSTOP) across them, or restarted. After every step: at
most one candidate may act, a candidate that may act holds a live lease and the key of
its epoch, every candidate's deadline falls no later than etcd's end of its lease, and
epochs grow from one leadership to the next. A fault-free interval longer than the TTL
ends with a leader.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hypothesis_profiles import profile_times
from llmgw_server.control.leadership import (
    Action,
    Campaign,
    Grant,
    Lead,
    LeaderRecord,
    Leadership,
    Member,
    Note,
    Phase,
    Renew,
    Revoke,
    StepDown,
    Withdraw,
)

TTL = 2.0
ME = Member("cp-1", "wss://cp-1:8443/agents", "digest-a", 1000.0)
OTHER = Member("cp-2", "wss://cp-2:8443/agents", "digest-a", 1000.0)
ODD = Member("cp-3", "wss://cp-3:8443/agents", "digest-b", 1000.0)


def record(member: Member, since: float = 1_700_000_000.0) -> LeaderRecord:
    return LeaderRecord(member, since)


def granted(now: float = 10.0, lease: int = 7) -> Leadership:
    """A standby holding lease `lease` (granted at `now`), the leader key not yet read."""
    core = Leadership(ME, TTL)
    assert core.tick(now) == [Grant()]
    assert core.lease_granted(lease, TTL, sent_at=now, now=now) == []
    return core


def leading(now: float = 10.0, lease: int = 7, epoch: int = 20) -> Leadership:
    core = granted(now, lease)
    assert core.leader_gone(revision=epoch - 1, now=now) == [Campaign(lease)]
    assert core.campaign_won(lease, record(ME), epoch, now) == [Lead(epoch)]
    return core


# -- each rule


def test_a_new_control_plane_asks_for_a_lease_once_and_retries_after_a_failure() -> None:
    core = Leadership(ME, TTL)
    assert core.tick(0.0) == [Grant()]
    assert core.tick(0.1) == []  # one grant at a time
    assert core.grant_failed(0.5, "connection refused") == []
    assert core.next_wake() == 0.5 + 0.25
    assert core.tick(0.7) == []
    assert core.tick(0.75) == [Grant()]
    assert core.why() == "the store is unreachable: connection refused"


def test_no_campaign_until_the_leader_key_is_read_and_absent() -> None:
    core = granted()
    assert core.tick(10.1) == []
    assert core.why() == "standing by: reading the leader key"
    assert core.leader_gone(revision=5, now=10.1) == [Campaign(7)]
    assert core.phase is Phase.CAMPAIGNING
    assert core.why() == "campaigning"
    assert core.tick(10.2) == []  # one campaign at a time


def test_the_fence_runs_from_when_the_grant_or_keepalive_was_sent() -> None:
    core = Leadership(ME, TTL)
    core.tick(10.0)
    # Answered 0.4 s after it was sent: etcd counts from no earlier than the send.
    core.lease_granted(7, TTL, sent_at=10.0, now=10.4)
    core.leader_gone(revision=19, now=10.4)
    core.campaign_won(7, record(ME), 20, 10.4)
    assert core.may_act(11.999)
    assert not core.may_act(12.0)
    assert core.tick(11.0) == [Renew(7)]  # due at 10.5
    core.keepalive_answered(7, sent_at=11.0, ttl_left=TTL, now=11.7)
    assert core.may_act(12.999) and not core.may_act(13.0)


def test_renewal_every_quarter_ttl_and_a_failed_one_retried_without_moving_the_deadline() -> None:
    core = granted(now=10.0)
    assert core.next_wake() == 10.5
    assert core.tick(10.49) == []
    assert core.tick(10.5) == [Renew(7)]
    assert core.tick(10.6) == []  # one in flight
    assert core.keepalive_failed(7, 10.9, "timed out") == []
    assert core.lease is not None and core.lease.deadline == 12.0
    assert core.next_wake() == 10.9 + 0.25
    assert core.tick(11.15) == [Renew(7)]
    core.keepalive_answered(7, sent_at=11.15, ttl_left=TTL, now=11.2)
    assert core.lease.deadline == 13.15
    assert core.next_wake() == 11.15 + 0.5
    assert core.store_ok


def test_a_late_answer_never_shortens_the_deadline_and_one_for_another_lease_is_ignored() -> None:
    core = granted(now=10.0)
    core.tick(10.5)
    core.keepalive_answered(7, sent_at=10.5, ttl_left=TTL, now=10.6)
    core.keepalive_answered(7, sent_at=10.2, ttl_left=TTL, now=10.7)  # an older send
    assert core.lease is not None and core.lease.deadline == 12.5
    core.keepalive_answered(99, sent_at=11.0, ttl_left=0, now=11.0)
    assert core.lease.id == 7 and core.lease.deadline == 12.5


def test_keepalive_answered_zero_steps_the_leader_down_and_asks_for_a_new_lease() -> None:
    core = leading()
    core.tick(10.5)
    out = core.keepalive_answered(7, sent_at=10.5, ttl_left=0, now=10.6)
    assert out[0] == StepDown(20, "lease 7 ended: etcd no longer holds it")
    assert out[1:] == [Revoke(7), Grant()]
    assert not core.may_act(10.6)
    assert core.why() == "stepped down: lease 7 ended: etcd no longer holds it"
    assert core.phase is Phase.STEPPED_DOWN
    assert core.lease_granted(8, TTL, sent_at=10.7, now=10.7) == []
    assert core.why().endswith(": this control plane's claim of a lease it let go, until that ends")
    assert core.leader_gone(revision=21, now=10.8) == [Campaign(8)]


def test_a_leader_woken_past_its_deadline_may_not_act_before_anything_runs() -> None:
    core = leading(now=10.0)
    # Paused (SIGSTOP) at 10.1 and woken at 300: the check alone already refuses.
    assert not core.may_act(300.0)
    out = core.tick(300.0)
    assert isinstance(out[0], StepDown) and out[0].epoch == 20
    assert "no keepalive answered in its 2 s TTL" in out[0].why
    assert out[1:] == [Revoke(7), Grant()]
    assert core.epoch == 0 and not core.may_act(300.0)


def test_a_campaign_won_after_the_deadline_is_withdrawn_not_led() -> None:
    core = granted(now=10.0)
    core.leader_gone(revision=19, now=10.0)
    # The answer arrives after a pause past the lease's end: the lease is let go first.
    out = core.campaign_won(7, record(ME), 20, 12.5)
    assert Lead(20) not in out and not core.may_act(12.5)
    # The lease is gone from here: the claim under it is withdrawn by its revocation.
    assert Revoke(7) in out and Grant() in out


def test_a_campaign_won_with_the_lease_alive_but_after_resigning_is_withdrawn() -> None:
    core = granted(now=10.0)
    core.leader_gone(revision=19, now=10.0)
    assert core.resign(10.1) == [Revoke(7)]
    assert core.campaign_won(7, record(ME), 20, 10.2) == []  # the lease is let go already
    assert not core.may_act(10.2)


def test_one_campaign_at_a_time_even_when_the_store_fails_meanwhile() -> None:
    core = granted()
    core.leader_gone(revision=19, now=10.0)
    assert core.store_failed(10.1, "a keepalive timed out") == []
    assert core.leader_gone(revision=19, now=10.2) == []  # the first is still on its way
    assert core.campaign_failed(10.3, "timed out") == []
    assert core.leader_gone(revision=19, now=10.4) == [Campaign(7)]
    # Another's claim, then its deletion, watched while ours is on its way: still one.
    assert core.leader_seen(record(OTHER), 20, 55, revision=20, now=10.41) == []
    assert core.leader_gone(revision=21, now=10.42) == []
    # Its answer (older than the deletion) changes nothing but that it came back.
    assert core.campaign_lost(record(OTHER), 20, 55, revision=20, now=10.43) == [Campaign(7)]


def test_a_claim_read_back_under_our_own_lease_is_our_win_whose_answer_was_lost() -> None:
    core = granted(now=10.0)
    core.leader_gone(revision=19, now=10.0)
    assert core.campaign_failed(10.3, "timed out") == []
    assert core.phase is Phase.STANDBY and not core.leader_known
    assert core.leader_seen(record(ME), 20, 7, revision=20, now=10.4) == [Lead(20)]
    assert core.may_act(10.4) and core.epoch == 20


def test_a_lost_campaign_leaves_a_standby_that_names_the_leader() -> None:
    core = granted()
    core.leader_gone(revision=19, now=10.0)
    assert core.campaign_lost(record(OTHER), 20, 55, revision=20, now=10.1) == []
    assert core.phase is Phase.STANDBY and not core.may_act(10.1)
    assert core.why() == "leader cp-2 at wss://cp-2:8443/agents since 2023-11-14T22:13:20Z"
    assert core.tick(10.2) == []  # no campaign while it leads
    assert core.leader_gone(revision=25, now=10.3) == [Campaign(7)]


def test_a_differing_catalog_digest_is_noted_once_per_change_and_never_campaigns() -> None:
    core = granted()
    out = core.leader_seen(record(ODD), 20, 55, revision=20, now=10.1)
    assert len(out) == 1 and isinstance(out[0], Note)
    assert "digest-a differs from the leader cp-3's digest-b" in out[0].line
    assert core.leader_seen(record(ODD), 20, 55, revision=21, now=10.2) == []  # once
    assert "does not lead while cp-3 does" in core.why()
    assert core.tick(10.3) == []
    # Another leader of the same digest: no line; the odd one back: noted again.
    assert core.leader_gone(revision=22, now=10.4) == [Campaign(7)]
    assert core.campaign_lost(record(OTHER), 23, 56, revision=23, now=10.41) == []
    assert core.leader_seen(record(ODD), 30, 57, revision=30, now=10.42) == [Note(out[0].line)]
    # With no leader, it campaigns like any other.
    assert core.leader_gone(revision=31, now=10.43) == [Campaign(7)]


def test_a_store_failure_keeps_a_leader_until_its_deadline_and_says_why() -> None:
    core = leading(now=10.0)
    core.tick(10.5)
    assert core.keepalive_failed(7, 10.6, "etcd at http://127.0.0.1:1 refused") == []
    assert core.may_act(11.9)
    assert core.why().startswith("leading since 2023-11-14T22:13:20Z (epoch 20); the store is")
    out = core.tick(12.0)
    assert [type(a) for a in out] == [StepDown, Revoke, Grant]
    assert core.why() == "the store is unreachable: etcd at http://127.0.0.1:1 refused"


def test_a_store_failure_makes_the_key_read_again_before_a_campaign() -> None:
    core = granted()
    core.leader_seen(record(OTHER), 20, 55, revision=20, now=10.0)
    core.store_failed(10.1, "watch broke")
    assert not core.leader_known
    assert core.tick(10.2) == []
    assert core.leader_gone(revision=25, now=10.3) == [Campaign(7)]


def test_reads_older_than_the_last_applied_are_ignored() -> None:
    core = granted()
    core.leader_gone(revision=30, now=10.0)
    core.leader_seen(record(OTHER), 31, 55, revision=31, now=10.0)
    core.leader_gone(revision=30, now=10.1)  # a campaign's stale answer
    assert core.leader == record(OTHER)
    core.leader_seen(record(ODD), 20, 56, revision=40, now=10.2)  # an older epoch
    assert core.leader == record(OTHER)


def test_a_leader_whose_key_is_deleted_or_taken_steps_down() -> None:
    core = leading()
    out = core.leader_gone(revision=21, now=10.1)
    assert out == [StepDown(20, "the leader key was deleted"), Campaign(7)]
    assert not core.may_act(10.1)
    core.campaign_won(7, record(ME), 22, 10.2)
    out = core.leader_seen(record(OTHER), 23, 55, revision=23, now=10.3)
    assert out == [StepDown(22, "the leader key was taken over by cp-2")]
    assert not core.may_act(10.3)


def test_a_guarded_write_refused_steps_the_leader_down() -> None:
    core = leading()
    assert core.fence_failed(19, 10.1) == []  # an older leadership's write
    assert core.may_act(10.1)
    assert core.fence_failed(20, 10.1) == [StepDown(20, "the leader key is no longer of epoch 20")]
    assert not core.may_act(10.1)


def test_resigning_stops_acting_at_once_withdraws_and_never_campaigns_again() -> None:
    core = leading()
    out = core.resign(10.1)
    assert not core.may_act(10.1) and core.phase is Phase.STEPPED_DOWN
    assert out == [Withdraw(20), StepDown(20, "resigned"), Revoke(7)]
    assert core.leader_gone(revision=21, now=10.2) == []
    assert core.tick(20.0) == []
    assert core.next_wake() == math.inf
    assert core.lease_granted(9, TTL, sent_at=20.0, now=20.0) == [Revoke(9)]
    assert core.why() == "resigned: this control plane is stopping and does not campaign"


def test_the_ttl_etcd_granted_is_the_one_used() -> None:
    core = Leadership(ME, TTL)
    core.tick(0.0)
    core.lease_granted(7, 8.0, sent_at=0.0, now=0.0)  # etcd's minimum TTL may be higher
    assert core.lease is not None and core.lease.deadline == 8.0 and core.next_wake() == 2.0


# -- the model


@attrs.define
class Lease:
    expires_at: float


@attrs.define
class Key:
    record: LeaderRecord
    create_revision: int
    lease: int


@attrs.define
class Etcd:
    """What etcd keeps for an election, with exact lease expiry (a real etcd expires a
    lease no sooner: it only ever helps the fence)."""

    revision: int = 1
    next_lease: int = 100
    leases: dict[int, Lease] = attrs.Factory(dict)
    key: Key | None = None
    watchers: list[Candidate] = attrs.Factory(list)

    def expire(self, now: float) -> None:
        for lease_id, lease in sorted(self.leases.items()):
            if lease.expires_at <= now:
                self.revoke(lease_id)

    def revoke(self, lease_id: int) -> None:
        if self.leases.pop(lease_id, None) is None:
            return
        if self.key is not None and self.key.lease == lease_id:
            self.delete()

    def delete(self) -> None:
        self.revision += 1
        self.key = None
        for c in self.watchers:
            if c.watching:
                c.events.append(("delete", None, self.revision))

    def create(self, record: LeaderRecord, lease: int) -> int:
        self.revision += 1
        self.key = Key(record, self.revision, lease)
        for c in self.watchers:
            if c.watching:
                c.events.append(("put", self.key, self.revision))
        return self.revision


@attrs.define
class Candidate:
    member: Member
    core: Leadership
    paused: bool = False
    watching: bool = False
    events: deque[tuple[str, Key | None, int]] = attrs.Factory(deque)
    answers: deque[Answer] = attrs.Factory(deque)


Kind = Literal["grant", "keepalive", "campaign", "withdraw", "revoke"]


@attrs.frozen
class Request:
    cand: int
    core: Leadership = attrs.field(eq=False)  # the process that sent it
    kind: Kind
    sent_at: float
    arg: int = 0  # the lease id, or the epoch of a withdraw


@attrs.frozen
class Answer:
    request: Request
    ok: bool
    lease: int = 0
    ttl: float = 0.0
    won: bool = False
    key: Key | None = None
    revision: int = 0


class ElectionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self.etcd = Etcd()
        self.cands: list[Candidate] = []
        self.requests: list[Request] = []
        self.epochs: list[int] = []  # every Lead, in order

    @initialize(n=st.integers(2, 3))
    def start(self, n: int) -> None:
        for member in (ME, OTHER, ODD)[:n]:
            c = Candidate(member, Leadership(member, TTL))
            self.cands.append(c)
            self.etcd.watchers.append(c)
        for i in range(n):
            self.tick(i)

    # -- how actions leave and answers come back

    def apply(self, i: int, actions: list[Action]) -> None:
        core = self.cands[i].core
        for a in actions:
            if isinstance(a, Grant):
                self.requests.append(Request(i, core, "grant", self.clock))
            elif isinstance(a, Renew):
                self.requests.append(Request(i, core, "keepalive", self.clock, a.lease_id))
            elif isinstance(a, Campaign):
                self.requests.append(Request(i, core, "campaign", self.clock, a.lease_id))
            elif isinstance(a, Withdraw):
                self.requests.append(Request(i, core, "withdraw", self.clock, a.epoch))
            elif isinstance(a, Revoke):
                self.requests.append(Request(i, core, "revoke", self.clock, a.lease_id))
            elif isinstance(a, Lead):
                assert all(a.epoch > e for e in self.epochs), (a, self.epochs)
                self.epochs.append(a.epoch)

    def tick(self, i: int) -> None:
        c = self.cands[i]
        if not c.paused:
            self.apply(i, c.core.tick(self.clock))

    def process(self, r: Request) -> Answer:
        """The request reaches etcd now: its effect, and the answer it sends back."""
        etcd, c = self.etcd, self.cands[r.cand]
        etcd.expire(self.clock)
        if r.kind == "grant":
            lease_id = etcd.next_lease
            etcd.next_lease += 1
            etcd.leases[lease_id] = Lease(self.clock + TTL)
            return Answer(r, True, lease=lease_id, ttl=TTL)
        if r.kind == "keepalive":
            if r.arg not in etcd.leases:
                return Answer(r, True, lease=r.arg, ttl=0)
            etcd.leases[r.arg].expires_at = self.clock + TTL
            return Answer(r, True, lease=r.arg, ttl=TTL)
        if r.kind == "campaign":
            if r.arg not in etcd.leases:
                return Answer(r, False)  # etcd: "requested lease not found"
            if etcd.key is not None:
                return Answer(r, True, key=etcd.key, revision=etcd.revision)
            epoch = etcd.create(record(c.member, since=self.clock), r.arg)
            return Answer(r, True, won=True, key=etcd.key, revision=epoch)
        if r.kind == "withdraw":
            if etcd.key is not None and etcd.key.create_revision == r.arg:
                etcd.delete()
        elif r.kind == "revoke":
            etcd.revoke(r.arg)
        return Answer(r, True)

    def answer(self, a: Answer) -> None:
        r, c, now = a.request, self.cands[a.request.cand], self.clock
        core = c.core
        if r.core is not core:
            return  # sent by a process that restarted since: nobody waits for it
        if r.kind == "grant":
            out = (
                core.lease_granted(a.lease, a.ttl, r.sent_at, now)
                if a.ok
                else core.grant_failed(now, "lost")
            )
        elif r.kind == "keepalive":
            out = (
                core.keepalive_answered(r.arg, r.sent_at, a.ttl, now)
                if a.ok
                else core.keepalive_failed(r.arg, now, "lost")
            )
        elif r.kind == "campaign":
            if not a.ok or a.key is None:
                out = core.campaign_failed(now, "lost")
            elif a.won:
                out = core.campaign_won(r.arg, a.key.record, a.key.create_revision, now)
            else:
                k = a.key
                out = core.campaign_lost(k.record, k.create_revision, k.lease, a.revision, now)
        else:
            out = []
        self.apply(r.cand, out)

    def read_key(self, i: int) -> None:
        """The shell's watcher: reads the key, then watches from that revision."""
        c, etcd = self.cands[i], self.etcd
        etcd.expire(self.clock)
        c.watching = True
        c.events.clear()
        if etcd.key is None:
            out = c.core.leader_gone(etcd.revision, self.clock)
        else:
            k = etcd.key
            out = c.core.leader_seen(
                k.record, k.create_revision, k.lease, etcd.revision, self.clock
            )
        self.apply(i, out)

    def deliver_event(self, i: int) -> None:
        c = self.cands[i]
        kind, key, revision = c.events.popleft()
        if kind == "delete":
            out = c.core.leader_gone(revision, self.clock)
        else:
            assert key is not None
            out = c.core.leader_seen(
                key.record, key.create_revision, key.lease, revision, self.clock
            )
        self.apply(i, out)

    def move_clock(self, dt: float) -> None:
        self.clock += dt
        self.etcd.expire(self.clock)
        for i in range(len(self.cands)):
            self.tick(i)

    # -- rules

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99))
    def request_reaches_etcd(self, pick: int) -> None:
        r = self.requests.pop(pick % len(self.requests))
        self.cands[r.cand].answers.append(self.process(r))

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99), reached=st.booleans())
    def request_or_its_answer_lost(self, pick: int, reached: bool) -> None:
        r = self.requests.pop(pick % len(self.requests))
        if reached:
            self.process(r)
        self.cands[r.cand].answers.append(Answer(r, False))

    @rule(i=st.integers(0, 2))
    def answer_arrives(self, i: int) -> None:
        c = self.cands[i % len(self.cands)]
        if c.answers and not c.paused:
            self.answer(c.answers.popleft())

    @rule(i=st.integers(0, 2))
    def watch_event_arrives(self, i: int) -> None:
        c = self.cands[i % len(self.cands)]
        if c.events and not c.paused:
            self.deliver_event(i % len(self.cands))

    @rule(i=st.integers(0, 2))
    def watch_breaks(self, i: int) -> None:
        c = self.cands[i % len(self.cands)]
        if not c.paused:
            c.watching = False
            c.events.clear()
            self.apply(i % len(self.cands), c.core.store_failed(self.clock, "watch broke"))

    @rule(i=st.integers(0, 2))
    def key_read(self, i: int) -> None:
        if not self.cands[i % len(self.cands)].paused:
            self.read_key(i % len(self.cands))

    @rule(dt=st.floats(0.01, 0.6))
    def time_passes(self, dt: float) -> None:
        self.move_clock(dt)

    @rule(dt=st.floats(TTL, 4 * TTL))
    def long_time_passes(self, dt: float) -> None:
        self.move_clock(dt)

    @rule(i=st.integers(0, 2))
    def paused(self, i: int) -> None:
        self.cands[i % len(self.cands)].paused = True

    @rule(i=st.integers(0, 2))
    def resumed(self, i: int) -> None:
        i %= len(self.cands)
        self.cands[i].paused = False
        self.tick(i)

    @rule(i=st.integers(0, 2))
    def restarted(self, i: int) -> None:
        """A new process of the same control plane: what the old one had in flight is
        gone with it, not the requests already on their way to etcd."""
        i %= len(self.cands)
        c = self.cands[i]
        c.core, c.paused, c.watching = Leadership(c.member, TTL), False, False
        c.events.clear()
        c.answers.clear()
        self.tick(i)

    @precondition(lambda self: sum(not c.core.resigned for c in self.cands) >= 2)
    @rule(i=st.integers(0, 2))
    def resigned(self, i: int) -> None:
        i %= len(self.cands)
        if not self.cands[i].paused:
            self.apply(i, self.cands[i].core.resign(self.clock))

    @rule()
    def round_trip(self) -> None:
        """A healthy network for a moment: what is on its way arrives, in order."""
        self.deliver_all()

    @rule()
    def fault_free_interval(self) -> None:
        """Nothing lost, nothing paused, answers at once: within a TTL and a few
        round trips of small steps, one candidate leads."""
        for c in self.cands:
            c.paused = False
        start, step = self.clock, TTL / 20
        while True:
            self.deliver_all()
            if any(c.core.may_act(self.clock) for c in self.cands):
                return
            assert self.clock - start <= TTL + 3 * step, "no leader after a fault-free TTL"
            self.move_clock(step)

    def deliver_all(self) -> None:
        for _ in range(100):
            if self.requests:
                r = self.requests.pop(0)
                self.cands[r.cand].answers.append(self.process(r))
                continue
            busy = [i for i, c in enumerate(self.cands) if not c.paused and (c.answers or c.events)]
            if not busy:
                break
            c = self.cands[busy[0]]
            if c.answers:
                self.answer(c.answers.popleft())
            else:
                self.deliver_event(busy[0])
        for i, c in enumerate(self.cands):
            if not c.paused and (not c.watching or not c.core.leader_known):
                self.read_key(i)

    # -- invariants

    @invariant()
    def at_most_one_may_act(self) -> None:
        acting = [c.member.id for c in self.cands if c.core.may_act(self.clock)]
        assert len(acting) <= 1, acting

    @invariant()
    def one_that_may_act_holds_a_live_lease_and_the_key_of_its_epoch(self) -> None:
        self.etcd.expire(self.clock)
        for c in self.cands:
            if c.core.may_act(self.clock):
                assert c.core.lease is not None
                assert c.core.lease.id in self.etcd.leases
                assert self.etcd.key is not None
                assert self.etcd.key.create_revision == c.core.epoch
                assert self.etcd.key.lease == c.core.lease.id

    @invariant()
    def every_deadline_falls_before_etcd_ends_the_lease(self) -> None:
        for c in self.cands:
            lease = c.core.lease
            if lease is None:
                continue
            if lease.id in self.etcd.leases:
                assert lease.deadline <= self.etcd.leases[lease.id].expires_at
            else:
                assert lease.deadline <= self.clock

    @invariant()
    def one_grant_renewal_and_campaign_at_a_time(self) -> None:
        for c in self.cands:
            for kind in ("grant", "keepalive", "campaign"):
                on_the_way = [r for r in self.requests if r.core is c.core and r.kind == kind]
                answers = [
                    a for a in c.answers if a.request.core is c.core and a.request.kind == kind
                ]
                assert len(on_the_way) + len(answers) <= 1, (c.member.id, kind)


ElectionMachine.TestCase.settings = settings(
    max_examples=profile_times(3), stateful_step_count=60, deadline=None
)
TestElectionMachine = ElectionMachine.TestCase
