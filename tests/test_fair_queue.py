"""A model's fair queue (llmgw_core.fair_queue), driven without a router: strict priority
between bands, weighted deficit round robin by cost within one (to the bound its module
states), settlement, the per-tenant and waiting-time bounds, removal, and a pop whose
work does not grow with idle tenants."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hypothesis_profiles import profile_times
from llmgw_core.fair_queue import BASE_QUANTUM, SETTLE_LIMIT_QUANTA, FairQueue, QueueBounds

Q = BASE_QUANTUM


class Req:
    """A waiting request: compared by identity, as the router's are."""

    __slots__ = ("cost", "n")

    def __init__(self, n: int, cost: float = 100.0) -> None:
        self.n = n
        self.cost = cost

    def __repr__(self) -> str:
        return f"Req({self.n}, {self.cost})"


def fill(
    q: FairQueue[Req], tenant: str, count: int, cost: float = 100.0, now: float = 0.0
) -> list[Req]:
    items = [Req(i, cost) for i in range(count)]
    for item in items:
        assert q.push(tenant, item, cost, now)
    return items


def drain(q: FairQueue[Req], pops: int, now: float = 0.0) -> list[tuple[str, Req]]:
    out = []
    for _ in range(pops):
        got = q.pop(now)
        assert got is not None
        out.append(got)
    return out


def served_cost(popped: list[tuple[str, Req]], tenant: str) -> float:
    return sum(item.cost for t, item in popped if t == tenant)


# --------------------------------------------------------------------------- the discipline


def test_a_higher_band_is_always_served_first() -> None:
    q: FairQueue[Req] = FairQueue()
    q.set_tenant("batch", priority=-1)
    q.set_tenant("interactive", priority=5, weight=0.01)  # its weight counts within its band only
    low = fill(q, "batch", 5)
    mid = fill(q, "default", 5)
    high = fill(q, "interactive", 5)
    popped = drain(q, 15)
    assert [item for _, item in popped] == high + mid + low
    assert q.pop(0.0) is None


def test_equal_weights_share_equally_and_1_to_3_shares_1_to_3() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=10_000))
    fill(q, "a", 1000)
    fill(q, "b", 1000)
    popped = drain(q, 600)
    assert abs(served_cost(popped, "a") - served_cost(popped, "b")) <= Q + 100

    q = FairQueue(QueueBounds(max_waiting_per_tenant=10_000))
    q.set_tenant("b", weight=3.0)
    fill(q, "a", 1000)
    fill(q, "b", 1000)
    popped = drain(q, 800)
    a, b = served_cost(popped, "a"), served_cost(popped, "b")
    assert a + b == 800 * 100
    assert abs(a - b / 3) <= Q + 100
    assert 2.8 < b / a < 3.2


def test_a_tenant_of_costs_ten_times_as_high_gets_a_tenth_of_the_requests() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=10_000))
    fill(q, "short", 2000, cost=100.0)
    fill(q, "long", 2000, cost=1000.0)
    popped = drain(q, 1100)
    short = sum(1 for t, _ in popped if t == "short")
    long = sum(1 for t, _ in popped if t == "long")
    assert short + long == 1100
    assert abs(short * 100 - long * 1000) <= Q + 1000
    assert 9.0 < short / long < 11.0


def test_fifo_within_a_tenant_and_none_when_empty() -> None:
    q: FairQueue[Req] = FairQueue()
    assert q.pop(0.0) is None
    items = fill(q, "a", 4, cost=5000.0)  # above a quantum: each takes several turns
    assert [item for _, item in drain(q, 4)] == items
    assert q.pop(0.0) is None and len(q) == 0 and q.tenants_waiting() == {}


def test_a_tenant_that_empties_forgets_its_deficit() -> None:
    q: FairQueue[Req] = FairQueue()
    q.push("a", Req(0), 24.0, 0.0)
    assert q.pop(0.0) is not None
    assert q.deficit("a") == 0.0  # 1000 left of its quantum: gone with its last request
    fill(q, "a", 1, cost=100.0)
    assert q.deficit("a") == 0.0
    q.pop(0.0)
    q.push("a", Req(1), 100.0, 0.0)
    q.push("a", Req(2), 100.0, 0.0)
    q.pop(0.0)
    assert q.deficit("a") == Q - 100


