"""Which control plane an agent dials next, and which epochs it takes commands from.

Pure: the connect loop (`llmgw_agent.agent`) says how each session ended, and
`ControlPlanes.after` says which of the configured control planes comes next and how
long to wait first. A fleet kept in a store has several control planes, one leading:
a standby closes the agent's stream with NOT_LEADER_CLOSE, naming the leader (dialled
next, at once) or none (an election: the next one in the list, after a short jitter).
When the leader's stream ends, the list is tried from the next one on with that same
jitter. Such short waits last a failover window (FAILOVER_WINDOW_S) from the first sign
of a failover; past it, the backoff decides, as for a control plane that is gone. A
session that was healthy for a while (`next_attempt` resets the backoff) closes the
window, so that a later loss of the leader gets a new one, while a leader that keeps
admitting agents and failing them soon after does not have them dial in lockstep
forever. An agent with one control plane keeps its old behaviour (the restart window,
the backoff), but for a standby's NOT_LEADER.

Only a leader named among the configured URLs is followed: a hostile or misconfigured
standby must not send an agent, with its client certificate, anywhere else.
"""

from __future__ import annotations

import enum
import random
from urllib.parse import urlsplit

import attrs

from llmgw_core.logsafe import escaped

# How long, from the first sign of a failover (a standby's NOT_LEADER, a stale welcome,
# the leader's stream ending), the agent tries the control planes with the short jitters
# below rather than its backoff: an election takes a lease's length (10 s by default) and
# a restarted control plane a few seconds.
FAILOVER_WINDOW_S = 30.0
# A dial's patience during a failover (TCP, TLS, the websocket's handshake): a frozen
# control plane's kernel still accepts, and nothing answers after. Every control plane
# that runs answers a failing-over agent's hello at once, before any TLS (agent_lane), so
# this bounds only a frozen one, and a fleet whose own CPU is starved: at 5 s, 10,000
# simulated agents on a busy machine gave up on live control planes before their own
# loops had read the answer, and dialled again, for 50 s.
FAILOVER_DIAL_S = 15.0
# A leader named by a standby is dialled after up to this: it takes over a whole fleet
# at once, which its control port's admission paces.
LEADER_JITTER_S = 0.05
# Between the control planes of the list during a failover: the fleet's dials spread
# over 0.4 s, and a standby is not asked again before an election had time to end.
ELECTION_JITTER_S = (0.1, 0.5)


def lost_after(
    url: str, ended: Ended, welcomed: bool, lost: str | None, *, busy: bool
) -> str | None:
    """The control plane to name as lost (LOST_LEADER_HEADER) after a session with `url`
    ended so: the one dialled when it ended the agent's stream or could not be reached;
    unchanged after a standby's NOT_LEADER, a stale welcome, or a busy leader's "come
    back later" (it lives)."""
    if busy or ended in (Ended.NOT_LEADER, Ended.STALE):
        return lost
    if ended is Ended.FAILED or welcomed:
        return url
    return lost


def stale(epoch: int, highest: int) -> bool:
    """Whether a welcome or a command of `epoch` comes from a leadership older than the
    highest this agent has seen. Epoch 0 is a control plane without a store, never fenced
    (it has no epochs; a leader that lost its lease always has one above 0)."""
    return 0 < epoch < highest


class Ended(enum.Enum):
    """How a session ended, as far as the choice of the next control plane goes."""

    NOT_LEADER = "not leader"  # closed with NOT_LEADER_CLOSE by a standby
    STALE = "stale"  # its welcome's epoch was stale: closed by the agent
    LEADER_LOST = "leader lost"  # registered, then ended (broken, cut, closed, stopping)
    FAILED = "failed"  # never registered: refused, unreachable, a bad frame


@attrs.frozen
class Redial:
    """The next dial (of `ControlPlanes.current`): the wait before it (None: the
    backoff's), and why the agent moves, for the log ("": a failed dial, said already)."""

    delay_s: float | None
    why: str


