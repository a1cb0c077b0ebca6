"""The election of one control plane among several sharing a store: the trio shell over
the pure rules (control/leadership.py) and the store's client (store/etcd.py).

Keys, under `[control.store] prefix`:
- `members/{id}`: each control plane's Member (JSON), under its lease: the live ones.
- `leader`: the leader's LeaderRecord (JSON), under its lease, created by a transaction
  that succeeds only while the key does not exist. Its create revision is the epoch.

Standbys watch the leader key and campaign when it is deleted (a resignation, or the
leader's lease ending): the transaction decides, so no jitter is needed. Every write the
leader makes (`write`) is a transaction guarded by the leader key's create revision, so
that none lands once the leadership ended; `may_act` is the fence every command and table
passes before it is sent (see leadership.py for the deadline it reads).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

import attrs
import cattrs
import trio

from llmgw_core.store_config import StoreSection
from llmgw_core.wire import converter
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
from llmgw_server.control_shell.pacemaker import Pacemaker
from llmgw_server.store.etcd import Compare, EtcdClient, KeyValue, Op, StoreError

__all__ = ["MAX_TXN_OPS", "Election", "Member", "Standing"]

log = logging.getLogger("llmgw.control")

# The operations of one guarded write's transaction: etcd refuses more than its
# --max-txn-ops (128 by default); a larger write goes in several, each guarded.
MAX_TXN_OPS = 100
# What a withdrawal or a revocation may take when resigning: the process is stopping.
_RESIGN_S = 2.0
# A main loop that has not checked in with the keepalive thread for this long (or half a
# lease's TTL, if longer) is wedged: the thread stops renewing and the lease ends, so a
# hung process cannot keep leadership. Longer than any stall a busy machine gives a loop.
_MAX_LOOP_STALL_S = 10.0
# What a leader key that is not a LeaderRecord counts as (a person's put, another
# version): a leader, so that nobody campaigns, named as such.
_UNREADABLE = Member("(unreadable leader key)", "", "", 0.0)


@attrs.frozen
class Standing:
    """Where this control plane stands, for status and for the seat."""

    leading: bool
    epoch: int  # this leadership's, or the leader's (0: none known)
    leader: Member | None
    since: float | None  # wall time the leadership began
    why: str
    store_ok: bool


def encode(value: Member | LeaderRecord) -> bytes:
    return json.dumps(converter.unstructure(value), separators=(",", ":")).encode()


def decode_member(data: bytes) -> Member | None:
    try:
        return converter.structure(json.loads(data), Member)
    except (ValueError, TypeError, KeyError, cattrs.BaseValidationError):
        return None


def decode_record(data: bytes) -> LeaderRecord | None:
    try:
        return converter.structure(json.loads(data), LeaderRecord)
    except (ValueError, TypeError, KeyError, cattrs.BaseValidationError):
        return None


def _soon(token: trio.lowlevel.TrioToken, callback: Callable[[], None]) -> None:
    """Run `callback` in the loop of `token`, from any thread (once it runs no more)."""
    try:
        token.run_sync_soon(callback)
    except trio.RunFinishedError:
        pass


def _chunks(ops: list[Op], size: int) -> list[list[Op]]:
    return [ops[i : i + size] for i in range(0, len(ops), size)]


class Election:
    def __init__(
        self,
        client: EtcdClient,
        store: StoreSection,
        me: Member,
        campaign_delay_s: Callable[[], float] = lambda: 0.0,
        keepalive_client: Callable[[], EtcdClient] | None = None,
        max_loop_stall_s: float = _MAX_LOOP_STALL_S,
    ) -> None:
        self.client = client
        # Given a way to make a second client, the lease's keepalives go from a thread
        # of their own (pacemaker.py); without it, from this loop.
        self._keepalive_client = keepalive_client
        self.max_loop_stall_s = max_loop_stall_s
        self.pacemaker: Pacemaker | None = None
        self.store = store
        self.me = me
        # How long to hold a campaign back, asked at each: a standby that holds the
        # fleet's streams campaigns first (seat.py), so that the winner is the one with
        # the agents already connected to it. Safety is the transaction's, never this.
        self.campaign_delay_s = campaign_delay_s
        # etcd's TTLs are whole seconds (and it may grant more: its minimum lease).
        self.ttl_s = math.ceil(store.lease_ttl_s)
        self.core = Leadership(me, self.ttl_s)
        prefix = store.prefix.encode()
        self.leader_key = prefix + b"leader"
        self.members_prefix = prefix + b"members/"
        self.standing = Standing(False, 0, None, None, "the election has not started", True)
        self._changed = trio.Event()
        self._known = trio.Event()  # the first standing is known
        self._nursery: trio.Nursery | None = None
        self._tick = trio.CancelScope()
        self._watch: trio.CancelScope | None = None
        self._unreadable_noted = False

    # -- what others read --------------------------------------------------------

    def may_act(self) -> bool:
        """The fence: this control plane leads, and its lease cannot have ended."""
        self._absorb()
        return self.core.may_act(trio.current_time())

    async def changed(self) -> Standing:
        """The standing after its next change (leading, epoch or leader)."""
        await self._changed.wait()
        return self.standing

    async def members(self) -> list[Member]:
        """The live control planes (those whose lease lives), in id order."""
        kvs, _ = await self.client.get_prefix(self.members_prefix)
        found = (decode_member(kv.value) for kv in kvs)
        return [m for m in found if m is not None]

    # -- running -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold a lease, keep the member record, campaign and watch, until cancelled;
        `started()` once the first standing is known (leading, a standby, or the store
        unreachable)."""
        pacemaker = None
        if self._keepalive_client is not None:
            token = trio.lowlevel.current_trio_token()
            pacemaker = Pacemaker(
                self._keepalive_client,
                interval_s=self.ttl_s / 4,
                max_stall_s=max(self.max_loop_stall_s, self.ttl_s / 2),
                answered=lambda: _soon(token, self._absorb),
            )
            pacemaker.start()
            self.pacemaker = pacemaker
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._watch_loop)
                nursery.start_soon(self._tick_loop)
                await self._known.wait()
                task_status.started()
        finally:
            if pacemaker is not None:
                pacemaker.stop()
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(pacemaker.join, _RESIGN_S)

    async def _tick_loop(self) -> None:
        self._absorb()
        self._apply(self.core.tick(trio.current_time()))
        while True:
            self._tick = trio.CancelScope(deadline=self.core.next_wake())
            with self._tick:
                await trio.sleep_forever()
            self._absorb()
            self._apply(self.core.tick(trio.current_time()))

    def _absorb(self) -> None:
        """Take the keepalives the thread had answered (pacemaker.py), before the fence or
        the time is read: a late loop sees its lease as etcd holds it."""
        pacemaker = self.pacemaker
        if pacemaker is None or self._nursery is None:
            return
        pacemaker.check_in()
        for answer in pacemaker.drain():
            # Each taken as of when it was answered, in order: a stalled loop takes several
            # at once, and the time it reads only after them all.
            offset = trio.current_time() - time.perf_counter()
            sent_at, at = answer.sent_at + offset, answer.answered_at + offset
            if answer.ttl_left is None:
                actions = self.core.keepalive_failed(answer.lease_id, at, answer.why)
            else:
                actions = self.core.keepalive_answered(
                    answer.lease_id, sent_at, answer.ttl_left, at
                )
            self._apply(actions)

    def _apply(self, actions: list[Action]) -> None:
        """Carry out the core's actions, then publish the standing they left."""
        nursery = self._nursery
        assert nursery is not None
        for action in actions:
            if isinstance(action, Grant):
                nursery.start_soon(self._grant)
            elif isinstance(action, Renew):
                if self.pacemaker is not None:
                    self.pacemaker.renew_now(action.lease_id)
                else:
                    nursery.start_soon(self._renew, action.lease_id)
            elif isinstance(action, Campaign):
                nursery.start_soon(self._campaign, action.lease_id)
            elif isinstance(action, Withdraw):
                nursery.start_soon(self._withdraw, action.epoch)
            elif isinstance(action, Revoke):
                nursery.start_soon(self._revoke, action.lease_id)
            elif isinstance(action, Lead):
                log.info("control plane %s leads as epoch %d", self.me.id, action.epoch)
            elif isinstance(action, StepDown):
                log.warning(
                    "control plane %s stepped down (epoch %d): %s",
                    self.me.id,
                    action.epoch,
                    action.why,
                )
            elif isinstance(action, Note):
                log.warning("%s", action.line)
        self._publish()

    def _publish(self) -> None:
        core = self.core
        self._tick.deadline = core.next_wake()
        if self.pacemaker is not None:
            self.pacemaker.hold(core.lease.id if core.lease is not None else None)
        if not core.leader_known and self._watch is not None:
            self._watch.cancel()  # read the key afresh (the store failed somewhere)
        leading = core.phase is Phase.LEADING
        record = core.leader
        standing = Standing(
            leading=leading,
            epoch=core.epoch if leading else (core.leader_epoch if record else 0),
            leader=record.member if record is not None else None,
            since=record.since if record is not None else None,
            why=core.why(),
            store_ok=core.store_ok,
        )
        before = self.standing
        self.standing = standing
        if (standing.leading, standing.epoch, standing.leader) != (
            before.leading,
            before.epoch,
            before.leader,
        ):
            self._changed.set()
            self._changed = trio.Event()
        if leading or (record is not None and core.lease is not None) or not core.store_ok:
            self._known.set()

    # -- the lease

    async def _grant(self) -> None:
        sent_at = trio.current_time()
        try:
            lease = await self.client.grant(self.ttl_s)
        except StoreError as exc:
            self._apply(self.core.grant_failed(trio.current_time(), str(exc)))
            return
        try:
            member_key = self.members_prefix + self.me.id.encode()
            await self.client.put(member_key, encode(self.me), lease=lease.id)
        except StoreError as exc:
            self._apply(self.core.grant_failed(trio.current_time(), str(exc)))
            await self._revoke(lease.id)
            return
        self._apply(self.core.lease_granted(lease.id, lease.ttl_s, sent_at, trio.current_time()))

    async def _renew(self, lease_id: int) -> None:
        sent_at = trio.current_time()
        lease = self.core.lease
        # An answer after the lease's end comes too late to be of use: the fence has
        # stepped this control plane down already.
        deadline = lease.deadline if lease is not None and lease.id == lease_id else sent_at
        ttl_left: int | None = None
        why = "a keepalive had no answer before the lease's end"
        try:
            with trio.move_on_at(deadline):
                ttl_left = await self.client.keepalive(lease_id)
        except StoreError as exc:
            why = str(exc)
        now = trio.current_time()
        if ttl_left is None:
            self._apply(self.core.keepalive_failed(lease_id, now, why))
        else:
            self._apply(self.core.keepalive_answered(lease_id, sent_at, ttl_left, now))

    async def _revoke(self, lease_id: int) -> None:
        with trio.move_on_after(_RESIGN_S):
            try:
                await self.client.revoke(lease_id)
            except StoreError as exc:
                log.debug("revoking lease %x: %s (it ends by itself)", lease_id, exc)

    # -- the leader key

    async def _campaign(self, lease_id: int) -> None:
        delay = self.campaign_delay_s()
        if delay > 0:
            await trio.sleep(delay)
        record = LeaderRecord(self.me, since=time.time())
        key = self.leader_key
        try:
            result = await self.client.txn(
                [Compare.version(key, 0)],
                [Op.put(key, encode(record), lease=lease_id)],
                [Op.get(key)],
            )
        except StoreError as exc:
            self._apply(self.core.campaign_failed(trio.current_time(), str(exc)))
            return
        now = trio.current_time()
        if result.succeeded:
            # The key was created by this transaction: its create revision is the txn's.
            self._apply(self.core.campaign_won(lease_id, record, result.revision, now))
            return
        found = result.responses[0] if result.responses else ()
        if not found:
            self._apply(self.core.campaign_failed(now, "the leader key vanished mid-campaign"))
            return
        kv = found[0]
        held = self._record(kv)
        self._apply(
            self.core.campaign_lost(held, kv.create_revision, kv.lease, result.revision, now)
        )

    async def _withdraw(self, epoch: int) -> None:
        """Delete the leader key while it is still the one of `epoch`."""
        with trio.move_on_after(_RESIGN_S):
            try:
                await self.client.txn(
                    [Compare.create_revision(self.leader_key, epoch)], [Op.delete(self.leader_key)]
                )
            except StoreError as exc:
                log.debug("withdrawing epoch %d: %s (it ends with the lease)", epoch, exc)

    def _record(self, kv: KeyValue) -> LeaderRecord:
        record = decode_record(kv.value)
        if record is not None:
            self._unreadable_noted = False
            return record
        if not self._unreadable_noted:
            self._unreadable_noted = True
            log.warning(
                "the leader key %s holds what is not a leader record (%d bytes): no control"
                " plane campaigns until it is deleted",
                self.leader_key.decode(errors="replace"),
                len(kv.value),
            )
        return LeaderRecord(_UNREADABLE, 0.0)

    async def _watch_loop(self) -> None:
        """Read the leader key, then follow it by watch; afresh after any failure."""
        while True:
            try:
                with trio.CancelScope() as scope:
                    await self._read_and_watch(scope)
            except StoreError as exc:
                self._watch = None
                self._apply(self.core.store_failed(trio.current_time(), str(exc)))
                await trio.sleep(self.core.retry_s)
            self._watch = None

    async def _read_and_watch(self, scope: trio.CancelScope) -> None:
        kvs, revision = await self.client.get_prefix(self.leader_key)
        now = trio.current_time()
        kv = next((kv for kv in kvs if kv.key == self.leader_key), None)
        if kv is None:
            self._apply(self.core.leader_gone(revision, now))
        else:
            record = self._record(kv)
            self._apply(self.core.leader_seen(record, kv.create_revision, kv.lease, revision, now))
        self._watch = scope  # from here, a failure elsewhere makes it read afresh
        async with self.client.watch(self.leader_key, start_revision=revision + 1) as events:
            async for event in events:
                now = trio.current_time()
                if event.kind == "delete":
                    self._apply(self.core.leader_gone(event.revision, now))
                else:
                    kv = event.kv
                    record = self._record(kv)
                    self._apply(
                        self.core.leader_seen(
                            record, kv.create_revision, kv.lease, event.revision, now
                        )
                    )

    # -- what the leader does --------------------------------------------------------

    async def write(self, puts: Mapping[bytes, bytes], deletes: Iterable[bytes]) -> bool:
        """Write while this leadership lasts: each transaction (MAX_TXN_OPS operations at
        most) is guarded by the leader key's create revision being this epoch. False
        (and this control plane steps down) when the guard fails or the fence refuses;
        StoreError when the store is away. A write of several transactions that fails
        midway leaves its first ones written."""
        ops = [Op.put(k, v) for k, v in puts.items()] + [Op.delete(k) for k in deletes]
        epoch = self.core.epoch
        for chunk in _chunks(ops, MAX_TXN_OPS) or [[]]:
            if not self.may_act():
                return False
            result = await self.client.txn([Compare.create_revision(self.leader_key, epoch)], chunk)
            if not result.succeeded:
                self._apply(self.core.fence_failed(epoch, trio.current_time()))
                return False
        return True

    async def depose(self, epoch: int, member_id: str) -> bool:
        """End the leadership of `epoch` in the store, for a leader whose process is known
        to be gone: its leader key and its member record (`member_id`) deleted by a
        transaction that does nothing when another leadership holds the key (its lease
        ends by itself). The standbys' watches see the key go and campaign at once,
        instead of at the lease's end. StoreError when the store is away."""
        member_key = self.members_prefix + member_id.encode()
        result = await self.client.txn(
            [Compare.create_revision(self.leader_key, epoch)],
            [Op.delete(self.leader_key), Op.delete(member_key)],
            [],
        )
        return result.succeeded

    async def resign(self) -> None:
        """Stop leading at once and for good (SIGTERM): `may_act` is False from the first
        line; then the leader key is deleted (guarded by this epoch) and the lease revoked,
        so that a standby's watch sees the delete and one of them wins in a round trip."""
        actions = self.core.resign(trio.current_time())
        for action in actions:
            if isinstance(action, StepDown):
                log.warning("control plane %s resigned (epoch %d)", self.me.id, action.epoch)
        self._publish()
        for action in actions:
            if isinstance(action, Withdraw):
                await self._withdraw(action.epoch)
            elif isinstance(action, Revoke):
                await self._revoke(action.lease_id)