def test_a_tenant_that_leaves_mid_visit_gives_the_next_its_whole_visit() -> None:
    """However the visited tenant's last request leaves (served, removed, expired), the
    next tenant's visit begins with its own quantum."""
    for leaves in ("served", "removed", "expired"):
        q: FairQueue[Req] = FairQueue(QueueBounds(max_wait_s=10.0))
        a = fill(q, "a", 2, cost=100.0)
        fill(q, "b", 2, cost=1000.0, now=1.0)
        fill(q, "c", 2, cost=1000.0, now=1.0)
        assert q.pop(0.0) == ("a", a[0])  # a's visit goes on: 924 left
        if leaves == "served":
            assert q.pop(0.0) == ("a", a[1])
        elif leaves == "removed":
            assert q.remove("a", a[1])
        else:
            assert q.pop(10.5) is not None  # expires a[1] (it arrived at 0), then serves
        order = [t for t, _ in drain(q, 3 if leaves == "expired" else 4, now=10.5)]
        assert order == (["c", "b", "c"] if leaves == "expired" else ["b", "c", "b", "c"]), leaves


# --------------------------------------------------------------------------- bounds


def test_a_full_tenant_is_refused_and_nothing_changes() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=2))
    fill(q, "a", 2)
    extra = Req(9)
    assert not q.push("a", extra, 100.0, 0.0)
    assert len(q) == 2 and q.waiting("a") == 2 and not q.remove("a", extra)
    assert q.push("b", Req(0), 100.0, 0.0)  # another tenant has its own bound
    q.pop(0.0)
    q.pop(0.0)
    assert q.push("a", extra, 100.0, 0.0)  # room again once one of its requests left
    assert FairQueue[Req](QueueBounds(max_waiting_per_tenant=0)).push("a", extra, 1.0, 0.0) is False


def test_expiry_in_arrival_order_and_next_deadline() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_wait_s=10.0))
    assert q.next_deadline() is None and q.oldest_wait(3.0) == 0.0
    first, second, third, fourth = Req(1), Req(2), Req(3), Req(4)
    q.push("b", first, 100.0, 0.0)
    q.push("a", second, 100.0, 1.0)
    q.push("b", third, 100.0, 2.0)
    q.push("c", fourth, 100.0, 2.5)
    assert q.next_deadline() == 10.0
    assert q.oldest_wait(4.0) == 4.0
    assert q.expire(9.5) == []
    assert q.expire(11.0) == [("b", first), ("a", second)]
    assert len(q) == 2 and q.waiting("a") == 0 and q.waiting("b") == 1
    assert q.next_deadline() == 12.0
    # A pop at the deadline does not return it: it expires it and keeps it for `expire`
    # (no longer waiting, not removable), and the deadline already past says so.
    got = q.pop(12.0)
    assert got == ("c", fourth)
    assert len(q) == 0 and q.waiting("b") == 0
    assert q.next_deadline() == 12.0
    assert not q.remove("b", third)
    assert q.pop(12.0) is None
    assert q.expire(12.0) == [("b", third)]
    assert q.next_deadline() is None and q.expire(100.0) == []


def test_a_clock_that_steps_back_is_taken_as_the_latest() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_wait_s=10.0))
    early, late = Req(1), Req(2)
    q.push("a", early, 1.0, 5.0)
    q.push("b", late, 1.0, 3.0)  # arrived at 5 as far as the queue knows
    assert q.next_deadline() == 15.0
    assert q.expire(14.0) == []
    assert q.expire(15.0) == [("a", early), ("b", late)]


def test_a_removed_request_is_never_popped_nor_expired() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_wait_s=10.0))
    items = fill(q, "a", 3)
    other = fill(q, "b", 1)[0]
    assert not q.remove("b", items[1])  # another tenant's
    assert not q.remove("a", Req(1))  # an equal-looking other object: identity only
    assert q.remove("a", items[1])
    assert not q.remove("a", items[1])
    assert len(q) == 3 and q.waiting("a") == 2 and q.tenants_waiting() == {"a": 2, "b": 1}
    assert q.remove("b", other)
    assert q.tenants_waiting() == {"a": 2} and q.deficit("b") == 0.0
    assert [item for _, item in drain(q, 1)] == [items[0]]
    assert q.remove("a", items[2])
    assert len(q) == 0 and q.pop(0.0) is None
    assert q.expire(100.0) == [] and q.next_deadline() is None


