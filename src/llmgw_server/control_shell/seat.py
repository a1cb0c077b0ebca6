"""A control plane among several that share a store (`[control.store]`): its seat.

Every control plane of a fleet runs the same config; each keeps its control port open,
and the election (election.py, over etcd) says which one leads. The seat owns, for this
process, the port, the election, and while it leads a *term*: a ControlPlane of that
leadership's epoch, built as at a restart (agents register again and their engines are
adopted) from where the last leader stopped (its stored state), and dropped whole when
the leadership ends. Between terms the port answers as a standby (standby.py).

A term ends when the election says so (the lease could not be renewed, a guarded write
failed, a resignation): from that instant the plane's fence (`Election.may_act`) refuses
every command and table, then its agent streams and route feeds are closed so that every
peer looks for the next leader, and its tasks are cancelled.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

import attrs
import trio

from llmgw_core.bearer import bearer_digest
from llmgw_core.catalog import Catalog
from llmgw_core.config import Config
from llmgw_core.store_config import StoreSection
from llmgw_http.server import Request, Responder
from llmgw_server.control.documents import ControlDoc, ControlPlaneDoc
from llmgw_server.control.hello_answer import (
    COME_BACK,
    HandshakeBudget,
    HelloAnswer,
    HelloStanding,
    LeaderChecks,
    answer_hello,
)
from llmgw_server.control.persisted import Keeper
from llmgw_server.control_shell.admin import AdminAPI
from llmgw_server.control_shell.agents import AGENT_PATH
from llmgw_server.control_shell.controlplane import HEARTBEAT_INTERVAL_S, ControlPlane
from llmgw_server.control_shell.election import Election, Member, Standing
from llmgw_server.control_shell.leader_gone import RECHECK_S, refuses_connections
from llmgw_server.control_shell.port import open_control_listeners, serve_control_listeners
from llmgw_server.control_shell.seat_metrics import SeatMetrics
from llmgw_server.control_shell.standby import StandbyAnswers
from llmgw_server.control_shell.store_writes import StoreWrites
from llmgw_server.reload import ReloadPlan
from llmgw_server.route_feed.hub import ROUTES_PATH
from llmgw_server.store.etcd import EtcdClient, StoreError

log = logging.getLogger("llmgw.control")

PEER_TOKEN_KEY = b"peer_token"
STATE_PREFIX = b"state/"  # what the leader keeps (control.persisted), under the prefix
# How long a term's end waits for its agents' close frames before cutting what is left.
_STREAMS_CLOSE_S = 1.0
# How long a resignation may take (the store away): past it, the lease ends on its own.
_RESIGN_S = 3.0
_RETRY_S = 0.2
_HOLD_S = 8.0  # the longest a standby holds a stream for the election
# A standby holding no stream campaigns this much later than one that holds some. A lost
# leader's agents all dial the control plane after it in their list and are held there;
# when that one wins, it serves them on the connections they hold (StandbyAnswers), where
# another winner would have the whole fleet dial it again (measured at 1,000 agents:
# every agent on the new leader 6.1-7.3 s after a SIGKILL, with half the fleet's
# registrations 2.8 s behind its election).
_CAMPAIGN_DEFER_S = 0.25
_MEMBERS_S = 1.0  # status waits this long for the store's list of control planes
# How long an agent's hello that lost its leader waits for the election before it is told
# to come back (under the port's ANSWER_WAIT_S), and how many wait at once (each a socket
# and a task; past that, told at once).
_ANSWER_HOLD_S = 2.0
_ANSWERS_HELD_MAX = 16384
_LOST_HELLOS_RECENT_S = 2.0  # hellos of agents that lost their leader this recent: campaign


def catalog_digest(config: Config) -> str:
    """What two control planes must agree on to lead the same fleet: the catalog."""
    return hashlib.sha256(repr(config.catalog).encode()).hexdigest()[:16]


def advertised_url(config: Config, port: int) -> str:
    """This control plane's URL as its peers dial it: `[control.store] advertise`, else
    control_listen's host and the port it listens on."""
    store = config.control.store
    if store is not None and store.advertise:
        return store.advertise
    host = config.server.control_listen.host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"{'ws' if config.agents.insecure else 'wss'}://{host}:{port}"


