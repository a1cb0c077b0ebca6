"""The election state of one control plane kept in a store (docs/high-availability.md).

Pure: it is told what the store answered and what time it is, and answers what to do
next. The trio shell (control_shell/election.py) sends the requests and feeds the
answers back; the property tests drive several of these against a model of etcd.

The rules:

- **A lease, renewed.** A control plane holds one etcd lease while it runs; its member
  record and, while it leads, the leader key live under it. It renews every quarter of
  the lease's TTL and retries a failed renewal soon after.
- **The fence.** A leader acts only while `now < deadline`, where the deadline is the
  time the last answered keepalive (or the grant) was *sent* plus the TTL it answered:
  etcd started counting no earlier than that, so the lease ends there at the soonest.
  The deadline never moves without an answer. `may_act` is the one check that every
  command and every table a leader publishes passes, and it reads the clock: a leader
  that wakes from a pause (SIGSTOP, a VM freeze) past its deadline is refused before
  anything else runs, and its next step steps it down.
- **The campaign.** With a lease, and the leader key read and absent, a control plane
  campaigns: a transaction that creates the key under its lease only while it does not
  exist. The key's create revision is the leadership's epoch; epochs only grow.
- **The catalog digest.** A standby whose catalog digest differs from the live
  leader's says so, once per change, and never leads while that leader lives; with no
  leader, anyone campaigns (the store decides).
"""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime

import attrs


@attrs.frozen
class Member:
    """A control plane, as it registers itself in the store."""

    id: str
    # Where agents and routers reach it: its advertised ws:// or wss:// control URL.
    url: str
    # The digest of its catalog: control planes whose digests differ never lead together.
    catalog_digest: str
    started_at: float  # wall time


@attrs.frozen
class LeaderRecord:
    """The value of the leader key: who leads, and since when (wall time)."""

    member: Member
    since: float


class Phase(enum.Enum):
    STANDBY = "standby"
    CAMPAIGNING = "campaigning"
    LEADING = "leading"
    # Lost (or gave up) its lease: waits for a new one before it campaigns again.
    STEPPED_DOWN = "stepped-down"


# What the shell does. Each names the lease or the epoch it is for, so that an answer
# for an older one is told apart.


@attrs.frozen
class Grant:
    """Ask for a new lease, and register the member record under it."""


@attrs.frozen
class Renew:
    lease_id: int


@attrs.frozen
class Campaign:
    """Create the leader key under this lease, only while it does not exist."""

    lease_id: int


@attrs.frozen
class Lead:
    epoch: int


@attrs.frozen
class StepDown:
    epoch: int
    why: str


@attrs.frozen
class Withdraw:
    """Delete the leader key only while its create revision is `epoch`."""

    epoch: int


@attrs.frozen
class Revoke:
    """Revoke a lease this control plane no longer uses (best effort)."""

    lease_id: int


@attrs.frozen
class Note:
    """One log line."""

    line: str


Action = Grant | Renew | Campaign | Lead | StepDown | Withdraw | Revoke | Note


@attrs.define
class LeaseHold:
    id: int
    ttl_s: float
    # The fence: the lease ends no sooner than this (monotonic time).
    deadline: float
    renew_at: float
    renewing: bool = False


def retry_after(ttl_s: float) -> float:
    """How soon a failed grant or renewal is tried again: several tries fit in a TTL."""
    return max(0.1, min(1.0, ttl_s / 8))


