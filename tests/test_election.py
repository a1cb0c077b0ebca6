"""The election's trio shell (control_shell/election.py) against a real etcd: control
planes in one process, each with its own client, on 2 s leases.

One leads and keeps leading; a resignation hands over within a round trip; a leader
whose calls to the store stop (a pause) loses its fence at its deadline, before another
wins, and writes nothing after; a guarded write after the leader key is gone fails and
writes nothing; a standby whose catalog differs never leads while the leader lives; with
etcd stopped the leader steps down by its deadline and says why, and with etcd back
there is a leader again. The figures (handover times) are printed: run with -s.
"""

from __future__ import annotations

import functools
import logging
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from etcd_cluster import EtcdCluster
from llmgw_core.store_config import StoreSection
from llmgw_server.control_shell.election import MAX_TXN_OPS, Election, Member, Standing
from llmgw_server.store.etcd import (
    Compare,
    EtcdClient,
    KeyValue,
    Lease,
    Op,
    TxnResult,
    WatchEvent,
    WatchStream,
)

Test = Callable[..., Awaitable[None]]
TTL_S = 2.0
POLL_S = 0.005
TEST_S = 60  # each test's absolute deadline


def within(seconds: float) -> Callable[[Test], Test]:
    """The test fails (TooSlowError, with where it waited) past `seconds`."""

    def wrap(test: Test) -> Test:
        @functools.wraps(test)
        async def run(*args: Any, **kwargs: Any) -> None:
            with trio.fail_after(seconds):
                await test(*args, **kwargs)

        return run

    return wrap


class Gate:
    """Closed: whatever passes it waits until it opens (a paused process's calls)."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def passed(self) -> None:
        while not self._open.is_set():
            await self._open.wait()


class HeldStream(WatchStream):
    """A watch whose events wait at a gate."""

    def __init__(self, inner: WatchStream, gate: Gate) -> None:  # the inner one reads
        self.inner = inner
        self.gate = gate

    async def __anext__(self) -> WatchEvent:
        event = await self.inner.__anext__()
        await self.gate.passed()
        return event


class PausableClient(EtcdClient):
    """An etcd client whose calls (`calls`) and watch events (`events`) can be held."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        super().__init__(endpoints, timeout_s=timeout_s)
        self.calls = Gate()
        self.events = Gate()

    async def grant(self, ttl_s: int) -> Lease:
        await self.calls.passed()
        return await super().grant(ttl_s)

    async def keepalive(self, lease_id: int) -> int:
        await self.calls.passed()
        return await super().keepalive(lease_id)

    async def revoke(self, lease_id: int) -> None:
        await self.calls.passed()
        await super().revoke(lease_id)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        await self.calls.passed()
        return await super().put(key, value, lease=lease)

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        await self.calls.passed()
        return await super().get_prefix(prefix)

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        await self.calls.passed()
        return await super().txn(compare, success, failure)

    @asynccontextmanager
    async def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[WatchStream]:
        async with super().watch(key, prefix=prefix, start_revision=start_revision) as stream:
            yield HeldStream(stream, self.events)


def store_of(endpoints: Sequence[str]) -> StoreSection:
    """A prefix of the test's own: the module's etcd is shared."""
    prefix = f"/t/{uuid.uuid4().hex}/"
    return StoreSection(endpoints=tuple(endpoints), prefix=prefix, lease_ttl_s=TTL_S)


def member(i: int, digest: str = "catalog-a") -> Member:
    return Member(f"cp-{i}", f"wss://127.0.0.1:{8440 + i}", digest, time.time())


