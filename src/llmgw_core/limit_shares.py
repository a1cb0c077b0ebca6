"""Shares of a tenant's limits, handed out by a hub to the processes that enforce them.

A tenant's requests and tokens per minute and its requests in flight must hold across
every router process together, yet a request must never wait for a network round trip.
So each process (a follower) enforces locally a share of each limit, and a hub (the
control plane for its routers, a router's parent for its workers) keeps a `ShareBook`:
it hands out the shares and moves them to where the demand is, over a feed that
already connects them. Pure: no I/O, the caller passes the time.

The safety invariant, for every limit at every moment: the sum over followers (joined,
and left within `hold_s`) of what each may be using, given the messages in flight, is
at most the total. A follower's `committed` amount is the most of: its last reported
use; the share it reported having while it has applied no grant of this connection
(after a hub restart: the previous hub's grant); the share at the grant it last
acknowledged and at every grant sent since. A share is lowered at once (the old one
stays counted until acknowledged) and raised only out of the free amount (total less
the committed sum). One exception: a use reported above the share (an after-the-fact
settlement charged more tokens than reserved) is counted even past the total; nothing
is raised for that limit until the sum is back under.

Every amount counted is on a grid of 2**-16 (shares rounded down, uses rounded up), so
the sums are exact and the invariant holds to the last bit, not within a rounding error.

Allocation, per limit, among the joined followers: each gets a floor (1% of the total,
less where there are more than five followers: the floors together are at most 5%), so
that a first request at an idle process does not wait for the hub; the rest goes by
max-min fairness on `wanted` (water-filling: whoever wants less than an equal part gets
what it wants, the others share what is left equally). When everyone's wants fit, the
spare is spread equally. The water level is recomputed lazily (once a quarter of a
limit's busy followers changed what they want, or the follower count changed); between
recomputes the targets are scaled to sum to the total.

What a follower must do (the book's arithmetic relies on it):
- on every connection, report first; `applied` is -1 until it applies a grant received
  on this connection (a version from an earlier connection or hub means nothing here);
- apply grants in order: a `full` grant replaces every share (a limit it does not name:
  0), any other changes only the limits it names; report soon after applying one;
- its `have` is the map in effect, its `used` its use now (window use, or in flight);
- cut off from its hub (from losing the connection until it applies a grant on a new
  one), stop admitting on its shares soon enough that its window use is gone by
  `hold_s` after it left: for a 60 s window and the default 120 s, after 60 s. It drops
  them on a new connection: connected (its report unanswered), it closes that one first,
  since the book would take a report sent before for what it holds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping

import attrs

FLOOR = 0.01  # an idle follower's floor: 1% of the total ...
FLOORS = 0.05  # ... and all the floors together at most 5% (more than 5 followers: less each)
MAX_UNACKED = 4  # grants sent on a connection and not yet acknowledged; then nothing more
_GRID = 65536.0  # amounts are multiples of 1/_GRID: sums up to 2**36 are exact in a float


def _down(x: float) -> float:
    return math.floor(x * _GRID) / _GRID


def _up(x: float) -> float:
    return math.ceil(x * _GRID) / _GRID


def _amount(x: float) -> float:
    """A follower's figure on the grid, rounded up; anything but a finite positive is 0."""
    return _up(x) if x > 0 and math.isfinite(x) else 0.0


@attrs.frozen
class Grant:
    """What to send a follower. `full`: `shares` is its whole map (a limit not named: 0),
    the first grant of each connection; otherwise only the limits named change."""

    version: int  # increasing per follower; the follower reports it back as `applied`
    shares: dict[str, float]
    full: bool = False

    def then(self, later: Grant) -> Grant:
        """This grant and a later one as one message: what a follower that applied both
        holds. For a sender still holding this one unsent when the later comes: sending
        the later alone would lose this one's changes, which the book takes as applied
        once the later is acknowledged (a lowering lost: more held than counted)."""
        if later.full:
            return later
        shares = {**self.shares, **later.shares}
        if self.full:
            shares = {name: share for name, share in shares.items() if share > 0}
        return Grant(later.version, shares, self.full)


@attrs.define(eq=False)
class _Limit:
    total: float  # on the grid, rounded down; 0 while retiring
    named: bool  # in the totals; otherwise retiring until every follower is back to 0
    committed: float = 0.0  # sum of the holds' `committed`
    holds: dict[Hashable, _Hold] = attrs.Factory(dict)  # by follower
    # The water-filling: joined followers' holds that want something, the floor and the
    # level they were last computed for, and the sum of min(wanted, level) - floor.
    active: set[_Hold] = attrs.Factory(set)
    floor: float = 0.0
    level: float = 0.0
    excess: float = 0.0
    computed_for: int = -1  # joined followers at the last computation; -1: compute again
    changes: int = 0  # wants changed since
    stamp: int = 0  # counts changes to anything a grant's arithmetic reads


