"""The agent daemon: dial the control plane, register, heartbeat, run what it is told.

One nursery owns everything. The engines live in their own nursery, beside the
connection loop rather than inside it, so that they keep serving while the
control plane is away; each connection's reader, writer and heartbeat timer
live in that connection's nursery and end with it.

A stream on which nothing arrives from the control plane for the bound that
`ws_frames.silence_bound` derives from the heartbeat interval is cut and dialled
again (the control plane acknowledges each heartbeat with a pong, so a healthy
stream needs no ping; one is sent when it is quiet, as with an older control
plane's): a control plane that vanished without closing (host off, route
black-holed) is noticed in 20 s, not in TCP's 15 minutes. A session on which
the control plane kept answering for a while (`next_attempt`) resets the
backoff, so the redial comes within `reconnect.base_s`, whatever the failures
before it; one that ended soon after the welcome (a bad frame, a close,
silence) counts as one more failure, so a control plane that admits agents and
then fails them does not have the whole fleet dial again in lockstep.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import assert_never

import attrs
import httpx
import trio
import trio_websocket

from llmgw_agent import procinfo
from llmgw_agent import shard_records as records
from llmgw_agent.adapters import Command, EngineLaunch, build_command
from llmgw_agent.adoption import MARKER, Verdict, decide
from llmgw_agent.config import AgentConfig
from llmgw_agent.engine_flags import help_command, refusals
from llmgw_agent.flag_reader import FlagCache, program_identity, read_help
from llmgw_agent.following import ControlPlanes, Ended, lost_after, stale
from llmgw_agent.shm_leftovers import clean_after
from llmgw_agent.supervisor import (
    LOG_FILES_KEPT,
    EngineProcess,
    Transition,
    prune_logs,
    stop_leftovers,
)
from llmgw_agent.validate import problems
from llmgw_core import __version__
from llmgw_core.agent_lane import AGENT_DIAL_PATIENCE_S, MAX_COME_BACK_S
from llmgw_core.dial import ConnectFailed, open_agent_stream
from llmgw_core.inventory import Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_core.logsafe import escaped
from llmgw_core.ratelog import RateLimit
from llmgw_core.tls_config import client_context
from llmgw_core.wire import (
    LOST_LEADER_HEADER,
    MAX_FRAME_BYTES,
    NAME_HELD_CLOSE,
    NOT_LEADER_CLOSE,
    PROTOCOL,
    STALE_EPOCH_CLOSE,
    STOPPING_CLOSE,
    Ack,
    DownMessage,
    Drain,
    Heartbeat,
    Mark,
    Pace,
    Register,
    ShardUpdate,
    Start,
    Stop,
    UpMessage,
    Welcome,
    WireError,
    decode_down,
    encode,
    leader_from_reason,
    not_leader_reason,
    stale_epoch_reason,
)
from llmgw_core.ws_frames import (
    Heard,
    Paced,
    SilenceBound,
    cut_when_silent,
    read_frames,
    write_frames,
)

log = logging.getLogger("llmgw.agent")

ShardId = tuple[str, int]  # replica id, rank

# Dialing, the TLS handshake and the websocket handshake together get this long: long
# enough to wait its turn at a control plane that a whole fleet dials at once.
CONNECT_TIMEOUT_S = AGENT_DIAL_PATIENCE_S
# Closing waits this long for the control plane's close frame (the library's default is
# 60 s); a stream cut for silence is closed at once, without waiting.
DISCONNECT_TIMEOUT_S = 5.0
# A control plane that closed the stream because it stops (STOPPING_CLOSE: a restart) is
# dialled again after up to RESTART_JITTER_S, and again so while the dial fails, for up to
# RESTART_REDIAL_WINDOW_S (a restart's stop and start; with the default 2 s backoff the
# agent would come back up to 4.9 s after the new process listens). The jitter spreads a
# fleet's dials over half a second; the control port's admission then paces them as at any
# start. Past the window the backoff takes over, as for a control plane that is gone.
RESTART_JITTER_S = 0.5
RESTART_REDIAL_WINDOW_S = 30.0
# Commands refused for a stale epoch are logged at most once per this, with a count.
STALE_LOG_PERIOD_S = 10.0


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: a fleet that lost its control plane must not come back in lockstep."""
    return rng.uniform(0, min(cap_s, base_s * 2 ** min(attempt, 30)))