@asynccontextmanager
async def elections(
    store: StoreSection,
    digests: Sequence[str],
    first: int = 0,
    timeout_s: float = 2.0,
    campaign_delay_s: Callable[[int], float] = lambda i: 0.0,
    keepalive_thread: bool = False,
    max_loop_stall_s: float = 10.0,
) -> AsyncIterator[list[Election]]:
    """An Election per digest, each on its own client, started (in order); the i-th
    holds its campaigns back `campaign_delay_s(i)`; with `keepalive_thread`, keepalives
    go from a thread of their own, as the seat has them (not paused with the client)."""
    clients = [PausableClient(store.endpoints, timeout_s) for _ in digests]

    def keepalive_client() -> EtcdClient:
        return EtcdClient(store.endpoints, timeout_s=timeout_s)

    try:
        async with trio.open_nursery() as nursery:
            found = []
            for i, digest in enumerate(digests):
                delay = functools.partial(campaign_delay_s, i)
                election = Election(
                    clients[i],
                    store,
                    member(first + i, digest),
                    delay,
                    keepalive_client=keepalive_client if keepalive_thread else None,
                    max_loop_stall_s=max_loop_stall_s,
                )
                await nursery.start(election.run)
                found.append(election)
            yield found
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 5):
            for c in clients:
                await c.aclose()


def client_of(election: Election) -> PausableClient:
    assert isinstance(election.client, PausableClient)
    return election.client


def acting(found: Sequence[Election]) -> list[Election]:
    return [e for e in found if e.may_act()]


async def until(condition: Callable[[], bool], timeout_s: float) -> float:
    """Polls `condition` until it holds; the seconds it took."""
    start = trio.current_time()
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(POLL_S)
    return trio.current_time() - start


async def one_leader(found: Sequence[Election], timeout_s: float = 10) -> Election:
    await until(lambda: len(acting(found)) == 1, timeout_s)
    (leader,) = acting(found)
    return leader


@within(TEST_S)
async def test_one_of_three_leads_and_keeps_leading(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.control")
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"] * 3) as found:
        leader = await one_leader(found)
        epoch = leader.standing.epoch
        assert leader.standing.leading and epoch > 0
        for e in found:
            if e is not leader:
                await until(lambda e=e: e.standing.leader == leader.me, 5)  # type: ignore[misc]
                assert not e.standing.leading and e.standing.epoch == epoch
                assert e.standing.why.startswith(f"leader {leader.me.id} at {leader.me.url}")
        assert sorted(m.id for m in await leader.members()) == ["cp-0", "cp-1", "cp-2"]
        # Over two lease lengths, renewed every half second: the same one, the same epoch.
        end = trio.current_time() + 2 * TTL_S
        while trio.current_time() < end:
            assert acting(found) == [leader] and leader.standing.epoch == epoch
            await trio.sleep(0.05)
        assert await leader.write({store.prefix.encode() + b"k": b"v"}, ())
        # No leadership changed without a fault: one began, none ended.
        lines = [r.getMessage() for r in caplog.records]
        assert [line for line in lines if "leads as epoch" in line] == [
            f"control plane {leader.me.id} leads as epoch {epoch}"
        ]
        assert not [line for line in lines if "stepped down" in line]


@within(TEST_S)
async def test_a_leader_woken_from_a_pause_past_its_lease_may_not_act(etcd: EtcdCluster) -> None:
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"]) as (leader,):
        await one_leader([leader])
        epoch = leader.standing.epoch
        # The whole process stops (as SIGSTOP or a VM freeze would stop it) past the
        # lease; the first thing it runs once woken is the fence, before any task.
        time.sleep(TTL_S + 0.2)
        assert not leader.may_act()
        await until(lambda: not leader.standing.leading or leader.standing.epoch != epoch, 1)
        await one_leader([leader])  # a new lease, a new campaign, a new epoch
        assert leader.standing.epoch > epoch


@within(TEST_S)
async def test_a_leader_whose_loop_stalls_past_its_lease_keeps_it_through_its_keepalive_thread(
    etcd: EtcdCluster,
) -> None:
    """A loop held up (a registration storm's ready tasks, a long step) is no fault: the
    keepalives go from their own thread, and the fence, read after the stall, counts
    from the answers that thread had. Without the thread the lease ends (the test
    above, a whole process paused)."""
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"], keepalive_thread=True) as (leader,):
        await one_leader([leader])
        epoch = leader.standing.epoch
        pacemaker = leader.pacemaker
        assert pacemaker is not None
        sent = pacemaker.sent
        time.sleep(TTL_S + 0.5)  # this loop stalls; the thread does not
        assert pacemaker.sent >= sent + 3  # every quarter of the TTL
        assert leader.may_act() and leader.standing.epoch == epoch
        await trio.sleep(TTL_S)
        assert leader.may_act() and leader.standing.epoch == epoch


@within(TEST_S)
async def test_a_wedged_loop_does_not_keep_its_lease_through_the_thread(etcd: EtcdCluster) -> None:
    """Past max_loop_stall_s without the loop checking in, the thread renews no more: a
    hung process cannot hold leadership through it."""
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"], keepalive_thread=True, max_loop_stall_s=1.0) as (
        leader,
    ):
        await one_leader([leader])
        epoch = leader.standing.epoch
        time.sleep(1.0 + TTL_S + 0.5)
        assert not leader.may_act()
        await until(lambda: not leader.standing.leading or leader.standing.epoch != epoch, 2)


