"""One model's waiting requests, queued per tenant and served fairly. Pure: the caller
supplies the times (`now`, a float of seconds), and nothing here waits, sleeps or reads a
clock.

When every replica of a model is at its load bound (`replica_max_in_flight`), the router
holds the model's requests here rather than piling them onto the engines' own
first-come queues, and pops the next one whenever an engine slot frees. Which one is
the point:

- **Strict priority between bands.** A tenant's `priority` (higher first, 0 by default)
  names its band; a request of a higher band is always popped before any of a lower one.
  A lower band may starve while a higher one stays backlogged: that is what a priority
  is for, and the bound on each tenant's waiting requests keeps a band's backlog finite.
- **Weighted deficit round robin within a band** (Shreedhar and Varghese), charged by
  each request's `cost` (uncached prompt tokens plus expected output tokens: what the
  engine will spend on it, so a tenant of long prompts does not get as many of them as
  a tenant of short ones). The band's active tenants (those with a request waiting)
  stand in a ring; each visit adds the tenant's quantum, `BASE_QUANTUM * weight`, to
  its deficit, and the tenant is served while its next request's cost fits in the
  deficit. A tenant whose queue empties leaves the ring and its deficit is forgotten:
  credit is not hoarded while idle.

  The bound, for tenants i and j of one band both backlogged since before its first pop
  (so both have been in the ring from its start), at every moment between calls and
  with no settlement applied: `S_i / w_i - S_j / w_j <= BASE_QUANTUM + C_j / w_j`,
  where S is the cost served, w the weight and C_j the largest cost among j's requests
  so far. Why: each visit grants q = BASE_QUANTUM * w, so S + deficit = m * q after m
  visits; the visit counts of the ring's tenants differ by at most one (the ring turns
  in order), a deficit is never negative and, once a visit ends, below the cost of the
  request that ended it. Over any interval in which both stay backlogged the difference
  is at most `2 * BASE_QUANTUM + C_i / w_i + C_j / w_j`. tests/test_fair_queue.py
  checks both, and `S + deficit = m * q` with visit counts one apart with settlements
  too (S then counts what was settled).
- **Settlement.** A request's real cost is known only when its answer ends; `settle`
  charges the difference to the tenant's deficit while it is still active (DRR forgets
  an idle tenant's history, and so does this), at most `SETTLE_LIMIT_QUANTA` of its
  quanta either way per call.
- **Bounds.** At most `max_waiting_per_tenant` of one tenant's requests wait (`push`
  refuses the next), and none waits longer than `max_wait_s`: such a request is never
  popped, `expire` hands it back (the shell answers it), and `next_deadline` says when
  the next one is due.

Pop is O(1) amortized in the number of tenants when the quanta cover the requests'
costs: only active tenants are in a ring (idle declared ones cost nothing), and bands
are found through a heap. When costs exceed the quanta, the turns of the ring in which
no tenant could be served are skipped in one pass over the band's active tenants
instead of being taken one by one: a pop then costs at most three passes over them (a
turn that serves nobody, the skip, a turn that serves). push, remove, settle and
set_tenant are O(1), expire O(expired), amortized; memory is O(waiting requests +
active tenants + declared tenants).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Generic, TypeVar

import attrs

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

# Cost units a visit grants a tenant of weight 1: about one request of a short prompt and
# a short answer, so a typical request is served within a visit or two and a pop rarely
# turns the ring more than once. Smaller quanta only make the ring turn more (the
# bound above tightens with it); larger ones let a tenant send longer bursts in turn.
BASE_QUANTUM = 1024.0

# The most one `settle` moves a tenant's deficit, in quanta of that tenant (4 * 1024 cost
# units at weight 1), either way. An estimate off by a few thousand tokens is corrected
# in full; one wildly off (an answer far past what its request expected) delays its
# tenant by at most four more visits rather than starving it for a hundred, and a
# refund cannot give it a burst of more than four visits' worth at once.
SETTLE_LIMIT_QUANTA = 4.0

DEFAULT_PRIORITY = 0
DEFAULT_WEIGHT = 1.0


@attrs.frozen
class QueueBounds:
    """How much of a model's queue one tenant may hold, and for how long."""

    max_waiting_per_tenant: int = attrs.field(default=256, validator=attrs.validators.ge(0))
    max_wait_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0.0))