def reconnect_delay(
    attempt: int, come_back_s: float | None, base_s: float, cap_s: float, rng: random.Random
) -> float:
    """The wait before the next dial: when the control plane said when to come back (a
    busy control port gives each agent it refuses a turn, at the rate it registers them:
    llmgw_http.tls_admission), that, within MAX_COME_BACK_S, plus up to base_s of the
    agent's own jitter; else the full-jitter backoff."""
    if come_back_s is None:
        return backoff_delay(attempt, base_s, cap_s, rng)
    return min(max(come_back_s, 0.0), MAX_COME_BACK_S) + rng.uniform(0, base_s)


def restart_redial_delay(
    now: float, redial_until: float | None, come_back_s: float | None, rng: random.Random
) -> float | None:
    """The wait before the next dial while a stopped control plane restarts (until
    `redial_until`); None: the backoff decides (no restart, or its window passed). A
    turn the busy new control plane gave (`come_back_s`) is kept, with this jitter rather
    than the backoff's (the control plane spread the turns already)."""
    if redial_until is None or now >= redial_until:
        return None
    turn = 0.0 if come_back_s is None else min(max(come_back_s, 0.0), MAX_COME_BACK_S)
    return turn + rng.uniform(0, RESTART_JITTER_S)


class NameHeld(Exception):
    """The control plane refused this registration: another agent's stream for this
    node's name is live (it answered the control plane's ping)."""


@attrs.define
class Session:
    """What one connection showed of the control plane, for the backoff (trio's clock)
    and the choice of the next control plane (`following`)."""

    url: str = ""  # the control plane dialled
    welcomed_at: float | None = None  # None: it never registered
    heard: Heard | None = None  # when the control plane was last heard from on it
    bound: SilenceBound | None = None  # its silence bound
    stopping: bool = False  # the control plane closed it because it stops (a restart)
    not_leader: str | None = None  # a standby's NOT_LEADER_CLOSE: its reason
    stale: bool = False  # its welcome's epoch was stale: the agent closed it

    def ended(self) -> Ended:
        if self.not_leader is not None:
            return Ended.NOT_LEADER
        if self.stale:
            return Ended.STALE
        if self.welcomed_at is not None or self.stopping:
            return Ended.LEADER_LOST
        return Ended.FAILED


def _interval(seconds: float) -> float:
    """A heartbeat interval from the control plane, checked (WireError)."""
    if not 0.05 <= seconds <= 3600:  # NaN fails both
        raise WireError(f"a heartbeat interval of {seconds} s makes no sense")
    return seconds


def next_attempt(attempt: int, session: Session) -> int:
    """The backoff's attempt after `session` ended: 0 when it was healthy for a while,
    else `attempt` + 1.

    Healthy for a while: something (a frame, a pong) came from the control plane at
    least half the silence bound after the welcome (10 s with the default heartbeat:
    on a quiet stream, the answer to the first ping). However it then ended, cut for
    silence included, the redial comes within base_s: a black-holed stream is back
    within 30 s. A session that ended sooner (a bad frame, a close just after the
    welcome, silence from the start, as when the control plane stalls) is a failure
    like a refused dial, so the delays grow and spread instead of the fleet
    registering again and again at once.
    """
    if session.welcomed_at is None or session.heard is None or session.bound is None:
        return attempt + 1
    answered_for = session.heard.at - session.welcomed_at
    return 0 if answered_for >= session.bound.probe_after_s else attempt + 1


@attrs.define(eq=False)
class _Shard:
    spec: LaunchSpec
    state: ShardState
    detail: str = ""
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    process: EngineProcess | None = None
    # Its failure's report, with the engine's output tail, when no stream took it (the
    # control plane was away): sent after the next welcome, since a registration
    # carries only the state.
    unsent_failure: ShardUpdate | None = None

    def stop(self) -> None:
        """A stop command: end the engine (cancelling alone would leave it serving)."""
        if self.process is not None:
            self.process.stop_on_cancel = True
        self.scope.cancel()

    def report(self) -> ShardReport:
        return ShardReport(self.spec, self.state, self.detail)


