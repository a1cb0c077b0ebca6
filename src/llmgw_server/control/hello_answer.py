"""What a control plane among several answers an agent's hello before any TLS
(llmgw_core.agent_lane), decided from the election's standing alone.

An agent that lost its leader says so, with the newest epoch it has seen (`lost`). It is
sent only to a leader of a newer epoch: this control plane itself once it leads and its
term has begun (the agent dials it again with a named leader's patience), else the one
the store names. While there is none (the election is not over, or the store still names
the leader it lost, whose process is then checked, leader_gone), the first of them are
taken through their handshake here (their streams then held through the election), the
rest told to come back soon (the shell first holds such a hello for the election). A
leader takes the first of them through their handshake too: one at the leader needs no
second dial. `HANDSHAKES_PER_LOST_LEADER` of them in all, per lost epoch, and
`HANDSHAKES_PER_SOURCE` of those from one address. Any other agent is sent to the leader
a standby names, else served here.

Pure: the trio shell (control_shell/seat.py) reads the standing, asks `answer_hello`,
and carries out what the answer says (spends from the budget, checks the lost leader)
once, for the answer it gives; while a hello waits it may ask again as often as the
standing changes.
"""

from __future__ import annotations

from collections import Counter

import attrs

from llmgw_core.agent_lane import come_back_line, not_leader_line

# Of the agents that lost one leadership, how many a control plane takes through their
# handshake at once (during the election, their streams then held, StandbyAnswers; or
# after it, as their leader) before the rest wait without one and are sent to the leader:
# handshakes done during the election are done when it ends, and one at the leader needs
# no second dial (1,000 agents: all on the new leader 3.4-3.6 s after a SIGKILL, against
# 4.3-5.1 s with every hello sent on), but a whole fleet's (10,000) on one standby starved
# the machine, agents held by a standby that lost pay a second handshake, and a leader's
# queue of 10,000 outlasts a failing-over agent's patience (a named leader's is whole).
# About what a control plane's agents' lane has places for.
HANDSHAKES_PER_LOST_LEADER = 2048
# Of those, how many go to hellos from one source address (the port's source_key: an
# IPv6 /64): anonymous hellos that say they lost a leader, from one address, took the
# whole budget in about 3 s (test_lost_leader_flood), and every agent then took the slower
# path (its hello waits for the election without TLS, is sent to the winner, and dials it
# again for its handshake: about a second more at 1,000 agents). Now that takes 32
# addresses. Agents behind one address past these (a NAT) take that path too; as many
# as the port lets one address have pending at once (per_source_pending).
HANDSHAKES_PER_SOURCE = 64
# Lost epochs whose counts are kept: agents report the leadership they lost, the newest
# or one just before; any epoch may be claimed by an anonymous hello, so the memory is
# bounded here, and an epoch older than those kept has nothing left. (Hellos claiming
# this many newer epochs so leave a fleet's own nothing: its agents take the slower path,
# as they would with its budget spent; they still get their answer.)
LOST_EPOCHS_KEPT = 8
# When an agent that lost its leader comes back (agent_lane.come_back_line), plus its own
# jitter: while nobody leads (an election takes a transaction or two), and while the store
# still names the leader it lost (until that lease ends, at most this or a quarter lease).
ELECTION_COME_BACK_S = 0.2
NAMED_LOST_COME_BACK_S = 0.5

# The answers, as /metrics labels them (llmgw_control_agent_hellos_answered_total).
LEADER = "leader"  # sent to the leader another control plane is
THIS_LEADER = "this_leader"  # sent to this one, which leads
COME_BACK = "come_back"  # no newer leader known: come back soon
HANDSHAKE = "handshake"  # one of the first that lost a leadership: served here at once


@attrs.frozen
class HelloStanding:
    """The election as a hello's answer reads it. URLs are agents' (the control plane's
    URL and the agents' path)."""

    here: str  # this control plane's
    leading: bool  # this control plane is elected
    term_begun: bool  # and its term (its ControlPlane) has begun
    epoch: int  # the leadership's the store names (0: none known)
    leader: str | None  # the leader the store names, or None
    store_ok: bool  # the store answers now: what it names can be vouched for
    lease_ttl_s: float


