"""Per-tenant fair queues in front of a full model: the request plan's wait, after the
tenant's limits admitted a request and before its attempts.

With `[router] replica_max_in_flight = N` (N > 0), this router process sends each
replica at most N requests at once. A request that finds every available replica of
its model at N (or others already waiting: no overtaking) waits in the model's
`FairQueue` (llmgw_core.fair_queue decides the order: strict priority, then weighted
deficit round robin charged by uncached prompt plus output tokens) until a slot frees.
A slot handed to a waiter is promised (`handed`) until it is sent, so an arrival in
between cannot take it. Slots are looked for again whenever a request of the model ends
(`dispatch`, from router.front), and at each health probe round (a replica that comes
back, or a new one from the route table, frees slots with nobody ending).

Bounds: `queue_max_per_tenant` waiting per tenant and model, each for
`queue_max_wait_s`; past either, the caller answers 429 with Retry-After. A waiting
request holds its body (within `[server] max_body_bytes`) and one small Waiter.
"""

from __future__ import annotations

import enum

import trio

from llmgw_core.config import RouterSection
from llmgw_core.fair_queue import FairQueue, QueueBounds
from llmgw_server.router.replica import Replica

# The Retry-After of a request refused for its queue (full, or waited too long): when a
# slot frees depends on answers ending, so no time is exact.
QUEUE_RETRY_S = 1.0


class Entry(enum.Enum):
    NOW = "now"  # a slot was free: sent at once, never queued
    WAITED = "waited"  # it waited for a slot, and has one
    FULL = "full"  # its tenant's queue for the model is full: 429
    TIMEOUT = "timeout"  # it waited queue_max_wait_s: 429


class _Waiter:
    __slots__ = ("handed", "woken")

    def __init__(self) -> None:
        self.woken = trio.Event()
        self.handed = False  # a slot was promised to it


class ModelGate:
    """One model's fair queue in this process."""

    def __init__(self, tuning: RouterSection) -> None:
        self.bound = tuning.replica_max_in_flight
        self.queue: FairQueue[_Waiter] = FairQueue(
            QueueBounds(tuning.queue_max_per_tenant, tuning.queue_max_wait_s)
        )
        self.handed = 0  # slots promised to woken waiters that have not been sent yet

    def free_slots(self, replicas: list[Replica]) -> int:
        bound = self.bound
        free = 0
        for replica in replicas:
            if replica.available and replica.outstanding < bound:
                free += bound - replica.outstanding
        return free - self.handed

    def full(self, replica: Replica) -> bool:
        """Whether the balancer should pass `replica` over for a request's first attempt."""
        return replica.outstanding >= self.bound

    async def enter(
        self, tenant: str, cost: float, replicas: list[Replica], priority: int, weight: float
    ) -> Entry:
        """Wait for a slot (or not). On NOW or WAITED the caller must call `taken` before
        its next checkpoint, right as it sends, so that the slot becomes its replica's
        outstanding request."""
        queue = self.queue
        if not len(queue) and self.free_slots(replicas) > 0:
            return Entry.NOW
        now = trio.current_time()
        if queue.tenant(tenant) != (priority, weight):
            queue.set_tenant(tenant, priority, weight)
        waiter = _Waiter()
        if not queue.push(tenant, waiter, cost, now):
            return Entry.FULL
        self.dispatch(replicas)
        try:
            with trio.move_on_at(now + queue.bounds.max_wait_s):
                await waiter.woken.wait()
        except BaseException:
            # Gone while waiting (the client left), or after a slot was promised to it:
            # the slot goes to the next.
            if waiter.handed:
                self.handed -= 1
                self.dispatch(replicas)
            else:
                queue.remove(tenant, waiter)
            raise
        if waiter.handed:
            return Entry.WAITED
        queue.remove(tenant, waiter)  # it may have been expired by a pop already
        queue.expire(trio.current_time())
        return Entry.TIMEOUT

    def taken(self, entry: Entry) -> None:
        if entry is Entry.WAITED:
            self.handed -= 1

    def dispatch(self, replicas: list[Replica]) -> None:
        """Hand the free slots to the next waiters, in the queue's order."""
        queue = self.queue
        if not len(queue):
            return
        now = trio.current_time()
        free = self.free_slots(replicas)
        while free > 0:
            popped = queue.pop(now)
            if popped is None:
                break
            waiter = popped[1]
            waiter.handed = True
            self.handed += 1
            waiter.woken.set()
            free -= 1
        # What pop expired: each such waiter wakes at its own deadline and answers 429.
        queue.expire(now)

    def settle(self, tenant: str, delta: float) -> None:
        """A request's real cost was `delta` more than it was charged (its answer ended)."""
        self.queue.settle(tenant, delta)