def test_bad_input_is_refused() -> None:
    q: FairQueue[Req] = FairQueue()
    item = Req(0)
    for cost in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            q.push("a", item, cost, 0.0)
    for weight in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            q.set_tenant("a", weight=weight)
    assert q.push("a", item, 1.0, 0.0)
    with pytest.raises(ValueError):
        q.push("a", item, 1.0, 0.0)  # already waiting: removal by identity needs it once
    assert q.push("b", item, 1.0, 0.0)  # for another tenant it is another request
    with pytest.raises(ValueError):
        q.settle("a", math.nan)
    assert len(q) == 2


# --------------------------------------------------------------------------- tenants


def test_set_tenant_moves_waiting_requests_between_bands() -> None:
    q: FairQueue[Req] = FairQueue()
    a = fill(q, "a", 3)
    b = fill(q, "b", 3)
    assert q.tenant("b") == (0, 1.0)
    assert q.pop(0.0) == ("a", a[0])
    q.set_tenant("b", priority=1)
    assert q.tenant("b") == (1, 1.0)
    assert [item for _, item in drain(q, 3)] == b
    q.set_tenant("b", priority=0)
    assert q.tenant("b") == (0, 1.0)
    b2 = fill(q, "b", 2)
    q.set_tenant("a", priority=-3)  # a drops below b: its deficit is forgotten
    assert q.deficit("a") == 0.0
    assert [item for _, item in drain(q, 4)] == [*b2, a[1], a[2]]


def test_a_new_weight_takes_effect_from_the_next_visit() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=10_000))
    fill(q, "a", 100)
    fill(q, "b", 100)
    popped = drain(q, 20)  # a's visit (10 of 100), then b's
    assert [t for t, _ in popped] == ["a"] * 10 + ["b"] * 10
    q.set_tenant("a", weight=2.0)
    popped = drain(q, 30)
    assert [t for t, _ in popped] == ["a"] * 20 + ["b"] * 10
    assert q.deficit("a") == 2 * Q + 24 - 2000  # what the last visit left, and this one's


def test_settle_charges_an_active_tenant_within_its_limit() -> None:
    q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=10_000))
    q.set_tenant("a", weight=2.0)
    fill(q, "a", 100)
    fill(q, "b", 100)
    q.pop(0.0)
    assert q.deficit("a") == 2 * Q - 100
    assert q.settle("a", 500.0) == 500.0  # it cost 500 more than its estimate
    assert q.deficit("a") == 2 * Q - 600
    assert q.settle("a", -300.0) == -300.0  # ... or less
    assert q.deficit("a") == 2 * Q - 300
    limit = SETTLE_LIMIT_QUANTA * 2 * Q
    assert q.settle("a", 1e12) == limit
    assert q.deficit("a") == 2 * Q - 300 - limit
    assert q.settle("a", -math.inf) == -limit  # a refund as large is clamped alike
    assert q.deficit("a") == 2 * Q - 300
    assert q.settle("nobody", 100.0) == 0.0  # idle: its history is forgotten
    assert q.deficit("nobody") == 0.0
    # A debt of four of a's quanta costs it four visits: b is served 4 visits of 10 while
    # a's deficit climbs from 1748 - 8192 back to 1748, which then serves 17.
    assert q.settle("a", 1e12) == limit
    assert [t for t, _ in drain(q, 57)] == ["b"] * 40 + ["a"] * 17
    assert q.deficit("a") == 1748 - 1700
    q.settle("a", 1e12)
    q.set_tenant("a", priority=1, weight=2.0)  # a new band forgets what it owed
    assert q.deficit("a") == 0.0
    assert q.pop(0.0) is not None and q.deficit("a") == 2 * Q - 100


# --------------------------------------------------------------------------- work per pop