@attrs.define(slots=True, eq=False)
class _Waiting(Generic[T]):
    """One waiting request."""

    tenant: str
    item: T
    cost: float
    arrived: float
    deadline: float  # arrived + max_wait_s: it is never popped at or after this
    seq: int  # its place in arrival order (the key of FairQueue._order)


@attrs.define(slots=True, eq=False)
class _Active(Generic[T]):
    """A tenant with requests waiting: in its band's ring. Made when its first request
    arrives and dropped when its last one leaves (its deficit with it)."""

    name: str
    priority: int
    quantum: float
    deficit: float = 0.0
    # Its requests in arrival order, keyed by id(item): an OrderedDict pops its first
    # and deletes any other in O(1) (a plain dict's first slot, after many deletions at
    # the front, is found by a scan over the holes they leave).
    queue: OrderedDict[int, _Waiting[T]] = attrs.Factory(OrderedDict)


@attrs.define(slots=True, eq=False)
class _Band(Generic[T]):
    """One priority's active tenants, in the order the round robin visits them: the
    first is the tenant being visited (or the next to be)."""

    ring: OrderedDict[str, _Active[T]] = attrs.Factory(OrderedDict)
    # Whether the ring's first tenant has had its quantum for its current visit: a pop
    # returns one request, and the next pop continues the visit where it stopped.
    granted: bool = False


def _first(mapping: OrderedDict[K, V]) -> V:
    return next(iter(mapping.values()))