@attrs.frozen
class Leadership:
    """What the port's standby answers and the in-process router read of the election."""

    leading: bool
    leader_url: str | None
    why: str
    epoch: int


class Seat:
    def __init__(self, config: Config, reload: Callable[[], Awaitable[ReloadPlan]] | None) -> None:
        assert config.control.store is not None
        self.config = config
        self.store: StoreSection = config.control.store
        self.reload = reload
        self.metrics = SeatMetrics()
        self.plane: ControlPlane | None = None  # while this process leads
        self._admin: AdminAPI | None = None
        # A stream with no leader to name is held for the election: within the agent's
        # wait for its welcome (10 s), and about a lease (the longest an election takes).
        hold_s = min(_HOLD_S, self.store.lease_ttl_s + 1.0)
        self.standby = StandbyAnswers(
            self.leadership,
            self.metrics_page,
            self.changed,
            hold_s,
            adopt=self._adopt,
            here=lambda: self.url,
            suspect=self._suspect,
        )
        self.election: Election | None = None
        self.client: EtcdClient | None = None
        self.url = ""
        self.port = 0
        # The route feed of each term accepts the token its leader put in the store, so
        # that every control plane's own router follows the leader (peers share the store).
        self._peer_digest: str | None = None
        self._term: trio.CancelScope | None = None
        self._streams: set[trio.CancelScope] = set()  # each upgraded stream of the term
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.closing = False
        self._leader_checks = LeaderChecks(RECHECK_S)  # of the leader the store names
        self.deposed = 0  # leaderships this control plane ended in the store (leader_gone)
        self._lost_hello_at = float("-inf")  # the last hello of an agent that lost its leader
        self._answers_held = 0  # such hellos waiting for the election (_answer_agent)
        self.handshakes = HandshakeBudget()  # given to them at once, per lost epoch

    # -- what others read ------------------------------------------------------

    def leadership(self) -> Leadership:
        standing = self.election.standing if self.election is not None else None
        if standing is None:
            return Leadership(False, None, "the election has not started", 0)
        leader = standing.leader
        # Only a leader the store vouches for now, and not this one (it stepped down).
        named = leader is not None and standing.store_ok and leader.url != self.url
        url = leader.url if named and leader is not None and not standing.leading else None
        return Leadership(self.plane is not None, url, standing.why, standing.epoch)

    async def changed(self) -> None:
        """Wait until this seat's leadership changes (it leads, or another does)."""
        await self._changed.wait()

    async def peer_token(self) -> str | None:
        """The token the leader's route feed takes from control planes, from the store."""
        if self.client is None:
            return None
        found = await self.client.get(self.store.prefix.encode() + PEER_TOKEN_KEY)
        return None if found is None else found.value.decode()

    # -- running -----------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the store's client, the election and the port (and each term) until
        cancelled; `started()` with the control port once it listens."""
        listeners = await open_control_listeners(self.config)
        self.port = listeners[0].socket.getsockname()[1]
        self.url = advertised_url(self.config, self.port)
        me = Member(
            id=secrets.token_hex(4),
            url=self.url,
            catalog_digest=catalog_digest(self.config),
            started_at=time.time(),
        )
        # A renewal sent to a silent member must fail over to another within the lease.
        timeout_s = min(2.0, self.store.lease_ttl_s / 4)
        client = EtcdClient.for_store(
            self.store, observe=self.metrics.store_request, timeout_s=timeout_s
        )
        self.client = client
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                election = Election(
                    client,
                    self.store,
                    me,
                    self._campaign_delay_s,
                    # Keepalives from a thread of their own, on a client of their own.
                    keepalive_client=lambda: EtcdClient.for_store(self.store, timeout_s=timeout_s),
                )
                self.election = election
                await serve_control_listeners(
                    self.config,
                    listeners,
                    self.handle,
                    self.upgrade,
                    nursery=nursery,
                    leader_for_agents=self._answer_agent,
                )
                log.info("control plane %s at %s: joining the election", me.id, self.url)
                await nursery.start(election.run)
                task_status.started(self.port)
                await self._follow_election(election, nursery)
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _follow_election(self, election: Election, nursery: trio.Nursery) -> None:
        """Begin and end terms as the election says. Beginning and ending take the store's
        answers and a moment: what the election said meanwhile is read again before
        waiting for its next change (a term is never left begun for an epoch that ended,
        nor missing for one that began)."""
        while True:
            standing, plane = election.standing, self.plane
            if plane is not None and (not standing.leading or plane.epoch != standing.epoch):
                await self._end_term(standing.why)
                continue
            if standing.leading and plane is None and not self.closing:
                await self._begin_term(standing, nursery)
                if self.plane is None and election.standing.epoch == standing.epoch:
                    await trio.sleep(_RETRY_S)  # refused while still elected: the fence decides
                continue
            self._signal()
            await election.changed()

    def _suspect(self, url: str) -> None:
        """A peer lost the leader the store names, at `url`: check whether its process is
        gone (leader_gone), at most once a RECHECK_S per leadership."""
        election = self.election
        if election is None:
            return
        standing, now = election.standing, trio.current_time()
        leader = standing.leader
        if leader is None or standing.leading or leader.url != url:
            return
        if self._leader_checks.due(standing.epoch, now):
            self._check_leader_soon(leader, standing.epoch, now)

    def _check_leader_soon(self, leader: Member, epoch: int, now: float) -> None:
        election, nursery = self.election, self._nursery
        if election is None or nursery is None:
            return
        self._leader_checks.checked(epoch, now)
        nursery.start_soon(self._check_leader, election, leader, epoch)

    async def _check_leader(self, election: Election, leader: Member, epoch: int) -> None:
        url = leader.url
        if not await refuses_connections(url):
            return
        try:
            ended = await election.depose(epoch, leader.id)
        except StoreError as exc:
            log.warning("the leader at %s refuses connections, but the store: %s", url, exc)
            return
        if ended:
            self.deposed += 1
            log.warning(
                "the leader at %s (epoch %d) refuses connections: its process is gone, and its "
                "leadership ended in the store now rather than when its lease would",
                url,
                epoch,
            )

    async def _answer_agent(self, lost: int | None, source: str) -> bytes | None:
        """The line an agent's hello is answered with before any TLS (agent_lane), None to
        serve it here (hello_answer.answer_hello decides). `lost`: the newest epoch the
        agent has seen, when it lost its leader; `source`: its address (source_key). Told
        to come back, such a hello first waits here, a socket and no TLS, for the election
        to name a newer leader, _ANSWER_HOLD_S at most. What the answer given says is done
        once: the lost leader checked (asked of the first answer only), a handshake taken
        from the budget."""
        now = trio.current_time()
        if lost is not None:
            self._lost_hello_at = now
        answer = self._answer_now(lost, source, now)
        if answer.check_leader is not None:
            self._check_leader_soon(self._named_leader(), self._standing().epoch, now)
        if answer.answer == COME_BACK and self._answers_held < _ANSWERS_HELD_MAX:
            self._answers_held += 1
            try:
                with trio.move_on_after(_ANSWER_HOLD_S):
                    while answer.answer == COME_BACK:
                        await self.changed()
                        answer = self._answer_now(lost, source, trio.current_time())
            finally:
                self._answers_held -= 1
        if answer.spend is not None:
            self.handshakes.spend(answer.spend, source)
        if answer.answer is not None:
            self.metrics.hellos_answered[answer.answer] += 1
        return answer.line

    def _answer_now(self, lost: int | None, source: str, now: float) -> HelloAnswer:
        standing = self._standing()
        leader = standing.leader
        agents = AGENT_PATH.decode()
        seen = HelloStanding(
            here=self.url + agents,
            leading=standing.leading,
            term_begun=self.plane is not None,
            epoch=standing.epoch,
            leader=None if leader is None else leader.url + agents,
            store_ok=standing.store_ok,
            lease_ttl_s=self.store.lease_ttl_s,
        )
        return answer_hello(lost, source, seen, self.handshakes, self._leader_checks, now)

    def _standing(self) -> Standing:
        if self.election is None:
            return Standing(False, 0, None, None, "the election has not started", False)
        return self.election.standing

    def _named_leader(self) -> Member:
        leader = self._standing().leader
        assert leader is not None  # an answer asks for a check only of a leader named
        return leader

    def _campaign_delay_s(self) -> float:
        # Agents that lost the leader dial the control plane after it in their lists: that
        # one campaigning first, they are all sent to it at once.
        recently = trio.current_time() - self._lost_hello_at < _LOST_HELLOS_RECENT_S
        waiting = self.standby.held or self._answers_held
        return 0.0 if waiting or recently else _CAMPAIGN_DEFER_S

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _begin_term(self, standing: Standing, nursery: trio.Nursery) -> None:
        election = self.election
        assert election is not None
        log.debug("beginning to lead as epoch %d", standing.epoch)
        token = secrets.token_urlsafe(32)
        while True:
            try:
                written = await election.write({self._key(PEER_TOKEN_KEY): token.encode()}, ())
                break
            except StoreError as exc:
                # Until the lease ends, the store may answer again: the election says when
                # this leadership is over.
                log.warning("beginning to lead (epoch %d): the store: %s", standing.epoch, exc)
                if not election.may_act():
                    return
                await trio.sleep(_RETRY_S)
        if not written:
            # The guard or the fence refused: the leadership ended already, and the
            # election says so next.
            log.warning(
                "elected as epoch %d, but the store's guard refused the first write: not leading",
                standing.epoch,
            )
            return
        self._peer_digest = bearer_digest(b"Bearer " + token.encode())
        stored = await self._stored(election)
        if stored is None:
            return  # the leadership ended meanwhile
        interval = min(HEARTBEAT_INTERVAL_S, self.config.control.unreachable_after_s / 3)
        writes = StoreWrites(self._key(STATE_PREFIX))
        keeper = Keeper(stored)
        plane = ControlPlane(
            self.config,
            heartbeat_interval_s=interval,
            epoch=standing.epoch,
            may_act=election.may_act,
        )
        # Stored times are wall-clock: this leader's offset to its core's clock, once.
        offset = time.time() - plane.now()
        plane.restore(stored, offset)
        writes.add(keeper.everything(plane.reconciler, offset))
        plane.keep(lambda step: writes.add(keeper.step(plane.reconciler, step.touched, offset)))
        self.metrics.began(standing.epoch)
        log.info(
            "leading the fleet as epoch %d (the store kept %d values)", standing.epoch, len(stored)
        )
        self.plane = plane
        self._admin = AdminAPI(plane, reload=self.reload, seat=self)
        self._term = await nursery.start(self._run_term, plane, writes)

    async def _stored(self, election: Election) -> dict[str, bytes] | None:
        """What the last leader kept (relative keys), read until the store answers or
        this leadership ends (None)."""
        assert self.client is not None
        prefix = self._key(STATE_PREFIX)
        while election.may_act():
            try:
                kvs, _ = await self.client.get_prefix(prefix)
            except StoreError as exc:
                log.warning("reading what the last leader kept: %s", exc)
                await trio.sleep(_RETRY_S)
                continue
            return {kv.key[len(prefix) :].decode(errors="replace"): kv.value for kv in kvs}
        return None

    async def _run_term(
        self,
        plane: ControlPlane,
        writes: StoreWrites,
        *,
        task_status: trio.TaskStatus[trio.CancelScope],
    ) -> None:
        assert self.election is not None
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writes.flush_forever, self.election)
                await nursery.start(plane.run)
                task_status.started(scope)

    async def _end_term(self, why: str) -> None:
        plane, self.plane, self._admin = self.plane, None, None
        if plane is None:
            return
        log.warning("no longer leading (epoch %d): %s", plane.epoch, why)
        self.metrics.ended()
        plane.closing = True
        plane.agents.stop_streams()
        with trio.move_on_after(_STREAMS_CLOSE_S):
            await plane.agents.streams_closed.wait()
        for scope in list(self._streams):
            scope.cancel()
        if self._term is not None:
            self._term.cancel()
            self._term = None
        self._peer_digest = None

    def set_catalog(self, catalog: Catalog) -> None:
        """A reloaded catalog: this term's plane takes it, and so does the next term's."""
        self.config = attrs.evolve(self.config, catalog=catalog)
        if self.plane is not None:
            self.plane.set_catalog(catalog)

    def resign_soon(self) -> None:
        """This process stops (SIGTERM): hand over now, not when the lease would end."""
        self.closing = True
        if self._nursery is not None and self.election is not None:
            self._nursery.start_soon(self._resign, self.election)

    async def _resign(self, election: Election) -> None:
        # The election first: it fences at once and frees the leader key (one request),
        # so a standby leads while this process is still closing its streams.
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + _RESIGN_S  # the store may be away
            await election.resign()
        await self._end_term("this control plane is stopping: it resigned")

    # -- the control port -----------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        admin = self._admin
        if admin is None:
            await self.standby.handle(request, responder)
        else:
            await admin.handle(request, responder)

    async def upgrade(self, request: Request, raw: trio.abc.Stream) -> None:
        plane = self.plane
        if plane is None:
            await self.standby.upgrade(request, raw)
            return
        with trio.CancelScope() as scope:
            self._streams.add(scope)
            try:
                if request.path == ROUTES_PATH and self._is_peer(request):
                    await plane.serve_routes(request, raw, router_digest=self._peer_digest)
                else:
                    await plane.serve_upgrade(request, raw)
            finally:
                self._streams.discard(scope)

    async def _adopt(self, request: Request, raw: trio.abc.Stream, rest: bytes) -> bool:
        """A stream the standby held through the election this control plane won, served
        by its term; False when there is no term now or the term does not take it."""
        plane = self.plane
        if plane is None:
            return False
        with trio.CancelScope() as scope:
            self._streams.add(scope)
            try:
                return await plane.agents.serve_accepted(request, raw, rest)
            finally:
                self._streams.discard(scope)
        return True  # served until its term ended

    def _is_peer(self, request: Request) -> bool:
        digest = bearer_digest(request.header(b"authorization"))
        return digest is not None and digest == self._peer_digest

    def _key(self, name: bytes) -> bytes:
        return self.store.prefix.encode() + name

    # -- what operators read -------------------------------------------------------

    def metrics_page(self) -> bytes:
        return self.metrics.render(self.leadership())

    async def control_doc(self) -> ControlDoc:
        """Who leads, since when, the epoch, every control plane and the store's health,
        for `status`."""
        election = self.election
        standing = election.standing if election is not None else None
        leader = standing.leader if standing is not None else None
        members: tuple[ControlPlaneDoc, ...] | None = None
        if election is not None:
            with trio.move_on_after(_MEMBERS_S):
                try:
                    found = await election.members()
                    members = tuple(sorted(map(_member_doc, found), key=lambda m: m.url))
                except StoreError:
                    members = None
        return ControlDoc(
            this=self.url,
            leader=None if leader is None else _member_doc(leader),
            epoch=standing.epoch if standing is not None else 0,
            since=standing.since if standing is not None else None,
            why=standing.why if standing is not None else "the election has not started",
            store_ok=standing.store_ok if standing is not None else False,
            store_latency_ms=self.metrics.latency_ms(),
            leadership_changes=self.metrics.changes,
            control_planes=members,
        )


def _member_doc(member: Member) -> ControlPlaneDoc:
    return ControlPlaneDoc(member.id, member.url, member.started_at)