def test_idle_declared_tenants_cost_a_pop_nothing() -> None:
    def steps(declared: int) -> int:
        q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=10_000))
        for i in range(declared):
            q.set_tenant(f"t{i}", priority=i % 7 - 3, weight=1 + i % 5)
        fill(q, "t0", 2000)
        fill(q, "t1", 2000)
        drain(q, 3000)
        return q.steps

    idle = steps(10_000)
    assert idle == steps(2)
    assert idle <= 2 * 3000  # a visit that ends, and the next that serves


def test_costs_far_above_the_quanta_skip_the_turns_instead_of_taking_them() -> None:
    """A thousand tenants whose requests cost a thousand quanta each: turning the ring a
    visit at a time would take a million visits before the first pop returns."""
    q: FairQueue[Req] = FairQueue()
    tenants = [f"t{i}" for i in range(1000)]
    for i, tenant in enumerate(tenants):
        fill(q, tenant, 2, cost=1000 * Q + i)
    order = []
    most = 0
    for _ in range(2000):
        before = q.steps
        got = q.pop(0.0)
        assert got is not None
        order.append(got[0])
        most = max(most, q.steps - before)
    assert order == tenants + tenants
    # At worst a turn that serves nobody, the pass that skips, and a turn that serves:
    # then every tenant is a quantum from its request, and the pops after take 2 steps.
    assert most <= 3 * len(tenants) + 1
    assert q.steps <= 8 * len(tenants) + 2 * 2000


# --------------------------------------------------------------------------- fairness over a long run


def test_fairness_bound_over_a_long_backlogged_run() -> None:
    """Four tenants kept backlogged through 20,000 pops of random costs: at every pop the
    bound from the start, S_i/w_i - S_j/w_j <= Q + C_j/w_j, and over any interval of
    the run 2Q + C_i/w_i + C_j/w_j; the cost served tends to the weights' shares."""
    rng = random.Random(7)
    weights = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 3.0}
    costs = {"a": (1, 600), "b": (1, 6000), "c": (500, 3000), "d": (1, 40_000)}
    q: FairQueue[Req] = FairQueue(QueueBounds(max_waiting_per_tenant=100))
    q.set_tenant("low", priority=-1)
    fill(q, "low", 10)  # never served while the band above stays backlogged
    most = dict.fromkeys(weights, 0.0)

    def push(tenant: str) -> None:
        cost = float(rng.randint(*costs[tenant]))
        most[tenant] = max(most[tenant], cost)
        assert q.push(tenant, Req(0, cost), cost, 0.0)

    for tenant, weight in weights.items():
        q.set_tenant(tenant, weight=weight)
        for _ in range(3):
            push(tenant)
    served = dict.fromkeys(weights, 0.0)
    marks = []
    closest = math.inf  # how near the bound came: it should be near, not vacuous
    for n in range(20_000):
        got = q.pop(0.0)
        assert got is not None
        tenant, item = got
        served[tenant] += item.cost
        push(tenant)
        for i, j in itertools.permutations(weights, 2):
            gap = served[i] / weights[i] - served[j] / weights[j]
            bound = Q + most[j] / weights[j]
            assert gap <= bound
            closest = min(closest, bound - gap)
        if n % 200 == 0:
            marks.append(dict(served))
    assert closest < Q / 4
    for start, end in itertools.combinations(marks, 2):
        for i, j in itertools.permutations(weights, 2):
            gap = (end[i] - start[i]) / weights[i] - (end[j] - start[j]) / weights[j]
            assert gap <= 2 * Q + most[i] / weights[i] + most[j] / weights[j]
    shares = [served[t] / weights[t] for t in weights]
    assert max(shares) / min(shares) < 1.01
    assert q.waiting("low") == 10


# --------------------------------------------------------------------------- state machines

TENANTS = ["a", "b", "c", "d"]
MAX_WAIT = 5.0
MAX_PER_TENANT = 3
PRIORITIES = st.sampled_from([-1, 0, 0, 1, 2])
WEIGHTS = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])
COSTS = st.one_of(st.integers(0, 3000), st.integers(3000, 40_000)).map(float)