@attrs.define(eq=False, slots=True)
class _Hold:
    """One follower's part of one limit."""

    limit: _Limit
    used: float = 0.0
    wanted: float = 0.0
    have: float = 0.0  # as reported: counted until the connection's full grant is applied
    base: float = 0.0  # the share at the grant it last acknowledged
    later: list[tuple[int, float]] | None = None  # (version, share) granted since
    committed: float = 0.0
    excess: float = 0.0  # its part of limit.excess
    seen: int = -1  # the limit's stamp when a grant last found nothing to send for it

    @property
    def share(self) -> float:
        return self.later[-1][1] if self.later else self.base


@attrs.define(eq=False)
class _Follower:
    name: Hashable
    holds: dict[str, _Hold] = attrs.Factory(dict)
    joined: bool = True
    left_at: float = 0.0
    reported: bool = False  # on this connection
    applied: int = -1  # the last grant it applied, on this connection
    version: int = -1  # the last grant sent
    first: int = 0  # this connection's first version
    full_at: int | None = None  # this connection's full grant
    looked: tuple[int, bool] | None = None  # (joined followers, raising allowed) at a grant

    @property
    def known(self) -> bool:
        """Its whole map is this book's doing: it applied this connection's full grant."""
        return self.full_at is not None and self.applied >= self.full_at