class Agent:
    def __init__(self, config: AgentConfig, inventory: Inventory) -> None:
        self.config = config
        self.inventory = inventory
        self.shards: dict[ShardId, _Shard] = {}
        self.cordoned = False
        self.draining = False
        self._outbox: trio.MemorySendChannel[str] | None = None
        self._engines: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None
        self._flags = FlagCache()  # each engine program's flags, read once per version
        self.connected = trio.Event()  # set on each registration, for tests and logs
        self.registrations = 0  # welcomes received, over every connection
        self.rng = random.Random()
        self._silence_s = 0.0  # the current stream's silence bound, for the log
        self.planes = ControlPlanes(config.servers)  # the one dialled, and the next
        # The control plane this agent last lost or could not reach, with several: named
        # to the next ones it dials (LOST_LEADER_HEADER), until one welcomes it.
        self._lost: str | None = None
        # The highest epoch of a leadership seen (kept with the flags): a welcome or a
        # command of a lower one comes from a leader that lost its lease (`stale`).
        self.epoch = 0
        self.stale_commands_refused = 0
        self._stale_log = RateLimit(STALE_LOG_PERIOD_S)
        secure = config.server.startswith("wss:")  # every one's scheme (config)
        self._ssl_context = client_context(config.tls) if secure and config.tls.cert else None
        if config.insecure:
            servers = ", ".join(config.servers)
            log.warning("insecure = true: the stream to %s is plaintext", servers)
        self._load_flags()

    # -- the daemon ---------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Its engines' health, over plain HTTP on the node: no certificate to verify, so no
        # CA bundle loaded (0.05 to 0.2 s of CPU at each start).
        probes = httpx.AsyncClient(timeout=2.0, verify=False)
        async with probes as client, trio.open_nursery() as nursery:
            self._client = client
            engines = await nursery.start(_hold_nursery)
            self._engines = engines
            await self._adopt_engines()
            task_status.started()
            await self._connect_forever()

    async def _connect_forever(self) -> None:
        attempt = 0
        redial_until: float | None = None  # see RESTART_REDIAL_WINDOW_S
        while True:
            session = Session(self.planes.current)
            come_back: float | None = None  # when the control plane asked to be dialled
            try:
                await self._session(session)
            except* NameHeld as group:
                # Said as an error each time: it lasts until an operator gives one of the
                # two machines its own name and certificate. The backoff grows as for a
                # refused dial (the session never registered), up to reconnect.cap_s.
                log.error(
                    "the control plane %s refused this agent: %s. Two machines run an agent "
                    "as node %r (a cloned VM image, a copied certificate?): the first one "
                    "keeps the node; give this one its own name and certificate",
                    session.url,
                    escaped(str(group.exceptions[0])),
                    self.inventory.name,
                )
            except* ConnectFailed as group:
                failed = group.exceptions[0]
                assert isinstance(failed, ConnectFailed)
                come_back = failed.come_back_s
                if failed.leader is not None:
                    # A standby named the leader before any handshake: `following` goes
                    # there (and says so), as after its NOT_LEADER close.
                    session.not_leader = not_leader_reason(failed.leader)
                else:
                    log.warning("cannot connect to the control plane %s: %s", session.url, failed)
            except* (
                OSError,
                trio.TooSlowError,
                trio_websocket.HandshakeError,
                trio_websocket.ConnectionClosed,
            ) as group:
                log.warning("control plane %s: %s", session.url, _short(group.exceptions[0]))
            except* WireError as group:
                log.error("the control plane sent a bad frame: %s", group.exceptions[0])
            except* Exception as group:
                # Nothing that goes wrong with one connection may reach the engines.
                log.error("the session with %s failed", session.url, exc_info=group)
            now = trio.current_time()
            if len(self.config.servers) > 1:
                self._lost = lost_after(
                    session.url,
                    session.ended(),
                    session.welcomed_at is not None,
                    self._lost,
                    busy=come_back is not None,
                )
            redial = self.planes.after(
                session.ended(),
                now=now,
                rng=self.rng,
                healthy=next_attempt(0, session) == 0,
                welcomed=session.welcomed_at is not None,
                epoch=self.epoch,
                leader=leader_from_reason(session.not_leader),
                reason=session.not_leader or "",
                come_back_s=come_back,
            )
            if redial is not None and redial.delay_s is not None:
                why = f"{redial.why}: " if redial.why else ""
                log.info("%sdialing %s in %.2f s", why, self.planes.current, redial.delay_s)
                await trio.sleep(redial.delay_s)
                continue
            if redial is not None:  # several control planes: the backoff, then the next
                if redial.why:
                    log.info("%s", redial.why)
            elif session.stopping:
                redial_until = now + RESTART_REDIAL_WINDOW_S
            elif session.welcomed_at is not None:
                redial_until = None  # back: later failures take the backoff
            if redial is None:
                delay_or_none = restart_redial_delay(now, redial_until, come_back, self.rng)
                if delay_or_none is not None:
                    log.info(
                        "the control plane is restarting: dialing again in %.2f s", delay_or_none
                    )
                    await trio.sleep(delay_or_none)
                    continue
            attempt = next_attempt(attempt, session)
            delay = reconnect_delay(
                attempt,
                come_back,
                self.config.reconnect_base_s,
                self.config.reconnect_cap_s,
                self.rng,
            )
            if len(self.config.servers) > 1:
                log.info("reconnecting to %s in %.2f s", self.planes.current, delay)
            else:
                log.info("reconnecting in %.2f s", delay)
            await trio.sleep(delay)

    async def _session(self, session: Session) -> None:
        """One connection, from dial to close (or to the cut of a silent stream)."""
        with trio.CancelScope() as cut:
            await self._connection(cut, session)
        if cut.cancelled_caught:
            log.warning(
                "nothing from the control plane %s for %g s, not even a pong: dialing again",
                session.url,
                self._silence_s,
            )

    async def _connection(self, cut: trio.CancelScope, session: Session) -> None:
        # `cut` lies outside the websocket's context: cancelled, it closes the socket
        # without waiting for a close handshake that a vanished peer never answers.
        # Every byte from the control plane counts as hearing from it: the pong that
        # acknowledges each heartbeat keeps a quiet stream alive without a ping.
        heard = Heard(trio.current_time())
        async with open_agent_stream(
            session.url,
            self._ssl_context,
            ca=self.config.tls.ca,
            connect_timeout_s=self.planes.dial_patience_s(trio.current_time(), CONNECT_TIMEOUT_S),
            headers=[] if self._lost is None else [(LOST_LEADER_HEADER, self._lost.encode())],
            # Not to a leader a control plane named: that one leads a newer epoch.
            lost_epoch=None if self._lost is None or self.planes.named else self.epoch,
            disconnect_timeout_s=DISCONNECT_TIMEOUT_S,
            max_message_size=MAX_FRAME_BYTES,
            heard=heard,
        ) as ws:
            outbox_send, outbox_receive = trio.open_memory_channel[str](1024)
            # Queue transitions from the moment the snapshot is taken: one that happens
            # while the welcome is awaited must not be lost between the two.
            self._outbox = outbox_send
            try:
                try:
                    # A standby may close before the register is sent: its close says why.
                    await ws.send_message(encode(self._register()))
                    with trio.fail_after(10):
                        welcome = decode_down(await ws.get_message())
                except trio_websocket.ConnectionClosed as closed:
                    if closed.reason is not None and closed.reason.code == NAME_HELD_CLOSE:
                        raise NameHeld(closed.reason.reason or "") from None
                    if closed.reason is not None and closed.reason.code == STOPPING_CLOSE:
                        session.stopping = True
                    if closed.reason is not None and closed.reason.code == NOT_LEADER_CLOSE:
                        session.not_leader = closed.reason.reason or ""
                        return  # `following` says where next, and logs why
                    raise
                if not isinstance(welcome, Welcome):
                    raise WireError(f"expected welcome, got {type(welcome).__name__}")
                if stale(welcome.epoch, self.epoch):
                    log.warning(
                        "%s welcomed this agent with epoch %d, but it follows epoch %d (that "
                        "control plane led once and no longer does): closing the stream",
                        session.url,
                        welcome.epoch,
                        self.epoch,
                    )
                    session.stale = True
                    reason = stale_epoch_reason(welcome.epoch, self.epoch)
                    await ws.aclose(code=STALE_EPOCH_CLOSE, reason=reason)
                    return
                self._follow(welcome.epoch)  # kept before any command of this stream
                heard.now()
                paced = Paced.at(_interval(welcome.heartbeat_interval_s))
                log.info(
                    "registered with %s (epoch %d, %d shards)",
                    session.url,
                    welcome.epoch,
                    len(self.shards),
                )
                for shard in self.shards.values():
                    if shard.unsent_failure is not None:
                        self._send(shard.unsent_failure)
                        shard.unsent_failure = None
                self.registrations += 1
                self.connected.set()
                self._silence_s = paced.bound.cut_after_s
                session.welcomed_at, session.heard, session.bound = heard.at, heard, paced.bound
                self._lost = None  # a leader welcomed it
                bad_frame: WireError | None = None
                async with trio.open_nursery() as nursery:
                    inbox_send, inbox_receive = trio.open_memory_channel[str | bytes](64)
                    nursery.start_soon(read_frames, ws, inbox_send, nursery.cancel_scope, heard)
                    nursery.start_soon(write_frames, ws, outbox_receive, nursery.cancel_scope)
                    nursery.start_soon(self._heartbeat, paced)
                    nursery.start_soon(cut_when_silent, ws, heard, paced, cut)
                    async for frame in inbox_receive:
                        try:
                            message = decode_down(frame)
                            if not self._follows(message):
                                continue
                            if isinstance(message, Pace):
                                paced.set(_interval(message.heartbeat_interval_s))
                                self._silence_s = paced.bound.cut_after_s
                                session.bound = paced.bound
                                continue
                        except WireError as exc:
                            bad_frame = exc
                            nursery.cancel_scope.cancel()
                            break
                        self._command(message)
                if bad_frame is not None:
                    await ws.aclose(code=1008, reason=str(bad_frame)[:120])
                    raise bad_frame
            finally:
                self._outbox = None
                self.connected = trio.Event()
            if ws.closed is not None and ws.closed.code == STOPPING_CLOSE:
                session.stopping = True
                log.info("the control plane closed the stream: %s", ws.closed.reason)
            elif ws.closed is not None and ws.closed.code == NOT_LEADER_CLOSE:
                session.not_leader = ws.closed.reason or ""  # the leader stepped down
            elif ws.closed is not None and ws.closed.reason:
                log.warning("the control plane closed the stream: %s", ws.closed.reason)

    async def _heartbeat(self, paced: Paced) -> None:
        seq = 0
        last = trio.current_time()
        while True:
            changed = paced.changed
            with trio.move_on_at(last + paced.interval_s):
                await changed.wait()
                continue  # a new interval, counted from the last heartbeat
            last = trio.current_time()
            seq += 1
            self._send(Heartbeat(seq))

    def _register(self) -> Register:
        return Register(
            protocol=PROTOCOL,
            agent_version=__version__,
            inventory=self.inventory,
            shards=tuple(s.report() for s in self.shards.values()),
            cordoned=self.cordoned,
            draining=self.draining,
        )

    def _send(self, message: UpMessage) -> bool:
        """Whether a stream took it: when not, the next registration carries every
        shard's state anyway."""
        if self._outbox is None:
            return False
        try:
            self._outbox.send_nowait(encode(message))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    # -- commands ------------------------------------------------------------

    def _follow(self, epoch: int) -> None:
        """A welcome or command of `epoch`, not stale: a higher one is kept from now on (and
        in the state directory, before any command of its leader is carried out)."""
        if epoch > self.epoch:
            log.info("following epoch %d (was %d)", epoch, self.epoch)
            self.epoch = epoch
            self._save_flags()

    def _follows(self, message: DownMessage) -> bool:
        """Whether to take a message that came after the welcome; one of a stale epoch is
        refused (an Ack says so, where it has a command id) and counted."""
        if not stale(message.epoch, self.epoch):
            self._follow(message.epoch)
            return True
        self.stale_commands_refused += 1
        reason = stale_epoch_reason(message.epoch, self.epoch)
        held = self._stale_log.allow(message.epoch, trio.current_time())
        if held is not None:
            more = f" ({held} more since the last such line)" if held else ""
            log.warning("refused a %s: %s%s", type(message).__name__.lower(), reason, more)
        if not isinstance(message, Welcome | Pace):
            self._send(Ack(message.command_id, ok=False, error=reason))
        return False

    def _command(self, message: DownMessage) -> None:
        if isinstance(message, Start):
            error = self._start(message.spec)
            self._send(Ack(message.command_id, ok=not error, error=error))
        elif isinstance(message, Drain | Stop):
            shard = self.shards.get((message.replica_id, message.rank))
            if shard is None:
                self._send(Ack(message.command_id, ok=False, error="no such shard"))
                return
            if isinstance(message, Drain):
                if shard.state not in (ShardState.STOPPED, ShardState.FAILED):
                    self._transition(shard, ShardState.DRAINING, "draining on request")
            else:
                shard.stop()
                if shard.state in (ShardState.FAILED, ShardState.PENDING):
                    self._transition(shard, ShardState.STOPPED, "stopped on request")
                    self._forget_later(shard)
            self._send(Ack(message.command_id))
        elif isinstance(message, Mark):
            self.cordoned, self.draining = message.cordoned, message.draining
            self._save_flags()
            self._send(Ack(message.command_id))
        elif isinstance(message, Welcome | Pace):  # a welcome out of turn; a pace: above
            self._send(Ack(0, ok=False, error=f"unexpected {type(message).__name__}"))
        else:
            assert_never(message)

    def _start(self, spec: LaunchSpec) -> str:
        key = (spec.replica_id, spec.rank)
        old = self.shards.get(key)
        if old is not None:
            old.stop()  # a new attempt replaces the old shard
        in_use = {
            i
            for k, s in self.shards.items()
            if k != key and s.state not in (ShardState.STOPPED, ShardState.FAILED)
            for i in s.spec.gpu_indices
        }
        shard = _Shard(spec, ShardState.PENDING)
        self.shards[key] = shard
        found = problems(spec, self.inventory, in_use, self.config.bind_host)
        if found:
            reason = "the profile does not fit this node: " + "; ".join(found)
            self._transition(shard, ShardState.FAILED, reason)
            return reason
        self._transition(shard, ShardState.PENDING, "accepted")
        assert self._engines is not None
        self._engines.start_soon(self._run_engine, shard)
        return ""

    async def _run_engine(self, shard: _Shard) -> None:
        spec = shard.spec
        config = self.config
        command = engine_command(config, spec)
        log.info("starting %s rank %d: %s", spec.replica_id, spec.rank, " ".join(command.argv))
        health = f"http://{config.advertise_host}:{spec.port}/health" if spec.is_head else None
        assert self._client is not None

        state_dir = config.state_dir
        logfile = records.log_path(state_dir, spec)
        known = {records.log_path(state_dir, s.spec).name for s in self.shards.values()}
        for old in prune_logs(logfile.parent, LOG_FILES_KEPT, known):
            log.info("removed the old engine log %s", old)

        # The marker a restarted agent knows the engine by (see `adoption`).
        launch_id = f"{spec.replica_id}.{spec.rank}.{secrets.token_hex(8)}"

        def remember(pid: int, shm_before: frozenset[str]) -> None:
            started = procinfo.start_time(pid) or 0
            argv = tuple(command.argv)
            record = records.ShardRecord(
                spec, pid, started, argv, str(logfile), launch_id, tuple(sorted(shm_before))
            )
            records.save(state_dir, record)

        shard.process = EngineProcess(
            command.argv,
            {**os.environ, **command.env, MARKER: launch_id},
            health,
            self._reporter(shard),
            self._client,
            logfile,
            stop_grace_s=config.stop_grace_s,
            start_timeout_s=config.start_timeout_s,
            on_spawn=remember,
            api_key=spec.api_key,
            files=command.files,
        )
        with shard.scope:
            refused = await self._flag_problems(spec, command)
            if refused:
                reason = "the profile does not fit this node: " + "; ".join(refused)
                self._transition(shard, ShardState.FAILED, reason)
            else:
                await shard.process.run()
        # Reached when the engine failed or was stopped; an agent that shuts down is
        # cancelled before this line and keeps the record, so a new agent adopts it.
        records.remove(state_dir, spec)
        if shard.state is ShardState.STOPPED:
            self._forget_later(shard)

    async def _flag_problems(self, spec: LaunchSpec, command: Command) -> list[str]:
        """The launch's flags the installed engine does not take (see `flag_reader`)."""
        engine = self.config.engines[spec.engine]
        asking = help_command(spec.engine, engine.command)
        if asking is None:
            return []
        version = next((e.version for e in self.inventory.engines if e.name == spec.engine), "")
        key = (spec.engine, engine.command, version, program_identity(engine.command[0]))
        env = {**os.environ, **engine.env}
        found = await self._flags.flags(key, lambda: read_help(asking, env))
        program = f"{spec.engine} {version}".rstrip()
        if found.flags is None:
            log.warning("the flags were not checked against %s: %s", program, found.why)
            return []
        # Every adapter puts the profile's args last, as given.
        own = command.argv[len(engine.command) : len(command.argv) - len(spec.args)]
        return refusals(spec.engine, program, found.flags, own, spec.args)

    def _reporter(self, shard: _Shard) -> Callable[[Transition], Awaitable[None]]:
        async def report(t: Transition) -> None:
            state = ShardState(t.state)
            if state is ShardState.READY and shard.state is ShardState.DRAINING:
                return
            self._transition(shard, state, t.detail, t.output_tail)

        return report

    async def _adopt_engines(self) -> None:
        """Find the engines an earlier run of this agent started, from the state directory.
        What is left of one that cannot be adopted is stopped before the agent registers,
        so that its replacement never starts beside it."""
        config = self.config
        assert self._engines is not None and self._client is not None
        leftovers: list[records.ShardRecord] = []
        for record in records.load(config.state_dir):
            spec = record.spec
            key = (spec.replica_id, spec.rank)
            identity = record.identity()
            decision = decide(
                identity,
                procinfo.view(record.pid, MARKER),
                procinfo.group_members(record.pid, MARKER),
            )
            if decision.verdict is not Verdict.ADOPT:
                detail = f"the engine (pid {record.pid}) ended while the agent was away"
                if decision.verdict is Verdict.STOP:
                    pids = ", ".join(map(str, decision.leftovers))
                    detail += f"; its process group (pids {pids}) is stopped"
                    leftovers.append(record)  # its record goes once they are stopped
                else:
                    records.remove(config.state_dir, spec)
                    await _clean_shm(record)
                log.warning("%s rank %d: %s", spec.replica_id, spec.rank, detail)
                self.shards[key] = _Shard(spec, ShardState.FAILED, detail)
                continue
            log.info("%s rank %d: adopting engine pid %d", spec.replica_id, spec.rank, record.pid)
            shard = self.shards[key] = _Shard(
                spec, ShardState.STARTING, f"adopted pid {record.pid}"
            )
            health = f"http://{config.advertise_host}:{spec.port}/health" if spec.is_head else None
            shard.process = EngineProcess(
                record.argv,
                {},
                health,
                self._reporter(shard),
                self._client,
                Path(record.log),
                stop_grace_s=config.stop_grace_s,
                start_timeout_s=config.start_timeout_s,
                api_key=spec.api_key,
            )
            self._engines.start_soon(self._watch_adopted, shard, record)
        async with trio.open_nursery() as nursery:
            for record in leftovers:
                nursery.start_soon(self._stop_leftovers, record)

    async def _stop_leftovers(self, record: records.ShardRecord) -> None:
        spec = record.spec
        if not await stop_leftovers(record.identity(), self.config.stop_grace_s):
            log.error(
                "%s rank %d: processes of the engine's group (pid %d) outlived SIGKILL",
                spec.replica_id,
                spec.rank,
                record.pid,
            )
        else:
            await _clean_shm(record)
        records.remove(self.config.state_dir, spec)

    async def _watch_adopted(self, shard: _Shard, record: records.ShardRecord) -> None:
        assert shard.process is not None
        with shard.scope:
            await shard.process.adopt(record.pid, record.started, _shm_before(record))
        records.remove(self.config.state_dir, shard.spec)
        if shard.state is ShardState.STOPPED:
            self._forget_later(shard)

    def _transition(
        self, shard: _Shard, state: ShardState, detail: str, tail: tuple[str, ...] = ()
    ) -> None:
        shard.state, shard.detail = state, detail
        spec = shard.spec
        if state is ShardState.FAILED:
            # The engine's words, escaped: its output must not forge the agent's log lines.
            log.warning("%s rank %d failed: %s", spec.replica_id, spec.rank, escaped(detail))
            for line in tail[-10:]:
                log.warning("    %s", escaped(line))
        else:
            # A detail may begin with the state ("draining on request"): say it once.
            words = detail if detail.startswith(str(state)) else f"{state} {detail}".rstrip()
            log.info("%s rank %d: %s", spec.replica_id, spec.rank, words)
        update = ShardUpdate(shard.report(), tail)
        sent = self._send(update)
        shard.unsent_failure = None if sent or state is not ShardState.FAILED else update

    def _forget_later(self, shard: _Shard) -> None:
        """A stopped shard has been reported; drop it so it is not re-registered forever."""
        key = (shard.spec.replica_id, shard.spec.rank)
        if self.shards.get(key) is shard:
            del self.shards[key]

    # -- flags kept across restarts ---------------------------------------------

    def _flags_path(self) -> str:
        return str(self.config.state_dir / "flags.json")

    def _load_flags(self) -> None:
        try:
            with open(self._flags_path()) as f:
                data = json.load(f)
            self.cordoned = bool(data.get("cordoned"))
            self.draining = bool(data.get("draining"))
            epoch = data.get("epoch", 0)  # absent from a file of an older agent: 0
            if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
                self.epoch = epoch
        except (OSError, ValueError, AttributeError):
            pass

    def _save_flags(self) -> None:
        """Written whole, then renamed: a crash mid-write must not lose the epoch."""
        flags = {"cordoned": self.cordoned, "draining": self.draining, "epoch": self.epoch}
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
            partial = self._flags_path() + ".partial"
            with open(partial, "w") as f:
                json.dump(flags, f)
            os.replace(partial, self._flags_path())
        except OSError as exc:
            log.error("cannot keep the node's flags in %s: %s", self.config.state_dir, exc)


