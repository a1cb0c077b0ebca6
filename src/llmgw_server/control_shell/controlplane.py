"""The control plane's trio shell: it feeds the pure reconciler events and the clock,
and carries out the commands each step returns, knowing the core only by its steps
(what the route table is made of, the guard, the drains' endpoints, the replicas gone).

Decisions stay in `control.reconciler`; this module only delivers them: start,
drain and stop to agents over their streams, the route table to the routers that
follow it (`plane.routes`: this process's own router among them), and the log lines.
It never touches a router's objects: a drain is an intent in the table, and it
ends when every follower reports nothing in flight there (or `drain_timeout_s`).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import assert_never

import attrs
import trio

from llmgw_core.autoscaling import held_counts
from llmgw_core.awake_time import AwakeTime
from llmgw_core.catalog import Catalog, Endpoint
from llmgw_core.config import Config
from llmgw_core.inventory import ShardState
from llmgw_core.logsafe import escaped, peer_address
from llmgw_core.wire import Drain, Mark, Register, ShardUpdate, Start, Stop
from llmgw_http.server import Request
from llmgw_server.control.commands import Command, DrainShard, MarkNode, StartShard, StopShard
from llmgw_server.control.history import History, Point
from llmgw_server.control.reconciler import Reconciler, random_engine_key
from llmgw_server.control.scaling import merge
from llmgw_server.control.step import DrainHead, Routes, Step
from llmgw_server.control_shell.agents import AgentService
from llmgw_server.control_shell.fleet_feed import FleetFeed
from llmgw_server.control_shell.metrics import ControlMetrics
from llmgw_server.control_shell.output_tails import OutputTails
from llmgw_server.route_feed.hub import ROUTES_PATH, RouteHub, serve_websocket

log = logging.getLogger("llmgw.control")

_MAX_SLEEP_S = 1.0
HEARTBEAT_INTERVAL_S = 5.0
_STALL_LOG_S = 1.0  # a stall this long is logged (at most one line a minute)


class ControlPlane:
    def __init__(
        self,
        config: Config,
        *,
        heartbeat_interval_s: float,
        epoch: int = 0,
        may_act: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config
        # The epoch of this control plane's leadership, stamped on every message to an
        # agent (AgentService.send) and every route table: 0 without a store, a single
        # control plane never fenced.
        self.epoch = epoch
        # The fence (election.Election.may_act): read before every command and table, so
        # that a leader that lost its lease (a pause past it) acts on nothing it then sees.
        self.may_act = may_act or _always
        self._fenced = 0  # commands and tables the fence held back
        # Where control planes share a store: each step's changes of what is kept there,
        # handed over before its commands are delivered (seat.Seat queues the writes).
        self._keep: Callable[[Step], None] | None = None
        self.routes = RouteHub(epoch=epoch)  # what routers follow
        self.metrics = ControlMetrics()
        self.feed = FleetFeed()  # what the fleet page follows
        self.history = History()  # each autoscaled model's last hour, for the page
        self._arrived_at_point: tuple[float, dict[str, int]] | None = None
        self._cycle_at = trio.current_time()  # the last autoscaling cycle's time
        # Every time the reconciler is given is awake time (awake_time.py). The watch wakes
        # twice a second (0.03% of a core idle; ten times, 0.4%), more often only where
        # unreachable_after is short enough for a stall of that much to count.
        tick_s = min(0.5, config.control.unreachable_after_s / 10)
        self.clock = AwakeTime(trio.current_time(), tick_s=tick_s)
        self.reconciler = Reconciler(
            config.control,
            config.catalog,
            now=self.now(),
            instance=secrets.token_hex(3),
            engine_keys=random_engine_key,
        )
        self.agents = AgentService(
            self,
            heartbeat_interval_s,
            heartbeats_per_s=config.control.heartbeats_per_s,
            require_certificates=not config.agents.insecure,
            deny_serials=config.agents.deny_serials,
        )
        self._wake = trio.Event()
        self._wake_at: float | None = None  # when the reconciler asked to be ticked
        self._sleep_until = 0.0  # awake time, as the reconciler's deadlines
        self._draining: dict[str, tuple[str, Endpoint]] = {}  # replica id -> model, endpoint
        self._routes = Routes()  # as the last step that carried them left them
        # Until then agents of a restarted control plane may still be registering: the
        # table says it is incomplete, and routers that serve a complete one keep it.
        self._settled_at = trio.current_time() + config.control.settle_after_start_s
        self._nursery: trio.Nursery | None = None
        self.output_tails = OutputTails()  # pruned as replicas go (`apply`)
        self.closing = False

    def now(self) -> float:
        """Awake time: the monotonic clock less this process's stalls."""
        return self.clock.awake(trio.current_time())

    def held(self) -> dict[str, int]:
        """Each model's requests held by the routers, as they last reported."""
        return held_counts(self.routes.loads())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the drain watchers and the clock; wake the reconciler when a deadline comes."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._watch_stalls)
            self._run(lambda: self.reconciler.tick(self.now()))
            nursery.start_soon(self._publish_when_settled)
            nursery.start_soon(self._autoscale)
            nursery.start_soon(self._wake_held)
            task_status.started()
            while True:
                self._sleep_until = self.now() + _MAX_SLEEP_S
                if self._wake_at is not None:
                    self._sleep_until = min(self._sleep_until, self._wake_at)
                # A stall meanwhile wakes this early, in awake time: a tick that finds
                # nothing due while the waiting heartbeats are read.
                with trio.move_on_at(self.clock.monotonic(self._sleep_until, trio.current_time())):
                    await self._wake.wait()
                self._wake = trio.Event()
                self._run(lambda: self.reconciler.tick(self.now()))

    async def _watch_stalls(self) -> None:
        """Wake each `tick_s`; a late wake is a stall, taken off awake time."""
        clock = self.clock
        unlogged, logged_at = 0.0, -60.0
        while True:
            await trio.sleep(clock.tick_s)
            now = trio.current_time()
            stall = clock.watched(now)
            self.metrics.stalled_s += stall
            unlogged += stall
            if unlogged >= _STALL_LOG_S and now - logged_at >= 60.0:
                log.warning(
                    "this control plane's loop stalled for %.1f s in all since the last such "
                    "line (a starved CPU, a paused VM?): not counted as its nodes' silence",
                    unlogged,
                )
                unlogged, logged_at = 0.0, now

    async def serve_upgrade(self, request: Request, raw: trio.abc.Stream) -> None:
        """The control port's websockets: routers at /v1/routes, agents everywhere else."""
        if request.path != ROUTES_PATH:
            await self.agents.serve_upgrade(request, raw)
            return
        await self.serve_routes(request, raw, router_digest=self.config.admin.router_token_digest)

    async def serve_routes(
        self, request: Request, raw: trio.abc.Stream, *, router_digest: str | None
    ) -> None:
        """A router's route feed, for the holder of the token whose digest is given (the
        routers' own, or the token a leader gives the control planes that share its store)."""
        await serve_websocket(
            self.routes,
            request,
            raw,
            router_digest=router_digest,
            admin_digest=self.config.admin.token_digest,
            peer=peer_address(raw)[1],
        )

    def _fence_holds(self, what: str) -> bool:
        """True when this control plane may no longer act (its leadership ended)."""
        if self.may_act():
            return False
        self._fenced += 1
        if self._fenced == 1:
            log.warning(
                "leadership (epoch %d) ended: %s and all after it not sent", self.epoch, what
            )
        return True

    async def _publish_when_settled(self) -> None:
        await trio.sleep_until(self._settled_at)
        self._publish()

    # -- autoscaling ------------------------------------------------------------

    async def _autoscale(self) -> None:
        """Each autoscale_interval_s once settled: the autoscaled models decided on what
        the routers report (autoscalers start at the replicas then running)."""
        await trio.sleep_until(self._settled_at)
        interval = self.config.control.autoscale_interval_s
        held_shown: dict[str, int] = {}
        while True:
            if self._routes.autoscaled:
                self._run(self._autoscale_step)
                if self.history.due(trio.current_time()):
                    self._record_history()
                # The page shows what routers hold: its end too (a wake bumps at once).
                held = self.held()
                if held != held_shown:
                    held_shown = held
                    self.feed.bump()
            await trio.sleep(interval)

    def _record_history(self) -> None:
        routes = self._routes
        autoscaled, serving = routes.autoscaled, routes.serving
        now, arrived = trio.current_time(), dict(self.routes.arrived)
        before_at, before = self._arrived_at_point or (now, arrived)
        self._arrived_at_point = now, arrived
        points = {}
        for model, desired in autoscaled.items():
            new = arrived.get(model, 0) - before.get(model, 0)
            points[model] = Point(
                time.time(),
                new / (now - before_at) if now > before_at else 0.0,
                self.routes.ttft_peak(model, before_at),
                len(serving.get(model, ())),
                desired,
            )
        self.history.record(now, points, autoscaled)
        self.feed.bump()

    def _autoscale_step(self) -> Step:
        now = trio.current_time()  # the route hub's reports are timed on this clock
        since, self._cycle_at = self._cycle_at, now
        loads = {}
        for model, reports in self.routes.loads().items():
            # Every report since the last cycle counts, not only each router's latest.
            ttft = self.routes.ttft_peak(model, since)
            loads[model] = attrs.evolve(merge(reports, now), ttft_p90_ms=ttft)
        return self.reconciler.autoscale(loads, self.now())

    async def _wake_held(self) -> None:
        """A router holds a request for a model scaled to zero: a replica at once."""
        while True:
            await self.routes.wait_held()
            for model, reports in self.routes.loads().items():
                held = sum(r.held for r in reports)
                if held:
                    now = self.now()
                    self._run(functools.partial(self.reconciler.wake, model, now, held))
            self.feed.bump()  # the page and status show the requests held, live

    # -- events from agent streams ------------------------------------------

    def registered(self, message: Register, heartbeat_interval_s: float) -> None:
        self._run(
            lambda: self.reconciler.register(
                message.inventory,
                message.shards,
                self.now(),
                cordoned=message.cordoned,
                draining=message.draining,
                heartbeat_interval_s=heartbeat_interval_s,
            )
        )

    def paced(self, node: str, heartbeat_interval_s: float) -> None:
        self._run(lambda: self.reconciler.paced(node, heartbeat_interval_s))

    def heartbeat(self, node: str) -> None:
        self._run(lambda: self.reconciler.heartbeat(node, self.now()))

    def disconnected(self, node: str) -> None:
        if self.closing:
            return  # the control plane itself is going away: nothing to decide
        self._run(lambda: self.reconciler.disconnected(node, self.now()))

    def shard_update(self, node: str, message: ShardUpdate) -> None:
        report = message.report
        spec = report.spec
        self.feed.shard(node, spec.replica_id, spec.rank, str(report.state), report.detail)
        if report.state is ShardState.FAILED:
            self.output_tails.record((node, spec.replica_id, spec.rank), message.output_tail)
            # The node's words, escaped: one line, whatever it sent (the tail's lines
            # joined by an escaped newline).
            log.warning(
                "replica %s rank %d on %s failed: %s; output tail: %s",
                escaped(spec.replica_id),
                spec.rank,
                node,
                escaped(report.detail),
                escaped("\n".join(message.output_tail[-10:]), limit=4000),
            )
        self._run(
            lambda: self.reconciler.shard_status(
                node, spec.replica_id, spec.rank, report.state, self.now(), report.detail
            )
        )

    # -- operator actions ------------------------------------------------------

    def set_catalog(self, catalog: Catalog) -> None:
        """A reloaded catalog: added models are placed, removed ones drained, changed
        profiles roll, replicas counts apply; `explain` knows the new catalog at once."""
        self.config = attrs.evolve(self.config, catalog=catalog)
        self._run(lambda: self.reconciler.set_catalog(catalog, self.now()))

    def cordon(self, node: str, on: bool) -> None:
        self._run(lambda: self.reconciler.cordon(node, on, self.now()))

    def drain_node(self, node: str, on: bool, *, force: bool = False) -> None:
        """Raises KeyError for an unknown node, DrainRefused for a drain that would leave a
        replica nowhere to go (unless `force`)."""
        now = self.now()
        if on:
            self._run(lambda: self.reconciler.request_drain(node, now, force=force))
        else:
            self._run(lambda: self.reconciler.drain_node(node, False, now))

    # -- carrying out a step ----------------------------------------------------

    def _run(self, decide: Callable[[], Step]) -> None:
        """Take one step of the reconciler (timed, when it reconciled) and carry it out."""
        started = time.perf_counter()
        step = decide()
        if step.reconciled:
            self.metrics.reconcile.observe(time.perf_counter() - started)
        self.apply(step)

    def keep(self, keep: Callable[[Step], None]) -> None:
        """Hand every step from now on to `keep` first (what the store keeps changes)."""
        self._keep = keep

    def restore(self, stored: Mapping[str, bytes], wall_minus_monotonic: float) -> None:
        """A new leader takes up what its store keeps (Reconciler.restore), before any
        agent registers and before `run`."""
        self.apply(self.reconciler.restore(stored, self.now(), wall_minus_monotonic))

    def apply(self, step: Step) -> None:
        # What the shell keeps of the core is its own, fenced or not: a step it missed
        # would leave it stale for good.
        if step.routes is not None:
            self._routes = step.routes
        if step.forgotten and self.output_tails:
            self.output_tails.prune(lambda replica_id: replica_id not in step.forgotten)
        # A leadership that ended (its lease ran out while this process was paused, say)
        # carries out nothing of what it then decides, and does not log it as done.
        if self._fence_holds("a step of the reconciler"):
            return
        if self._keep is not None:
            self._keep(step)
        self.feed.stepped(step)
        for model in step.failed:  # the catalog's names alone (a label is kept for good)
            self.metrics.engine_failures[model] += 1
        for transition in step.transitions:
            if transition.old is None:  # the reconciler's notes tell every other transition
                log.info("node %s joined (%s)", transition.node, escaped(transition.reason))
        for note in step.notes:  # they quote nodes' words (a failure's detail): escaped
            log.info("%s", escaped(note, limit=4000))
        # A node declared unreachable has a dead stream (unless the mass-loss guard holds).
        self.agents.close_silent(step.transitions, step.guard)
        heads = {head.replica_id: head for head in step.drain_heads}
        for command in step.commands:
            self._deliver(command, heads)
        if step.reconciled:  # which replicas serve may have changed
            self._publish()
        self._wake_at = step.wake_at
        if step.wake_at is not None and step.wake_at < self._sleep_until:
            self._wake.set()

    def _deliver(self, command: Command, heads: Mapping[str, DrainHead]) -> None:
        if self._fence_holds(type(command).__name__):
            return
        agents = self.agents
        if isinstance(command, StartShard):
            spec = command.spec
            if spec.attempt > 0 and spec.rank == 0:  # a failed replica started again
                self.metrics.replica_restarts[spec.model_name] += 1
            log.info(
                "starting replica %s of %s rank %d on %s (GPUs %s, port %d)",
                spec.replica_id,
                spec.model_name,
                spec.rank,
                command.node,
                ",".join(map(str, spec.gpu_indices)),
                spec.port,
            )
            agents.send(command.node, Start(agents.next_command_id(), spec))
        elif isinstance(command, DrainShard):
            log.info(
                "draining replica %s rank %d on %s", command.replica_id, command.rank, command.node
            )
            agents.send(
                command.node, Drain(agents.next_command_id(), command.replica_id, command.rank)
            )
            if command.rank == 0:
                self._watch_drain(command.replica_id, heads.get(command.replica_id))
        elif isinstance(command, StopShard):
            log.info(
                "stopping replica %s rank %d on %s", command.replica_id, command.rank, command.node
            )
            agents.send(
                command.node, Stop(agents.next_command_id(), command.replica_id, command.rank)
            )
        elif isinstance(command, MarkNode):
            agents.send(
                command.node, Mark(agents.next_command_id(), command.cordoned, command.draining)
            )
        else:
            assert_never(command)

    def _watch_drain(self, replica_id: str, head: DrainHead | None) -> None:
        """Publish the drain intent; tell the reconciler once no follower has a request
        in flight there."""
        if head is not None:
            self._draining[replica_id] = head.model, head.endpoint
        version = self._publish()
        assert self._nursery is not None
        endpoint = None if head is None else head.endpoint
        self._nursery.start_soon(self._wait_drained, replica_id, endpoint, version)

    async def _wait_drained(self, replica_id: str, endpoint: Endpoint | None, version: int) -> None:
        # Reported from its own task, never from inside the step that sent the drain.
        await trio.lowlevel.checkpoint()
        routes = self.routes
        # drain_timeout_s of awake time: the followers' reports of what they still have in
        # flight wait unread in this process's sockets while it stalls.
        deadline = self.now() + self.config.control.drain_timeout_s
        timed_out = False
        while not timed_out:
            with trio.move_on_at(self.clock.monotonic(deadline, trio.current_time())):
                if endpoint is not None:
                    # Routers that followed the control plane before it started may still
                    # be dialing it again: they count once they do.
                    await trio.sleep_until(self._settled_at)
                while endpoint is not None:
                    if routes.caught_up(version) and not routes.in_flight(endpoint):
                        break
                    await routes.wait_reported()
                break
            timed_out = self.now() >= deadline  # else a stall woke it early
        if timed_out:
            log.info(
                "replica %s: drain_timeout_s (%g s) passed with requests still in flight",
                replica_id,
                self.config.control.drain_timeout_s,
            )
        self._draining.pop(replica_id, None)
        self._run(lambda: self.reconciler.replica_drained(replica_id, self.now()))
        self._publish()  # the drained endpoint leaves the table

    def _publish(self) -> int:
        """Publish what serves, with the replicas being drained (kept so that followers
        count what they still have in flight there); returns the table's version."""
        if self._fence_holds("the route table"):
            return self.routes.table.version
        # Each router logs what it serves ("<model> is served by ..."), not this.
        routes = self._routes
        models = dict(routes.serving)
        for model, endpoint in self._draining.values():
            if endpoint not in models.get(model, ()):
                models[model] = (*models.get(model, ()), endpoint)
        draining = frozenset(endpoint for _, endpoint in self._draining.values())
        # Incomplete while agents may still be registering (the settle time), or while a
        # replica the store named waits for its nodes (a new leader): routers that serve
        # a complete table keep it meanwhile, rather than lose what still runs.
        complete = trio.current_time() >= self._settled_at and not routes.awaiting
        # Each adapter is served by its model's replicas, under its own name.
        return self.routes.publish(
            models,
            draining,
            complete=complete,
            adapters=routes.adapters,
            autoscaled=frozenset(routes.autoscaled),
        )


def _always() -> bool:
    return True