class FairQueue(Generic[T]):
    """One model's waiting requests (items of type T, compared by identity), by tenant:
    strict priority between bands, weighted deficit round robin by cost within one.

    Times are the caller's monotonic seconds; one that steps back is taken as the latest
    seen, so requests keep expiring in arrival order.

    `pop(now)` first expires what is due by `now` and keeps it for the next `expire`:
    an expired request is no longer waiting (not in `len`, `waiting`, nor removable),
    and `next_deadline` then answers its deadline, already past, so that the shell's
    timer fires at once and `expire` hands it back."""

    def __init__(self, bounds: QueueBounds | None = None) -> None:
        # Fixed for the queue's life: expiry takes from the front of the arrival order
        # only because every request waits as long.
        self._bounds = bounds if bounds is not None else QueueBounds()
        # Ring visits and tenants passed over by a pop, summed over every pop: the work a
        # pop does, which the tests count rather than time.
        self.steps = 0
        self._declared: dict[str, tuple[int, float]] = {}  # tenant -> (priority, weight)
        self._active: dict[str, _Active[T]] = {}
        self._bands: dict[int, _Band[T]] = {}  # only bands with an active tenant
        # Negated priorities of the bands (a min-heap), each once; a band that empties
        # stays until it surfaces, and `_in_heap` keeps it from being pushed twice.
        self._heap: list[int] = []
        self._in_heap: set[int] = set()
        # Every waiting request in arrival order, which is deadline order since every
        # request waits as long: expiry takes from the front.
        self._order: OrderedDict[int, _Waiting[T]] = OrderedDict()
        self._expired: list[_Waiting[T]] = []  # expired by a pop, for the next `expire`
        self._seq = 0
        self._latest = -math.inf

    @property
    def bounds(self) -> QueueBounds:
        return self._bounds

    # ------------------------------------------------------------------ configuration

    def set_tenant(
        self, tenant: str, priority: int = DEFAULT_PRIORITY, weight: float = DEFAULT_WEIGHT
    ) -> None:
        """Declares a tenant or changes it (a config reload). Its waiting requests move to
        the new band at once, at the back of its ring and with the deficit forgotten (it
        is a newcomer there); a new weight alone keeps its place and deficit and takes
        effect from its next visit."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"a tenant's weight must be a finite number above 0, not {weight}")
        if priority == DEFAULT_PRIORITY and weight == DEFAULT_WEIGHT:
            self._declared.pop(tenant, None)  # the same as undeclared: nothing to keep
        else:
            self._declared[tenant] = (priority, weight)
        active = self._active.get(tenant)
        if active is None:
            return
        active.quantum = BASE_QUANTUM * weight
        if priority != active.priority:
            self._leave_band(active)
            active.priority = priority
            active.deficit = 0.0
            self._join_band(active)

    def tenant(self, tenant: str) -> tuple[int, float]:
        """A tenant's (priority, weight): as declared, or the defaults."""
        return self._declared.get(tenant, (DEFAULT_PRIORITY, DEFAULT_WEIGHT))

    # ------------------------------------------------------------------ requests

    def push(self, tenant: str, item: T, cost: float, now: float) -> bool:
        """Queues `item` for `tenant`, costing `cost` (>= 0) when served. False, and
        nothing changed, when the tenant already has its most requests waiting. An item
        already waiting for the tenant is a ValueError: removal is by identity."""
        if not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"a request's cost must be a finite number >= 0, not {cost}")
        active = self._active.get(tenant)
        waiting = 0 if active is None else len(active.queue)
        if waiting >= self._bounds.max_waiting_per_tenant:
            return False
        if active is not None and id(item) in active.queue:
            raise ValueError(f"this item is already waiting for tenant {tenant!r}")
        now = self._clock(now)
        if active is None:
            priority, weight = self.tenant(tenant)
            active = _Active(tenant, priority, BASE_QUANTUM * weight)
            self._active[tenant] = active
            self._join_band(active)
        self._seq += 1
        entry = _Waiting(tenant, item, cost, now, now + self._bounds.max_wait_s, self._seq)
        active.queue[id(item)] = entry
        self._order[entry.seq] = entry
        return True

    def pop(self, now: float) -> tuple[str, T] | None:
        """The next request by priority, then by the round robin: (tenant, item). None
        when nothing waits (after expiring what is due by `now`, kept for `expire`)."""
        self._expire_due(self._clock(now))
        band = self._top_band()
        if band is None:
            return None
        ring = band.ring
        failed = 0  # visits in a row that served nothing
        while True:
            active = _first(ring)
            self.steps += 1
            if not band.granted:
                active.deficit += active.quantum
                band.granted = True
            head = _first(active.queue)
            if head.cost <= active.deficit:
                active.deficit -= head.cost
                self._drop(active, head)
                return active.name, head.item
            ring.move_to_end(active.name)
            band.granted = False
            failed += 1
            if failed >= len(ring):
                # A whole turn of the ring served nobody: every tenant's next request
                # costs more than its deficit. Grant at once the turns in which still
                # nobody could be served (the fewest any tenant needs, less the one in
                # which it is served), rather than turning the ring through them. The
                # next turn serves someone (a rounding of the costs may leave it one
                # short: then it skips none and turns again).
                self._skip_turns(band)
                failed = 0

    def remove(self, tenant: str, item: T) -> bool:
        """Takes `item` (by identity) out of `tenant`'s waiting requests: its client went
        away. False when it is not waiting there (popped, expired, never pushed)."""
        active = self._active.get(tenant)
        if active is None:
            return False
        entry = active.queue.get(id(item))
        if entry is None or entry.item is not item:
            return False
        self._drop(active, entry)
        return True

    def expire(self, now: float) -> list[tuple[str, T]]:
        """Takes out and returns every request whose wait ran out by `now` (including
        those a pop already expired), in arrival order: the shell answers them."""
        self._expire_due(self._clock(now))
        expired = [(entry.tenant, entry.item) for entry in self._expired]
        self._expired.clear()
        return expired

    def settle(self, tenant: str, delta: float) -> float:
        """Charges `tenant` `delta` more cost units (its real cost less the estimate it
        was popped for; negative: a refund), at most SETTLE_LIMIT_QUANTA of its quanta
        either way. Applied only while the tenant has requests waiting: an idle tenant's
        deficit is forgotten, and so is what it owed. Returns the delta applied (0 when
        dropped)."""
        if math.isnan(delta):
            raise ValueError("a settlement's delta must be a number, not NaN")
        active = self._active.get(tenant)
        if active is None:
            return 0.0
        limit = SETTLE_LIMIT_QUANTA * active.quantum
        applied = min(max(delta, -limit), limit)
        active.deficit -= applied
        return applied

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self._order)

    def waiting(self, tenant: str) -> int:
        active = self._active.get(tenant)
        return 0 if active is None else len(active.queue)

    def tenants_waiting(self) -> dict[str, int]:
        """Each tenant with requests waiting, and how many (for /metrics)."""
        return {name: len(active.queue) for name, active in self._active.items()}

    def deficit(self, tenant: str) -> float:
        """A tenant's deficit: cost units it may still be served in its current visit,
        or, between visits, its credit (negative: what it owes). 0 when idle."""
        active = self._active.get(tenant)
        return 0.0 if active is None else active.deficit

    def next_deadline(self) -> float | None:
        """When `expire` next has something to return (a time already past when a pop
        expired requests that `expire` has not returned yet); None when nothing waits."""
        if self._expired:
            return self._expired[0].deadline
        if self._order:
            return _first(self._order).deadline
        return None

    def oldest_wait(self, now: float) -> float:
        """How long the longest-waiting request has waited (0 when none waits)."""
        if not self._order:
            return 0.0
        return max(0.0, now - _first(self._order).arrived)

    # ------------------------------------------------------------------ inside

    def _clock(self, now: float) -> float:
        self._latest = max(self._latest, now)
        return self._latest

    def _expire_due(self, now: float) -> None:
        order = self._order
        while order:
            entry = _first(order)
            if entry.deadline > now:
                return
            self._drop(self._active[entry.tenant], entry)
            self._expired.append(entry)

    def _drop(self, active: _Active[T], entry: _Waiting[T]) -> None:
        """Takes a request out of its tenant's queue and the arrival order; the tenant
        leaves its ring when it was the last."""
        del active.queue[id(entry.item)]
        del self._order[entry.seq]
        if not active.queue:
            self._leave_band(active)
            del self._active[active.name]

    def _join_band(self, active: _Active[T]) -> None:
        band = self._bands.get(active.priority)
        if band is None:
            band = self._bands[active.priority] = _Band()
            if active.priority not in self._in_heap:
                self._in_heap.add(active.priority)
                heapq.heappush(self._heap, -active.priority)
        band.ring[active.name] = active  # at the back: visited after every tenant there

    def _leave_band(self, active: _Active[T]) -> None:
        band = self._bands[active.priority]
        if next(iter(band.ring)) == active.name:
            band.granted = False  # the next tenant's visit has not begun
        del band.ring[active.name]
        if not band.ring:
            del self._bands[active.priority]

    def _top_band(self) -> _Band[T] | None:
        heap = self._heap
        while heap:
            band = self._bands.get(-heap[0])
            if band is not None:
                return band
            self._in_heap.discard(-heapq.heappop(heap))
        return None

    def _skip_turns(self, band: _Band[T]) -> None:
        """Adds to every tenant of the band the quanta of the turns of its ring in which
        none of them could be served: each needs ceil((cost - deficit) / quantum) more
        visits (at least one: none was served), and the turns before the fewest of them
        serve nobody. The ring is where that turn would start; its first tenant's visit
        has not begun."""
        actives = band.ring.values()
        needed = min(
            math.ceil((_first(active.queue).cost - active.deficit) / active.quantum)
            for active in actives
        )
        self.steps += len(actives)
        turns = needed - 1
        if turns > 0:
            for active in actives:
                active.deficit += turns * active.quantum