@within(TEST_S)
async def test_a_resignation_hands_over_within_a_round_trip(etcd: EtcdCluster) -> None:
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"] * 3) as found:
        leader = await one_leader(found)
        others = [e for e in found if e is not leader]
        await until(lambda: all(e.standing.leader == leader.me for e in others), 5)
        old_epoch = leader.standing.epoch
        seen: list[Standing] = []

        async def follow(e: Election) -> None:
            while True:
                seen.append(await e.changed())

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, others[0])
            await trio.sleep(0.05)  # follow() waits in changed()
            nursery.start_soon(leader.resign)
            # From its first line (before any call to the store), it may not act.
            await until(lambda: leader.core.resigned, 1)
            assert not leader.may_act() and not leader.standing.leading
            took = await until(lambda: len(acting(others)) == 1, 5)
            await until(lambda: any(s.leader == acting(others)[0].me for s in seen), 5)
            nursery.cancel_scope.cancel()
        assert not leader.may_act()
        (new,) = acting(others)
        assert new.standing.epoch > old_epoch
        print(f"\nhandover after resign: {took * 1000:.0f} ms")
        # Within the target (1 s), and well within the lease (2 s): a handover
        # by the lease's end instead of the resignation fails here.
        assert trio.current_time() - start < 1.0
        # The resigned one never campaigns again, and is gone from the members.
        await until(lambda: leader.standing.leader == new.me, 5)
        with trio.fail_after(5):
            while sorted(m.id for m in await new.members()) != sorted(e.me.id for e in others):
                await trio.sleep(0.05)


@within(TEST_S)
async def test_a_standby_that_campaigns_first_wins_each_handover(etcd: EtcdCluster) -> None:
    """The seat holds back the campaigns of standbys that hold no stream, so that the
    one holding a lost leader's agents wins (seat._campaign_delay_s). Over three
    handovers among 4, 3 and 2 standbys, the one picked at random wins each time (by
    chance alone: 1 in 24)."""
    store = store_of(etcd.endpoints)
    preferred: list[int] = [-1]
    rng = random.Random()
    async with elections(
        store, ["catalog-a"] * 5, campaign_delay_s=lambda i: 0.0 if i == preferred[0] else 1.0
    ) as found:
        leader = await one_leader(found)
        standbys = [e for e in found if e is not leader]
        for _ in range(3):
            me = leader.me
            await until(lambda: all(e.standing.leader == me for e in standbys), 5)  # noqa: B023
            # The losers' campaigns of the last handover have ended: one still waiting out
            # its delay would fire into the next election (rightly: nobody leads then).
            await until(lambda: not any(e.core.campaigning for e in standbys), 5)
            pick = rng.choice(standbys)
            preferred[0] = found.index(pick)
            await leader.resign()
            winner = await one_leader(standbys, 5)
            assert winner is pick, (winner.me.id, pick.me.id)
            standbys.remove(winner)
            leader = winner