def engine_command(config: AgentConfig, spec: LaunchSpec) -> Command:
    """How this node launches `spec`: listening on `bind_host` (by default the address it
    advertises to routers, not every interface)."""
    engine = config.engines[spec.engine]
    return build_command(
        engine.command,
        EngineLaunch(
            engine=spec.engine,
            model=spec.hf_model,
            served_name=spec.model_name,
            host=config.bind_host,
            port=spec.port,
            gpu_indices=spec.gpu_indices,
            tensor_parallel=spec.tensor_parallel,
            pipeline_parallel=spec.pipeline_parallel,
            args=spec.args,
            env=tuple(sorted({**engine.env, **spec.env}.items())),
            nnodes=spec.nnodes,
            node_rank=spec.rank,
            master_addr=spec.head_address,
            master_port=spec.dist_port,
            api_key=spec.api_key,
            key_file=str(records.key_path(config.state_dir, spec)),
            max_model_len=spec.max_model_len,
            lora=spec.lora,
            max_lora_rank=spec.max_lora_rank,
            kv_events_port=spec.ports[2] if spec.kv_events else 0,
            kv_replay_port=spec.ports[3] if spec.kv_events else 0,
        ),
    )


def _shm_before(record: records.ShardRecord) -> frozenset[str] | None:
    return None if record.shm_before is None else frozenset(record.shm_before)


async def _clean_shm(record: records.ShardRecord) -> None:
    """What an engine that ended while the agent was away left in /dev/shm (its group is
    gone by now)."""
    before = _shm_before(record)
    if before is not None:
        await trio.to_thread.run_sync(clean_after, record.pid, before)


async def _hold_nursery(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    """A nursery that outlives every connection: the engines' home."""
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
