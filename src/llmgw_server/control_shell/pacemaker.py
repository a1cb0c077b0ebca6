"""A lease's keepalives sent from a thread of their own.

A leader's event loop also serves a fleet: a registration storm (a failover's thousand
TLS handshakes and registrations) kept a keepalive waiting 1.2-1.7 s behind ready tasks,
and with a 2 s lease the leader lost leadership with no fault at all (the failover bench,
machine loaded 5-7). Here the keepalives run in a thread with its own trio loop and its
own store client, nearly idle, so that they go out on time whatever the main loop does;
the answers wait in a queue that the election reads before each use of the fence
(`Election.may_act`) and each tick, so that a late main loop sees its lease as etcd holds
it, never longer: the fence still counts from when an answered keepalive was sent.

A main loop that stops checking in (a wedged process) must not hold leadership through
its thread: past `max_stall_s` without a check-in the thread sends nothing, and the lease
ends. A stopped process (SIGSTOP, a VM pause) stops this thread with it.

Times cross between the loops as `time.perf_counter()` readings (trio's system clock is
that plus a fixed offset per run)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import attrs
import trio

from llmgw_server.store.etcd import EtcdClient, StoreError

log = logging.getLogger("llmgw.control")


@attrs.frozen
class KeepaliveAnswer:
    """One keepalive: sent at `sent_at` and answered (or failed) at `answered_at`
    (perf_counter), `ttl_left` (0: the lease is gone), or None with `why` when it
    failed."""

    lease_id: int
    sent_at: float
    answered_at: float
    ttl_left: int | None
    why: str = ""


class Pacemaker:
    """The thread that renews the lease the election holds (`hold`), every `interval_s`
    and at once when asked (`renew_now`), while the main loop checks in."""

    def __init__(
        self,
        make_client: Callable[[], EtcdClient],
        interval_s: float,
        max_stall_s: float,
        answered: Callable[[], None],
    ) -> None:
        self._make_client = make_client
        self.interval_s = interval_s
        self.max_stall_s = max_stall_s
        self._answered = answered  # called in the thread after each answer (thread-safe)
        self.answers: queue.SimpleQueue[KeepaliveAnswer] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._asked = False
        self._checked_in = time.perf_counter()
        self._stopping = False
        self._token: trio.lowlevel.TrioToken | None = None  # the thread's loop
        self._wake: trio.Event | None = None  # the thread's loop waits on it
        self._thread: threading.Thread | None = None
        self.sent = 0

    # -- the main loop's side -----------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="llmgw-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (join it from a worker thread: `join`)."""
        with self._lock:
            self._stopping = True
        self._poke()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def hold(self, lease_id: int | None) -> None:
        """The lease to renew from now on (None: none)."""
        with self._lock:
            changed = self._lease != lease_id
            self._lease = lease_id
        if changed:
            self._poke()

    def renew_now(self, lease_id: int) -> None:
        with self._lock:
            if self._lease != lease_id:
                return
            self._asked = True
        self._poke()

    def check_in(self) -> None:
        """The main loop runs (called at each tick and each use of the fence)."""
        self._checked_in = time.perf_counter()

    def drain(self) -> list[KeepaliveAnswer]:
        out = []
        while True:
            try:
                out.append(self.answers.get_nowait())
            except queue.Empty:
                return out

    def _poke(self) -> None:
        """Have the thread look at what changed (before its loop runs, it looks anyway)."""
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._woken)
            except trio.RunFinishedError:
                pass

    def _woken(self) -> None:  # in the thread's loop
        if self._wake is not None:
            self._wake.set()

    # -- the thread's side ---------------------------------------------------------

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except Exception:  # a crash here must not pass silently: the lease would end
            log.exception("the lease's keepalive thread failed")

    async def _run(self) -> None:
        self._wake = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        client = self._make_client()
        try:
            last_sent = -float("inf")
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    lease, asked = self._lease, self._asked
                    self._asked = False
                now = time.perf_counter()
                stalled = now - self._checked_in > self.max_stall_s
                due = lease is not None and (asked or now >= last_sent + self.interval_s)
                if due and not stalled:
                    assert lease is not None
                    last_sent = now
                    await self._send(client, lease)
                    continue
                wait = self.interval_s if lease is None else last_sent + self.interval_s - now
                with trio.move_on_after(max(0.01, min(wait, self.interval_s))):
                    await self._wake.wait()
                self._wake = trio.Event()
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _send(self, client: EtcdClient, lease_id: int) -> None:
        sent_at = time.perf_counter()
        self.sent += 1
        try:
            with trio.fail_after(max(self.interval_s * 2, 0.5)):
                ttl_left: int | None = await client.keepalive(lease_id)
            why = ""
        except StoreError as exc:
            ttl_left, why = None, str(exc)
        except trio.TooSlowError:
            ttl_left, why = None, "a keepalive had no answer in time"
        answer = KeepaliveAnswer(lease_id, sent_at, time.perf_counter(), ttl_left, why)
        self.answers.put(answer)
        self._answered()