@within(TEST_S)
async def test_a_gone_leaders_term_ended_in_the_store_hands_over_before_its_lease_ends(
    etcd: EtcdCluster,
) -> None:
    """A standby that knows the leader's process is gone (leader_gone) deposes it: the
    leader key goes by a guarded delete, and another leads within a round trip rather
    than at the lease's end. A depose naming another leadership does nothing."""
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"] * 3) as found:
        leader = await one_leader(found)
        others = [e for e in found if e is not leader]
        await until(lambda: all(e.standing.leader == leader.me for e in others), 5)
        epoch = leader.standing.epoch
        assert not await others[0].depose(epoch - 1, leader.me.id)  # a stale view: nothing
        await trio.sleep(0.2)
        assert acting(found) == [leader]
        # The leader's process dies: its calls to the store stop, its lease lives on.
        client_of(leader).calls.close()
        client_of(leader).events.close()
        start = trio.current_time()
        assert await others[0].depose(epoch, leader.me.id)
        took = await until(lambda: len(acting(others)) == 1, 5)
        print(f"\nhandover after depose: {took * 1000:.0f} ms")
        (new,) = acting(others)
        assert new.standing.epoch > epoch
        # Well before the dead leader's lease would have ended (2 s from its last renewal),
        # and it is no longer listed among the control planes.
        assert trio.current_time() - start < TTL_S * 0.75
        assert leader.me.id not in {m.id for m in await new.members()}
        client_of(leader).calls.open()
        client_of(leader).events.open()


@within(TEST_S)
async def test_a_leader_that_stops_renewing_loses_its_fence_before_another_wins(
    etcd: EtcdCluster,
) -> None:
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"] * 3) as found:
        leader = await one_leader(found)
        others = [e for e in found if e is not leader]
        lease = leader.core.lease
        assert lease is not None
        # Paused: nothing it sends reaches the store, nothing the store sends reaches it.
        client_of(leader).calls.close()
        client_of(leader).events.close()
        paused_at = trio.current_time()
        fence_lost_at = new_at = None
        with trio.fail_after(3 * TTL_S + 5):
            while new_at is None:
                now = trio.current_time()
                if fence_lost_at is None and not leader.may_act():
                    fence_lost_at = now
                if acting(others):
                    new_at = now
                    assert fence_lost_at is not None, "a new leader while the old may act"
                await trio.sleep(POLL_S)
        assert fence_lost_at is not None and fence_lost_at <= lease.deadline + 0.1
        assert not leader.standing.leading  # stepped down at its deadline
        print(
            f"\nleader paused: fence lost after {fence_lost_at - paused_at:.2f} s,"
            f" a new leader after {new_at - paused_at:.2f} s"
            f" ({new_at - fence_lost_at:.2f} s after the fence)"
        )
        # Woken: it may not act, and a write of its sends nothing and lands nothing.
        client_of(leader).calls.open()
        client_of(leader).events.open()
        key = store.prefix.encode() + b"written-after"
        assert not await leader.write({key: b"stale"}, ())
        assert await acting(others)[0].client.get(key) is None
        (new,) = acting(others)
        await until(lambda: leader.standing.leader == new.me, 5)


@within(TEST_S)
async def test_a_guarded_write_after_the_key_is_gone_fails_and_writes_nothing(
    etcd: EtcdCluster,
) -> None:
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"]) as (leader,):
        await one_leader([leader])
        epoch = leader.standing.epoch
        # The leader has not heard yet (its watch is held) that the key was deleted.
        client_of(leader).events.close()
        await leader.client.delete(leader.leader_key)
        assert leader.may_act()
        key = store.prefix.encode() + b"guarded"
        assert not await leader.write({key: b"x"}, [store.prefix.encode() + b"other"])
        assert await leader.client.get(key) is None
        assert not leader.may_act() and not leader.standing.leading
        assert leader.standing.why != f"leading (epoch {epoch})"
        client_of(leader).events.open()
        await one_leader([leader])  # with the key gone, it campaigns again
        assert leader.standing.epoch > epoch


@within(TEST_S)
async def test_a_large_write_goes_in_guarded_chunks(etcd: EtcdCluster) -> None:
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"]) as (leader,):
        await one_leader([leader])
        prefix = store.prefix.encode() + b"many/"
        puts = {prefix + b"%04d" % i: b"v" for i in range(2 * MAX_TXN_OPS + 7)}
        assert await leader.write(puts, ())
        kvs, _ = await leader.client.get_prefix(prefix)
        assert len(kvs) == len(puts)
        assert await leader.write({}, list(puts))
        kvs, _ = await leader.client.get_prefix(prefix)
        assert kvs == []