@attrs.define
class ControlPlanes:
    """The configured control planes, the one dialled now, and the failover's state."""

    urls: tuple[str, ...]
    index: int = 0
    # The failover's window ends then; kept once past (spent) until a healthy session,
    # so that a failover lasts one window. None: no failover since the last healthy one.
    failover_until: float | None = None
    hops: int = 0  # named leaders dialled at once in a row, without a welcome between
    # The newest leadership that welcomed this agent: a welcome of a newer one ends a
    # failover's window (its leader was elected: the next failover is another).
    window_epoch: int = 0
    named: bool = False  # the control plane dialled now was named the leader by a standby

    @property
    def current(self) -> str:
        return self.urls[self.index]

    def dial_patience_s(self, now: float, patience_s: float) -> float:
        """How long a dial may take: `patience_s` (a busy control plane may queue an agent
        that long), but during a failover among several, while going down the list, at
        most FAILOVER_DIAL_S: the next one may be the one that froze (a paused process,
        a lost host whose kernel still accepts), and the one after it a better bet. A
        leader a control plane named gets the whole patience: it is the one the store
        names, of a newer epoch than this agent says it saw (agent_lane.lost_leader_alpn),
        and a new leader that a whole fleet dials at once queues it: at 10,000
        agents the queue outlasted 5 s, and agents that gave up dialled again, at its
        back, for a minute."""
        failing_over = self.failover_until is not None and now < self.failover_until
        if len(self.urls) > 1 and failing_over and not self.named:
            return min(patience_s, FAILOVER_DIAL_S)
        return patience_s

    def configured(self, url: str) -> int | None:
        """The index of the configured control plane `url` names (the same scheme, host,
        port and path), None when it is none of them."""
        key = _url_key(url)
        if key is None:
            return None
        return next((i for i, own in enumerate(self.urls) if _url_key(own) == key), None)

    def after(
        self,
        ended: Ended,
        *,
        now: float,
        rng: random.Random,
        healthy: bool = False,
        welcomed: bool = False,
        epoch: int = 0,
        leader: str | None = None,
        reason: str = "",
        come_back_s: float | None = None,
    ) -> Redial | None:
        """Move to the control plane to dial next after a session that ended so, and say
        how long to wait. None: this agent has one control plane and the session was no
        standby's answer nor a stale welcome: the caller's restart window and backoff
        decide, as before.

        `healthy`: the session answered for a while (the backoff starts over); `welcomed`:
        it registered, with a leadership of `epoch`; `leader` and `reason`: what a
        NOT_LEADER close said; `come_back_s`: the turn a busy control port gave.

        A failover's window ends with a healthy session, or with a welcome from a newer
        leadership than the one whose loss opened it: a failover that follows soon after
        the last one gets a window of its own (rather than the backoff of a spent one)."""
        if healthy or (welcomed and epoch > self.window_epoch):
            self.failover_until = None
        if welcomed:
            self.window_epoch = max(self.window_epoch, epoch)
        if welcomed:
            self.hops = 0
        was = self.current
        if ended is Ended.NOT_LEADER:
            self._failover(now)
            if leader is None:
                self._advance()
                why = f"{was} does not lead ({escaped(reason or 'no reason given')})"
                return self._short(why, now, rng)
            index = self.configured(leader)
            if index is None:
                self._advance()
                why = (
                    f"{was} names {escaped(leader)} as the leader, which is not one of this "
                    "agent's control planes (`server`): not followed"
                )
                return self._short(why, now, rng)
            self.index = index
            self.named = True
            if self.hops >= len(self.urls):
                # Standbys that name each other (a stale view of who leads): not at once.
                return self._short(f"{was} names {self.current} as the leader again", now, rng)
            self.hops += 1
            return Redial(rng.uniform(0, LEADER_JITTER_S), f"{was} does not lead: the leader is")
        if ended is Ended.STALE:
            self._failover(now)
            self._advance()
            return self._short(f"{was} leads no more (a stale epoch)", now, rng)
        if len(self.urls) == 1:
            return None
        if ended is Ended.LEADER_LOST:
            self._failover(now)
            self._advance()
            return self._short(f"the stream with {was} ended", now, rng)
        if come_back_s is not None:
            # A busy control port's turn is kept, at the same control plane (most likely
            # the new leader, which the whole fleet dials).
            if self._in_window(now):
                delay = max(come_back_s, 0.0) + rng.uniform(*ELECTION_JITTER_S)
                return Redial(delay, f"{was} is busy")
            return Redial(None, f"{was} is busy")
        if self.named:
            # The leader a standby named did not answer in time: it lives (the store names
            # it) but cannot serve everyone at once. The backoff spreads the fleet's next
            # dials; the short jitter had 10,000 agents cut at the handshake (their own CPU
            # starved) dial again twice a second for a whole window, and none registered
            # for 50 s.
            self._advance()
            return Redial(None, f"{was}, named the leader, did not answer in time")
        self._advance()
        return self._short("", now, rng)

    def _failover(self, now: float) -> None:
        if self.failover_until is None:
            self.failover_until = now + FAILOVER_WINDOW_S

    def _in_window(self, now: float) -> bool:
        return self.failover_until is not None and now < self.failover_until

    def _advance(self) -> None:
        self.index = (self.index + 1) % len(self.urls)
        self.named = False

    def _short(self, why: str, now: float, rng: random.Random) -> Redial:
        """The next control plane after the election's jitter, while the window lasts."""
        if not self._in_window(now):
            return Redial(None, why)
        return Redial(rng.uniform(*ELECTION_JITTER_S), why)


def _url_key(url: str) -> tuple[str, str, int | None, str, str] | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return (parts.scheme.lower(), parts.hostname, port, parts.path.rstrip("/"), parts.query)