def wall(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Leadership:
    """One control plane's election state. Every input takes `now` (monotonic seconds)
    and returns the actions due; `next_wake` says when `tick` must run next."""

    def __init__(self, me: Member, ttl_s: float) -> None:
        self.me = me
        self.retry_s = retry_after(ttl_s)
        self.phase = Phase.STANDBY
        self.lease: LeaseHold | None = None
        self.epoch = 0  # ours while leading, else 0
        self.resigned = False
        self.granting = False
        self.campaigning = False  # a campaign's transaction is on its way
        self.grant_at = -math.inf  # no sooner than this (after a failed grant)
        # The leader key as last read: `leader_known` False until read (and again after
        # the store failed: the watch reads it afresh); `leader` None when absent.
        self.leader_known = False
        self.leader: LeaderRecord | None = None
        self.leader_epoch = 0
        self.seen_revision = 0  # the store revision of the newest read applied
        self.store_ok = True
        self.store_why = ""
        self.stepped_down_why = ""
        self._digest_noted: tuple[str, str] | None = None

    # -- queries

    def may_act(self, now: float) -> bool:
        """The fence: whether this control plane leads now."""
        return (
            self.phase is Phase.LEADING
            and not self.resigned
            and self.lease is not None
            and now < self.lease.deadline
        )

    def next_wake(self) -> float:
        """When `tick` must run next (math.inf: only an answer changes anything)."""
        times = []
        if self.lease is not None:
            times.append(self.lease.deadline)
            if not self.lease.renewing:
                times.append(self.lease.renew_at)
        elif not self.granting and not self.resigned:
            times.append(self.grant_at)
        return min(times, default=math.inf)

    def digest_differs(self) -> bool:
        return self.leader is not None and self.leader.member.catalog_digest != (
            self.me.catalog_digest
        )

    def why(self) -> str:
        """One line for status: whether and why this control plane leads or not."""
        store = "" if self.store_ok else f"the store is unreachable: {self.store_why}"
        if self.resigned:
            return "resigned: this control plane is stopping and does not campaign"
        if self.phase is Phase.LEADING:
            since = f" since {wall(self.leader.since)}" if self.leader else ""
            lead = f"leading{since} (epoch {self.epoch})"
            if store:
                return f"{lead}; {store}; it steps down when its lease ends"
            return lead
        if store:
            return store
        if self.phase is Phase.STEPPED_DOWN:
            return f"stepped down: {self.stepped_down_why}"
        if self.phase is Phase.CAMPAIGNING:
            return "campaigning"
        if not self.leader_known:
            return "standing by: reading the leader key"
        if self.leader is None:
            return "standing by: waiting for a lease" if self.lease is None else "campaigning"
        who = self.leader.member
        line = f"leader {who.id} at {who.url} since {wall(self.leader.since)}"
        if who.id == self.me.id:
            return line + ": this control plane's claim of a lease it let go, until that ends"
        if self.digest_differs():
            line += (
                f"; this control plane's catalog digest {self.me.catalog_digest} differs"
                f" from the leader's {who.catalog_digest}: it does not lead while"
                f" {who.id} does"
            )
        return line

    # -- inputs

    def tick(self, now: float) -> list[Action]:
        """What the time alone makes due: the fence, a renewal, a grant, a campaign."""
        out: list[Action] = []
        lease = self.lease
        if lease is not None and now >= lease.deadline:
            why = f"lease {lease.id:x} ended: no keepalive answered in its {lease.ttl_s:g} s TTL"
            self._lose_lease(why, out)
        if self.lease is None:
            if not self.granting and not self.resigned and now >= self.grant_at:
                self.granting = True
                out.append(Grant())
        else:
            lease = self.lease
            if not lease.renewing and now >= lease.renew_at:
                lease.renewing = True
                out.append(Renew(lease.id))
            if (
                self.phase is Phase.STANDBY
                and not self.campaigning
                and self.leader_known
                and self.leader is None
                and not self.resigned
            ):
                self.phase = Phase.CAMPAIGNING
                self.campaigning = True
                out.append(Campaign(lease.id))
        return out

    def lease_granted(
        self, lease_id: int, ttl_s: float, sent_at: float, now: float
    ) -> list[Action]:
        """A lease granted (and the member record put under it); `sent_at` is when the
        grant was sent, and `ttl_s` the TTL etcd granted (it may raise the asked one)."""
        self.granting = False
        self._store_answered()
        if self.resigned or self.lease is not None:
            return [Revoke(lease_id), *self.tick(now)]
        self.lease = LeaseHold(
            lease_id, ttl_s, deadline=sent_at + ttl_s, renew_at=sent_at + ttl_s / 4
        )
        self.retry_s = retry_after(ttl_s)
        if self.phase is Phase.STEPPED_DOWN:
            self.phase = Phase.STANDBY
        return self.tick(now)

    def grant_failed(self, now: float, why: str) -> list[Action]:
        self.granting = False
        self.campaigning = False  # a campaign's transaction is on its way
        self.grant_at = now + self.retry_s
        return self.store_failed(now, why)

    def keepalive_answered(
        self, lease_id: int, sent_at: float, ttl_left: float, now: float
    ) -> list[Action]:
        """A keepalive sent at `sent_at` answered: `ttl_left` 0 says the lease is gone."""
        lease = self.lease
        if lease is None or lease.id != lease_id:
            return self.tick(now)
        self._store_answered()
        lease.renewing = False
        out: list[Action] = []
        if ttl_left <= 0:
            self._lose_lease(f"lease {lease_id:x} ended: etcd no longer holds it", out)
            return out + self.tick(now)
        lease.deadline = max(lease.deadline, sent_at + ttl_left)
        lease.renew_at = sent_at + lease.ttl_s / 4
        return out + self.tick(now)

    def keepalive_failed(self, lease_id: int, now: float, why: str) -> list[Action]:
        lease = self.lease
        if lease is not None and lease.id == lease_id:
            lease.renewing = False
            lease.renew_at = now + self.retry_s
        return self.store_failed(now, why)

    def campaign_won(
        self, lease_id: int, record: LeaderRecord, epoch: int, now: float
    ) -> list[Action]:
        """The key created by our campaign's transaction, at revision `epoch`."""
        self.campaigning = False
        return self.leader_seen(record, epoch, lease_id, epoch, now)

    def campaign_lost(
        self, record: LeaderRecord, epoch: int, lease_id: int, revision: int, now: float
    ) -> list[Action]:
        """The campaign found the key held: by `record`, as `leader_seen` says."""
        self.campaigning = False
        return self.leader_seen(record, epoch, lease_id, revision, now)

    def campaign_failed(self, now: float, why: str) -> list[Action]:
        """The campaign's transaction failed or had no answer (it may have succeeded:
        the key's next read, with its lease, tells)."""
        self.campaigning = False
        if self.phase is Phase.CAMPAIGNING:
            self.phase = Phase.STANDBY
        return self.store_failed(now, why)

    def leader_seen(
        self, record: LeaderRecord, epoch: int, lease_id: int, revision: int, now: float
    ) -> list[Action]:
        """The leader key holds `record` under `lease_id`, created at revision `epoch`:
        read, watched, or answered to a lost campaign, at store revision `revision`."""
        if revision < self.seen_revision or epoch < self.leader_epoch:
            return self.tick(now)  # older than what was applied
        self._store_answered()
        self.seen_revision = revision
        out: list[Action] = []
        ours = self.lease is not None and lease_id == self.lease.id
        if self.phase is Phase.LEADING and epoch != self.epoch:
            self._step_down(f"the leader key was taken over by {record.member.id}", out)
        if ours and self.phase is not Phase.LEADING:
            # Our campaign won (its answer may have been lost on the way back).
            if self.resigned or not self.may_act_with_lease(now):
                out.append(Withdraw(epoch))
            else:
                self.phase = Phase.LEADING
                self.epoch = epoch
                out.append(Lead(epoch))
        elif not ours and self.phase is Phase.CAMPAIGNING:
            self.phase = Phase.STANDBY
        self.leader_known = True
        self.leader = record
        self.leader_epoch = epoch
        noted = (record.member.id, record.member.catalog_digest)
        if ours or not self.digest_differs():
            self._digest_noted = None
        elif self._digest_noted != noted:
            self._digest_noted = noted
            out.append(
                Note(
                    f"catalog digest {self.me.catalog_digest} differs from the leader"
                    f" {record.member.id}'s {record.member.catalog_digest}: this control"
                    " plane does not lead while it does (make their catalogs the same)"
                )
            )
        return out + self.tick(now)

    def leader_gone(self, revision: int, now: float) -> list[Action]:
        """The leader key is absent (read), or was deleted (watched), at `revision`."""
        if revision < self.seen_revision:
            return self.tick(now)
        self._store_answered()
        self.seen_revision = revision
        out: list[Action] = []
        if self.phase is Phase.LEADING:
            self._step_down("the leader key was deleted", out)
        self.leader_known = True
        self.leader = None
        self._digest_noted = None
        return out + self.tick(now)

    def store_failed(self, now: float, why: str) -> list[Action]:
        """A request failed or had no answer. A leader keeps leading until its deadline."""
        self.store_ok = False
        self.store_why = why
        self.leader_known = False  # the watch reads the key afresh
        return self.tick(now)

    def fence_failed(self, epoch: int, now: float) -> list[Action]:
        """A write guarded by `epoch` found the leader key no longer of that epoch."""
        out: list[Action] = []
        if self.phase is Phase.LEADING and self.epoch == epoch:
            self._step_down(f"the leader key is no longer of epoch {epoch}", out)
        return out + self.tick(now)

    def resign(self, now: float) -> list[Action]:
        """Stop leading at once and for good (SIGTERM): may_act is False from here on."""
        self.resigned = True
        out: list[Action] = []
        if self.phase is Phase.LEADING:
            out.append(Withdraw(self.epoch))
            self._step_down("resigned", out)
        self.phase = Phase.STEPPED_DOWN
        self.stepped_down_why = "resigned"
        if self.lease is not None:
            out.append(Revoke(self.lease.id))
            self.lease = None
        return out

    # -- helpers

    def may_act_with_lease(self, now: float) -> bool:
        return self.lease is not None and now < self.lease.deadline

    def _store_answered(self) -> None:
        self.store_ok = True
        self.store_why = ""

    def _step_down(self, why: str, out: list[Action]) -> None:
        out.append(StepDown(self.epoch, why))
        self.phase = Phase.STANDBY
        self.epoch = 0
        self.stepped_down_why = why

    def _lose_lease(self, why: str, out: list[Action]) -> None:
        assert self.lease is not None
        if self.phase is Phase.LEADING:
            self._step_down(why, out)
        out.append(Revoke(self.lease.id))
        self.lease = None
        self.phase = Phase.STEPPED_DOWN
        self.stepped_down_why = why
