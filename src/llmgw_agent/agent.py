"""The agent daemon: dial the control plane, register, heartbeat, run what it is told.

One nursery owns everything: the engines (`engines.Engines`, with their own nursery)
run beside the connection loop rather than inside it, so that they keep serving while
the control plane is away, and the loop hands them the commands it receives; each
connection's reader, writer and heartbeat timer live in that connection's nursery and
end with it.

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
import random
from pathlib import Path
from typing import assert_never

import attrs
import trio
import trio_websocket

from llmgw_agent.config import AgentConfig
from llmgw_agent.engines import Engines
from llmgw_agent.following import ControlPlanes, Ended, lost_after, stale
from llmgw_agent.private_files import write_private
from llmgw_core import __version__
from llmgw_core.agent_lane import AGENT_DIAL_PATIENCE_S, MAX_COME_BACK_S
from llmgw_core.dial import ConnectFailed, open_agent_stream
from llmgw_core.inventory import Inventory
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


class Agent:
    def __init__(self, config: AgentConfig, inventory: Inventory) -> None:
        self.config = config
        self.inventory = inventory
        self.engines = Engines(config, inventory, self._send)
        self.cordoned = False
        self.draining = False
        self._outbox: trio.MemorySendChannel[str] | None = None
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
        async with trio.open_nursery() as nursery:
            # Started once adopted: the first registration reports the adopted engines.
            await nursery.start(self.engines.run)
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
                    len(self.engines.shards),
                )
                for update in self.engines.unsent_failures():
                    self._send(update)
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
            shards=self.engines.reports(),
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
            error = self.engines.start(message.spec)
            self._send(Ack(message.command_id, ok=not error, error=error))
        elif isinstance(message, Drain | Stop):
            key = (message.replica_id, message.rank)
            engines = self.engines
            found = engines.drain(key) if isinstance(message, Drain) else engines.stop(key)
            if not found:
                self._send(Ack(message.command_id, ok=False, error="no such shard"))
                return
            self._send(Ack(message.command_id))
        elif isinstance(message, Mark):
            self.cordoned, self.draining = message.cordoned, message.draining
            self._save_flags()
            self._send(Ack(message.command_id))
        elif isinstance(message, Welcome | Pace):  # a welcome out of turn; a pace: above
            self._send(Ack(0, ok=False, error=f"unexpected {type(message).__name__}"))
        else:
            assert_never(message)

    # -- flags kept across restarts ---------------------------------------------

    def _flags_path(self) -> Path:
        return self.config.state_dir / "flags.json"

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
            write_private(self._flags_path(), json.dumps(flags))
        except OSError as exc:
            log.error("cannot keep the node's flags in %s: %s", self.config.state_dir, exc)


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