class QueueMachine(RuleBasedStateMachine):
    """Any sequence of pushes, pops, removals, expiries, reloads and settlements, against
    a model that knows what waits but not the round robin's order: priority, FIFO within
    a tenant, work conservation and exact counts."""

    def __init__(self) -> None:
        super().__init__()
        self.q: FairQueue[Req] = FairQueue(QueueBounds(MAX_PER_TENANT, MAX_WAIT))
        self.now = 0.0
        self.config = {t: (0, 1.0) for t in TENANTS}
        # (tenant, item, arrived) in arrival order: waiting, and expired by a pop but not
        # yet handed back by `expire`
        self.queue: list[tuple[str, Req, float]] = []
        self.expired: list[tuple[str, Req, float]] = []
        self.pushed: list[Req] = []  # every item ever pushed (alive: ids stay unique)
        self.out: set[int] = set()  # items popped, expired or removed

    def _expire_due(self) -> None:
        due = [e for e in self.queue if e[2] + MAX_WAIT <= self.now]
        self.expired += due
        self.queue = [e for e in self.queue if e[2] + MAX_WAIT > self.now]

    def _left(self, item: Req) -> None:
        assert id(item) not in self.out, f"{item} came out twice"
        self.out.add(id(item))

    def _waiting(self, tenant: str) -> list[Req]:
        return [item for t, item, _ in self.queue if t == tenant]

    @rule(tenant=st.sampled_from(TENANTS), cost=COSTS)
    def push(self, tenant: str, cost: float) -> None:
        item = Req(len(self.pushed), cost)
        self.pushed.append(item)
        fits = len(self._waiting(tenant)) < MAX_PER_TENANT
        assert self.q.push(tenant, item, cost, self.now) == fits
        if fits:
            self.queue.append((tenant, item, self.now))

    @precondition(lambda self: self.queue)
    @rule(pick=st.integers(0, 100))
    def push_a_waiting_item_again(self, pick: int) -> None:
        tenant, item, _ = self.queue[pick % len(self.queue)]
        if len(self._waiting(tenant)) < MAX_PER_TENANT:
            with pytest.raises(ValueError):
                self.q.push(tenant, item, item.cost, self.now)
        else:
            assert not self.q.push(tenant, item, item.cost, self.now)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule()
    def pop(self) -> None:
        self._expire_due()
        got = self.q.pop(self.now)
        if not self.queue:
            assert got is None
            return
        assert got is not None, "idle while a request waits"
        tenant, item = got
        top = max(self.config[t][0] for t, _, _ in self.queue)
        assert self.config[tenant][0] == top, "served a lower band"
        assert item is self._waiting(tenant)[0], "not first-come within its tenant"
        self.queue = [e for e in self.queue if e[1] is not item]
        self._left(item)

    @rule()
    def expire(self) -> None:
        self._expire_due()
        got = self.q.expire(self.now)
        assert got == [(t, item) for t, item, _ in self.expired]
        for _, item in got:
            self._left(item)
        self.expired = []

    @precondition(lambda self: self.pushed)
    @rule(pick=st.integers(0, 1000), tenant=st.sampled_from([None, *TENANTS]))
    def remove(self, pick: int, tenant: str | None) -> None:
        item = self.pushed[pick % len(self.pushed)]
        owner = next((t for t, i, _ in self.queue if i is item), None)
        if tenant is None:
            tenant = owner or "a"
        removed = self.q.remove(tenant, item)
        assert removed == (tenant == owner)
        if removed:
            self.queue = [e for e in self.queue if e[1] is not item]
            self._left(item)

    @rule(tenant=st.sampled_from(TENANTS), priority=PRIORITIES, weight=WEIGHTS)
    def reload(self, tenant: str, priority: int, weight: float) -> None:
        self.q.set_tenant(tenant, priority, weight)
        self.config[tenant] = (priority, weight)
        assert self.q.tenant(tenant) == (priority, weight)

    @rule(tenant=st.sampled_from(TENANTS), delta=st.integers(-20_000, 20_000).map(float))
    def settle(self, tenant: str, delta: float) -> None:
        applied = self.q.settle(tenant, delta)
        if self._waiting(tenant):
            limit = SETTLE_LIMIT_QUANTA * Q * self.config[tenant][1]
            assert applied == min(max(delta, -limit), limit)
        else:
            assert applied == 0.0

    @invariant()
    def counts_are_exact(self) -> None:
        assert len(self.q) == len(self.queue)
        counts = {t: len(self._waiting(t)) for t in TENANTS}
        assert self.q.tenants_waiting() == {t: n for t, n in counts.items() if n}
        for t in TENANTS:
            assert self.q.waiting(t) == counts[t]
            if not counts[t]:
                assert self.q.deficit(t) == 0.0

    @invariant()
    def deadlines(self) -> None:
        if self.expired:
            assert self.q.next_deadline() == self.expired[0][2] + MAX_WAIT
        elif self.queue:
            assert self.q.next_deadline() == self.queue[0][2] + MAX_WAIT
        else:
            assert self.q.next_deadline() is None
        oldest = self.now - self.queue[0][2] if self.queue else 0.0
        assert self.q.oldest_wait(self.now) == oldest


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(
    max_examples=profile_times(3), stateful_step_count=60, deadline=None
)