@attrs.define
class HandshakeBudget:
    """Handshakes given to agents that lost a leadership, per lost epoch: at most
    `per_lost` each, `per_source` of them to one source address. Counts are kept for the
    `kept` newest lost epochs spent from; once that many are kept, an older epoch has
    nothing left (the oldest counts are dropped when a newer epoch is spent from), so
    that claiming epochs never frees a budget spent. Sources are counted only while they
    have spent, at most `per_lost` of them an epoch."""

    per_lost: int = HANDSHAKES_PER_LOST_LEADER
    per_source: int = HANDSHAKES_PER_SOURCE
    kept: int = LOST_EPOCHS_KEPT
    spent: dict[int, int] = attrs.field(factory=dict)
    by_source: dict[int, Counter[str]] = attrs.field(factory=dict)

    def left(self, lost: int, source: str) -> int:
        if lost not in self.spent and len(self.spent) >= self.kept and lost < min(self.spent):
            return 0  # dropped, or older than every epoch kept
        mine = self.by_source.get(lost, Counter[str]())[source]
        return min(self.per_lost - self.spent.get(lost, 0), self.per_source - mine)

    def spend(self, lost: int, source: str) -> None:
        assert self.left(lost, source) > 0, (lost, source)
        self.spent[lost] = self.spent.get(lost, 0) + 1
        self.by_source.setdefault(lost, Counter())[source] += 1
        if len(self.spent) > self.kept:
            oldest = min(self.spent)
            del self.spent[oldest], self.by_source[oldest]


@attrs.define
class LeaderChecks:
    """When the leader the store names was last checked for a process gone
    (leader_gone): at most once a `recheck_s` per leadership, since peers report a lost
    leader in bursts (a fleet at once)."""

    recheck_s: float
    epoch: int = 0
    at: float = float("-inf")

    def due(self, epoch: int, now: float) -> bool:
        return epoch != self.epoch or now - self.at >= self.recheck_s

    def checked(self, epoch: int, now: float) -> None:
        self.epoch, self.at = epoch, now


@attrs.frozen
class HelloAnswer:
    line: bytes | None  # written in place of the first TLS record; None: served here
    answer: str | None  # its label on /metrics (None: an agent that lost none, served)
    spend: int | None = None  # the lost epoch whose budget this handshake takes from
    check_leader: str | None = None  # the leader the agent lost, still named: check it


def answer_hello(
    lost: int | None,
    source: str,
    standing: HelloStanding,
    budget: HandshakeBudget,
    checks: LeaderChecks,
    now: float,
) -> HelloAnswer:
    """The answer to an agent's hello from `source` (its address, as the port counts
    sources) as things stand. `lost`: the newest epoch the agent has seen, when it lost
    its leader (None: it lost none)."""
    leader = standing.leader if standing.store_ok else None
    if lost is None:
        named = leader is not None and leader != standing.here and not standing.leading
        line = not_leader_line(leader) if named and leader is not None else None
        return HelloAnswer(line, None if line is None else LEADER)
    wait = ELECTION_COME_BACK_S
    check: str | None = None
    if leader is not None:
        if standing.epoch > lost:
            here = standing.leading and standing.term_begun
            if here and budget.left(lost, source) > 0:
                return HelloAnswer(None, HANDSHAKE, spend=lost)
            line = not_leader_line(standing.here if here else leader)
            if line is not None and (here or not standing.leading):
                return HelloAnswer(line, THIS_LEADER if here else LEADER)
        elif not standing.leading:
            if checks.due(standing.epoch, now):
                check = leader
            wait = min(NAMED_LOST_COME_BACK_S, standing.lease_ttl_s / 4)
    if budget.left(lost, source) > 0:
        # Its handshake now, while the election runs, and its stream held through it
        # (StandbyAnswers): served on that connection by this control plane's term if it
        # wins, the campaign's likely winner (it campaigns first).
        return HelloAnswer(None, HANDSHAKE, spend=lost, check_leader=check)
    return HelloAnswer(come_back_line(wait), COME_BACK, check_leader=check)