@within(TEST_S)
async def test_a_standby_of_another_catalog_never_leads_while_the_leader_lives(
    etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "llmgw.control")
    store = store_of(etcd.endpoints)
    async with elections(store, ["catalog-a"]) as (leader,):
        await one_leader([leader])
        async with elections(store, ["catalog-b", "catalog-a"], first=1) as (odd, same):
            await until(lambda: odd.standing.leader == leader.me, 5)
            assert "catalog digest catalog-b differs from the leader's catalog-a" in (
                odd.standing.why
            )
            end = trio.current_time() + 2 * TTL_S
            while trio.current_time() < end:
                assert acting([leader, odd, same]) == [leader]
                await trio.sleep(0.05)
            lines = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
            assert len(lines) == 1, lines  # once per change, not per read
            assert "cp-0's catalog-a" in lines[0]
        assert leader.may_act()


@within(TEST_S)
async def test_etcd_stopped_the_leader_steps_down_by_its_deadline_and_back_one_leads(
    etcd3: EtcdCluster,
) -> None:
    store = store_of(etcd3.endpoints)
    async with elections(store, ["catalog-a"] * 3) as found:
        leader = await one_leader(found)
        lease = leader.core.lease
        assert lease is not None
        stopped_at = trio.current_time()
        await trio.to_thread.run_sync(etcd3.stop_all)
        deadline = lease.deadline
        await until(lambda: not leader.standing.leading, 3 * TTL_S + 5)
        stepped_down_at = trio.current_time()
        # By its deadline, as last renewed before the stop (a poll's time late at most).
        assert not leader.may_act() and stepped_down_at <= max(deadline, stopped_at) + TTL_S
        assert acting(found) == []
        for e in found:
            await until(lambda e=e: not e.standing.store_ok, 5)  # type: ignore[misc]
            assert e.standing.why.startswith("the store is unreachable: "), e.standing.why
        print(f"\netcd stopped: the leader stepped down after {stepped_down_at - stopped_at:.2f} s")
        await trio.to_thread.run_sync(etcd3.start_all)
        back_at = trio.current_time()
        await one_leader(found, timeout_s=30)
        print(f"etcd back: a leader after {trio.current_time() - back_at:.2f} s")
        await until(lambda: all(e.standing.store_ok for e in found), 5)


@within(TEST_S)
@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_one_etcd_member_lost_changes_no_leadership(etcd3: EtcdCluster, fault: str) -> None:
    """The member every client prefers (the first) killed, or stopped as a lost host is
    (SIGSTOP: nothing answers, nothing is refused). Each call's timeout on an endpoint is a
    quarter of the lease, so that a renewal fails over to another member in time: with
    etcd's 2 s default a silent member costs a 2 s lease."""
    # A member that follows in etcd's raft, made the one every client prefers (the
    # first): losing etcd's own leader costs an election of etcd's (1 s of timeout and
    # more on a busy machine), which a 2 s lease need not outlive.
    client = EtcdClient(etcd3.endpoints)
    try:
        statuses = await client.status()
    finally:
        await client.aclose()
    follower = next(st.url for st in statuses if st.ok and not st.leader)
    lost = list(etcd3.endpoints).index(follower)
    endpoints = list(etcd3.endpoints)
    endpoints.insert(0, endpoints.pop(lost))
    store = store_of(endpoints)
    async with elections(store, ["catalog-a"] * 3, timeout_s=TTL_S / 4) as found:
        leader = await one_leader(found)
        epoch = leader.standing.epoch
        if fault == "killed":
            await trio.to_thread.run_sync(etcd3.kill, lost)
        else:
            etcd3._signal(lost, signal.SIGSTOP)  # (EtcdCluster has no pause of its own)
        try:
            end = trio.current_time() + 3 * TTL_S
            while trio.current_time() < end:
                assert acting(found) == [leader] and leader.standing.epoch == epoch
                await trio.sleep(0.02)
        finally:
            if fault == "stopped":
                etcd3._signal(lost, signal.SIGCONT)