class FairnessMachine(RuleBasedStateMachine):
    """A band's tenants kept backlogged (each pop's tenant gets a new request at once),
    with random costs and settlements, and a lower band that must wait throughout.
    Every visit grants q = Q * w, so S + deficit = m * q for the cost S charged to a
    tenant (served, plus settled) after its m visits, and visit counts differ by at most
    one; with no settlement, S_i/w_i - S_j/w_j <= Q + C_j/w_j, C_j the largest cost
    j has pushed. (Weights and costs are exact in binary: the checks are exact.)"""

    @initialize(
        weights=st.lists(WEIGHTS, min_size=2, max_size=5),
        first=st.lists(COSTS, min_size=10, max_size=10),
        depth=st.integers(2, 3),  # the pop's tenant keeps one waiting until its refill
    )
    def start(self, weights: list[float], first: list[float], depth: int) -> None:
        self.q: FairQueue[Req] = FairQueue(QueueBounds(10, math.inf))
        self.weights = {f"t{i}": w for i, w in enumerate(weights)}
        self.charged = dict.fromkeys(self.weights, 0.0)
        self.most = dict.fromkeys(self.weights, 0.0)
        self.settled = False
        self.q.set_tenant("low", priority=-1)
        self.q.push("low", Req(-1), 1.0, 0.0)
        costs = iter(first * depth)
        for tenant, weight in self.weights.items():
            self.q.set_tenant(tenant, weight=weight)
            for _ in range(depth):
                self._push(tenant, next(costs))

    def _push(self, tenant: str, cost: float) -> None:
        self.most[tenant] = max(self.most[tenant], cost)
        assert self.q.push(tenant, Req(0, cost), cost, 0.0)

    @rule(refill=COSTS)
    def pop(self, refill: float) -> None:
        got = self.q.pop(0.0)
        assert got is not None
        tenant, item = got
        assert tenant in self.weights, "served a lower band"
        self.charged[tenant] += item.cost
        self._push(tenant, refill)

    @rule(pick=st.integers(0, 4), delta=st.integers(-20_000, 20_000).map(float))
    def settle(self, pick: int, delta: float) -> None:
        tenant = list(self.weights)[pick % len(self.weights)]
        applied = self.q.settle(tenant, delta)
        limit = SETTLE_LIMIT_QUANTA * Q * self.weights[tenant]
        assert applied == min(max(delta, -limit), limit)
        self.charged[tenant] += applied
        self.settled = self.settled or applied != 0

    @invariant()
    def visits_one_apart(self) -> None:
        granted = [(self.charged[t] + self.q.deficit(t)) / w / Q for t, w in self.weights.items()]
        assert all(g == int(g) for g in granted)
        assert max(granted) - min(granted) <= 1

    @invariant()
    def within_the_bound(self) -> None:
        if self.settled:
            return
        for i, j in itertools.permutations(self.weights, 2):
            wi, wj = self.weights[i], self.weights[j]
            # S_i/w_i - S_j/w_j <= Q + C_j/w_j, times w_i * w_j (exact in binary)
            assert self.charged[i] * wj - self.charged[j] * wi <= Q * wi * wj + self.most[j] * wi


TestFairnessMachine = FairnessMachine.TestCase
TestFairnessMachine.settings = settings(
    max_examples=profile_times(3), stateful_step_count=80, deadline=None
)