class ShareBook:
    """The hub's shares of every limit among its followers (see the module's docstring).

    The hub calls `report` with each report, then `grant`, and `grant` on a timer too;
    `join` and `left` when a follower's connection opens and closes (never a report of
    a closed connection after `left`: the book ignores a follower that is not joined).

    `quiet_until`: a hub that may have had a predecessor (a restart, a new leader) passes
    its start plus `hold_s`: followers of the old hub that have not reported to this one
    yet may hold shares it cannot see, so it raises nothing before then (it lowers, and
    it grants each reconnected follower what it reported having). A hub that knows every
    follower of its predecessor has reported may set `quiet_until` sooner. Outside that
    time a follower new to the book holds nothing: brand new, or cut off for longer than
    `hold_s` (its shares stopped; see the module's docstring).
    """

    def __init__(self, *, hold_s: float = 120.0, quiet_until: float = -math.inf) -> None:
        self.hold_s = hold_s
        self.quiet_until = quiet_until
        self._limits: dict[str, _Limit] = {}
        self._followers: dict[Hashable, _Follower] = {}
        self._joined = 0
        self._expiry: deque[tuple[float, Hashable, float]] = deque()  # (when, name, left_at)

    # -- the totals --------------------------------------------------------------

    def set_totals(self, totals: Mapping[str, float]) -> None:
        """Limit id -> the whole limit (finite, at least 0). Limits not named are
        forgotten: their shares are lowered to 0, and they go once every follower
        acknowledged it (until then a limit named again finds them counted)."""
        for name, total in totals.items():
            if not math.isfinite(total):
                raise ValueError(f"limit {name!r}: total {total!r} is not a finite number")
            t = _down(max(0.0, total))
            lim = self._limits.get(name)
            if lim is None:
                lim = self._limits[name] = _Limit(t, True)
                for f in self._followers.values():
                    if f.joined:
                        f.holds[name] = lim.holds[f.name] = _Hold(lim)
                continue
            if not lim.named:
                lim.named = True
                for f in self._followers.values():
                    if f.joined and name not in f.holds:
                        f.holds[name] = lim.holds[f.name] = _Hold(lim)
            if lim.total != t:
                lim.total = t
                lim.computed_for = -1
                lim.stamp += 1
        for name, lim in list(self._limits.items()):
            if lim.named and name not in totals:
                lim.named = False
                lim.total = 0.0
                lim.computed_for = -1
                lim.stamp += 1
                if not lim.holds:
                    del self._limits[name]

    # -- followers come and go ---------------------------------------------------

    def join(self, follower: Hashable, now: float) -> None:
        """Its connection opened. A follower that left within `hold_s` keeps its place:
        what it may hold stays counted, and its first grant is a full one."""
        self._expire(now)
        f = self._followers.get(follower)
        if f is not None and f.joined:  # a second connection: the first one is over
            self.left(follower, now)
        if f is None:
            f = self._followers[follower] = _Follower(follower)
        f.joined = True
        f.reported = False
        f.applied = -1
        f.first = f.version + 1
        f.full_at = None
        self._joined += 1
        for name, lim in self._limits.items():
            if lim.named and name not in f.holds:
                f.holds[name] = lim.holds[follower] = _Hold(lim)
        for h in f.holds.values():
            if h.wanted > 0:
                self._want(h, h.wanted, active=True)
            self._count(h, known=False)  # its `have` counts again, until it applies one

    def left(self, follower: Hashable, now: float) -> None:
        """Its connection closed. What it may hold stays counted for `hold_s` (it may be
        serving on its last shares, cut off from the hub); then it is forgotten."""
        self._expire(now)
        f = self._followers.get(follower)
        if f is None or not f.joined:
            return
        f.joined = False
        f.left_at = now
        self._joined -= 1
        for h in f.holds.values():
            if h in h.limit.active:
                self._want(h, h.wanted, active=False)  # kept for its return
        self._expiry.append((now + self.hold_s, follower, now))

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, name, left_at = self._expiry.popleft()
            f = self._followers.get(name)
            if f is None or f.joined or f.left_at != left_at:
                continue  # back since, or gone already
            del self._followers[name]
            for limit_name, h in f.holds.items():
                lim = h.limit
                lim.committed -= h.committed
                lim.stamp += 1
                del lim.holds[name]
                if not lim.named and not lim.holds:
                    del self._limits[limit_name]

    # -- reports and grants ------------------------------------------------------

    def report(
        self,
        follower: Hashable,
        applied: int,
        have: Mapping[str, float],
        used: Mapping[str, float],
        wanted: Mapping[str, float],
        now: float,
    ) -> None:
        """A follower's report. `applied`: the last grant of this connection it applied
        (-1: none); `have`: the shares in effect; `used`: its use now; `wanted`: the use it
        would have had without its share (used plus what it refused or queued lately).
        A limit absent from a map: 0. O(the follower's limits)."""
        self._expire(now)
        f = self._followers.get(follower)
        if f is None or not f.joined:
            return
        f.reported = True
        was_known = f.known
        if f.first <= applied <= f.version and applied > f.applied:
            f.applied = applied  # anything else is an earlier connection's or hub's
        for figures in (have, used, wanted):
            for name, x in figures.items():
                if name not in f.holds and _amount(x) > 0:
                    lim = self._limits.get(name)
                    if lim is None:  # not ours: counted (and lowered to 0) until it is 0
                        lim = self._limits[name] = _Limit(0.0, False)
                    f.holds[name] = lim.holds[follower] = _Hold(lim)
        known = f.known
        recount = known != was_known  # its `have` stops counting (all at once)
        applied = f.applied
        gone = []
        for name, h in f.holds.items():
            # The common case first and cheaply: nothing new for this limit.
            u = used.get(name, 0.0)
            u = _amount(u) if u else 0.0
            hv = have.get(name, 0.0)
            hv = _amount(hv) if hv else 0.0
            w = wanted.get(name, 0.0)
            w = _amount(w) if w else 0.0
            later = h.later
            if (
                not recount
                and u == h.used
                and hv == h.have
                and w == h.wanted
                and (later is None or later[0][0] > applied)
            ):
                continue
            if later is not None:
                while later and later[0][0] <= applied:
                    h.base = later.pop(0)[1]
                if not later:
                    h.later = None
            h.used = u
            h.have = hv
            if w != h.wanted:
                self._want(h, w, active=True)
            self._count(h, known)
            h.seen = -1
            if not h.limit.named and h.committed == 0 and h.wanted == 0:
                gone.append(name)
        for name in gone:
            lim = f.holds.pop(name).limit
            del lim.holds[follower]
            if not lim.holds:
                del self._limits[name]

    def grant(self, follower: Hashable, now: float) -> Grant | None:
        """What to send the follower now, or None: its shares would not change, or not by
        enough to be worth a message (half a floor: 0.5% of the total, less with more than
        five followers; a change to or from 0 always is), or it has not reported on this
        connection yet, or MAX_UNACKED grants are unacknowledged. O(its limits)."""
        self._expire(now)
        f = self._followers.get(follower)
        if f is None or not f.joined or not f.reported:
            return None
        if f.version - max(f.applied, f.first - 1) >= MAX_UNACKED:
            return None
        full = f.full_at is None
        version = f.version + 1
        may_raise = now >= self.quiet_until
        # A limit whose state (and the follower's part of it) is as at the last look, when
        # it called for no message, calls for none now: skipped.
        anew = full or f.looked != (self._joined, may_raise)
        changed: dict[str, float] = {}
        for name, h in f.holds.items():
            lim = h.limit
            if h.seen == lim.stamp and not anew:
                continue
            had = h.share  # after every grant sent so far
            # What it will hold if nothing is sent: a full grant replaces what it reported
            # having on this connection (a grant of the one before may have been lost).
            held = h.have if full else had
            target = self._target(lim, h) if lim.named and lim.total > 0 else 0.0
            if target < held:
                share = _down(target)  # lowering: always (counted as before until acknowledged)
            elif target > held and may_raise and lim.committed <= lim.total:
                # Out of the free amount only: max(committed, share) may grow by at most
                # total - sum (every term on the grid: exact).
                share = max(held, _down(min(target, h.committed + (lim.total - lim.committed))))
            else:
                share = held
            if full and share > 0:
                changed[name] = share  # every share, changed or not (absent: 0)
            elif share == had or not (
                full or share == 0 or had == 0 or abs(share - had) >= lim.floor * 0.5
            ):
                # Nothing to send for it, or too small a change to be worth a message: looked
                # at again once something changes.
                h.seen = lim.stamp
                continue
            elif not full:
                changed[name] = share
            if share == had:
                continue
            if h.later is None:
                h.later = []
            h.later.append((version, share))
            if share > h.committed:
                lim.committed += share - h.committed
                h.committed = share
            lim.stamp += 1
        f.looked = (self._joined, may_raise)
        if not changed and not full:
            return None
        f.version = version
        if full:
            f.full_at = version
        return Grant(version, changed, full)

    # -- for tests, metrics and status ----------------------------------------------

    def committed(self, limit: str) -> float:
        """The sum over followers of what each may be using (see the module's docstring)."""
        lim = self._limits.get(limit)
        return 0.0 if lim is None else lim.committed

    def shares_of(self, follower: Hashable) -> dict[str, float]:
        """Its shares as last granted (acknowledged or not); a limit at 0 left out."""
        f = self._followers.get(follower)
        if f is None:
            return {}
        return {name: h.share for name, h in f.holds.items() if h.share > 0}

    # -- the arithmetic ------------------------------------------------------------

    def _count(self, h: _Hold, known: bool) -> None:
        c = max(h.used, h.base)
        if h.later:
            c = max(c, max(share for _, share in h.later))
        if not known:
            c = max(c, h.have)
        if c != h.committed:
            h.limit.committed += c - h.committed
            h.committed = c
            h.limit.stamp += 1

    def _want(self, h: _Hold, wanted: float, *, active: bool) -> None:
        """A follower's want of a limit changed, or it joined or left (`active`: joined):
        its part of the water-filling."""
        lim = h.limit
        h.wanted = wanted
        if wanted > 0 and active:
            lim.active.add(h)
            excess = max(0.0, min(wanted, lim.level) - lim.floor)
        else:
            lim.active.discard(h)
            excess = 0.0
        lim.excess += excess - h.excess
        h.excess = excess
        lim.changes += 1
        lim.stamp += 1

    def _target(self, lim: _Limit, h: _Hold) -> float:
        """Its share of the limit by the allocation rule, all followers' wants as reported."""
        n = self._joined
        if lim.computed_for != n or lim.changes > len(lim.active) // 4:
            self._fill(lim)
        weight = lim.floor + h.excess
        weights = n * lim.floor + lim.excess
        if weights > lim.total:  # the level is stale: scaled to the total
            return weight * lim.total / weights
        return weight + (lim.total - weights) / n

    def _fill(self, lim: _Limit) -> None:
        """The floor and the water level: the sum over joined followers of
        max(floor, min(wanted, level)) is the total (or everyone gets what it wants)."""
        n = self._joined
        total = lim.total
        floor = _down(total * min(FLOOR, FLOORS / n))
        budget = total - n * floor  # what the followers' excesses over the floor share
        wants = sorted(h.wanted - floor for h in lim.active if h.wanted > floor)
        level = total
        if sum(wants) > budget:
            acc = 0.0
            for i, excess in enumerate(wants):
                rest = len(wants) - i
                if acc + rest * excess >= budget:
                    level = floor + (budget - acc) / rest
                    break
                acc += excess
        level = _down(level)
        lim.floor = floor
        lim.level = level
        lim.excess = 0.0
        for h in lim.active:
            h.excess = max(0.0, min(h.wanted, level) - floor)
            lim.excess += h.excess
        lim.computed_for = n
        lim.changes = 0
        lim.stamp += 1
