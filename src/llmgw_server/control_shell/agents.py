"""The agent streams: one websocket per node, and the only way to deliver a command to one.

Each stream is owned by one task, which reads it and hands each decoded message
to the control plane (whose handlers never wait), and answers each heartbeat
with a pong: the acknowledgement that tells the agent this control plane is
alive, so no ping is needed on a healthy stream. Commands wait in the node's
outbox; a task is started to write them when there are some and ends when they
are written, so an idle stream holds no task but its owner (with 10,000 nodes,
every task and channel per stream is memory). A bad frame, an unsupported
protocol version or a message out of order closes that one stream with a
reason; nothing else is touched.

A node the lifecycle declares unreachable while its stream is open has sent
nothing for `unreachable_after`: its stream is dead (the agent vanished, or the
route to it is black-holed) and is closed, so no task waits on it for TCP's
retransmission timeout; a live agent dials again and registers. Not while the
mass-loss guard holds, though: so many nodes silent at once most likely means
this control plane stalled with their heartbeats unread in its sockets, and
closing every stream would bring the whole fleet back at once.

One live stream per node name. A second registration for a node whose stream is
open asks the old stream for a pong: a live agent's websocket library answers at
once, so an answer within `OLD_STREAM_ANSWER_S` means two agents share the name
(a cloned machine, or its certificate copied) and the newcomer is refused, closed
with `NAME_HELD_CLOSE` and a reason both ends log; the first keeps the node.
No answer (a node that rebooted without a FIN, a black-holed route) and the old
stream is closed and the newcomer takes the node. Replacing at once, as before,
had two clones evict each other in turn, every turn withdrawing routes.

Registrations are served `REGISTRATIONS_AT_ONCE` at a time, in the order their
upgrade requests came; the others wait (a socket each, no work) before their 101.
Served all at once, a storm of agents shares the server's CPU among thousands
of half-done registrations, each finishing late: on the plaintext port, which
has no TLS admission in front, 5,000 nodes on a busy machine, whose agents gave
up after 10 s, registered 573 in 90 s (issue 17, finding 12).
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Container, Iterable
from typing import Any, Protocol, assert_never

import attrs
import trio

from llmgw_core.agent_lane import AGENT_QUEUE_S
from llmgw_core.awake_time import AwakeTime
from llmgw_core.inventory import LaunchSpec
from llmgw_core.logsafe import escaped, peer_address
from llmgw_core.tls_config import peer_identity
from llmgw_core.token_bucket import TokenBucket
from llmgw_core.wire import (
    MAX_FRAME_BYTES,
    NAME_HELD_CLOSE,
    PACE_PROTOCOL,
    STOPPING_CLOSE,
    Ack,
    DownMessage,
    Heartbeat,
    Pace,
    Register,
    ShardUpdate,
    UpMessage,
    Welcome,
    WireError,
    accepts,
    decode_up,
    encode,
)
from llmgw_http.server import ReplayStream, Request
from llmgw_http.ws_server import (
    PeerClosed,
    ServerWebSocket,
    accept_response,
    handshake_problem,
    head_and_rest,
    refusal,
)
from llmgw_server.control.heartbeat_pace import heartbeat_interval, new_pace
from llmgw_server.control.lifecycle import NodeStatus, NodeTransition
from llmgw_server.control_shell.metrics import ControlMetrics, StreamRefusal

log = logging.getLogger("llmgw.agentsvc")

AGENT_PATH = b"/v1/agent"
REGISTER_TIMEOUT_S = 10.0
OUTBOX_SIZE = 1024
# Streams between their 101 and their welcome. A turn waits on its agent most of the
# time (its register, up to REGISTER_TIMEOUT_S): a busy machine's slow agents held 128
# turns while the server idled (10,000 plaintext nodes, load 9-11). 1,024 still keeps
# a storm from spreading the server's CPU over every agent at once, and slow agents
# cannot hold registration under 100 a second.
REGISTRATIONS_AT_ONCE = 1024
# How long a stream a standby held through the election it won waits for its turn among
# the registrations: the agent has waited for its welcome since the hold began (it gives
# up after 10 s), so one that cannot be served soon is better sent to dial again.
ADOPTED_QUEUE_S = 1.0
# How long the open stream of a node registering again has to answer a ping (awake
# time, from when the ping goes out). A live agent's websocket library answers from
# its own reader task, whatever its loop is doing, within a round trip; 2 s is the
# shortest silence either end already takes for a dead stream (the agent's
# ws_frames.MIN_CUT_S), far under the 10 s an agent waits for its welcome (so the
# newcomer hears the outcome before it gives up) and under the heartbeat interval
# (unreachable_after_s / 3, 5 s by default): a refused clone costs the live node
# one ping, and a rebooted node's new stream waits 2 s, not unreachable_after_s.
OLD_STREAM_ANSWER_S = 2.0


_STOPPING = "the control plane is stopping (a restart): dial again"


class StreamClosed(Exception):
    """Close this stream with a reason the agent and the log both see."""

    def __init__(self, reason: str, code: int = 1008, kind: StreamRefusal = "protocol") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.kind = kind


class _Stream:
    """A registered node's stream: its outbox, and the scope its owner reads in."""

    __slots__ = (
        "cancel_scope",
        "close_code",
        "close_kind",
        "close_reason",
        "heartbeat_interval_s",
        "node",
        "nursery",
        "outbox",
        "pace",
        "peer",
        "woken",
        "ws",
    )

    def __init__(
        self, node: str, ws: ServerWebSocket, nursery: trio.Nursery, *, pace: bool, peer: str
    ) -> None:
        self.node = node
        self.ws = ws
        self.peer = peer
        # Set when the stream ends, while a registration of the same node waits on it.
        self.woken: trio.Event | None = None
        self.pace = pace  # its agent takes a Pace (protocol 2 on)
        self.heartbeat_interval_s = 0.0  # given in its welcome, then its last pace
        self.nursery = nursery  # the stream's own: a writer started in it ends with it
        self.outbox: deque[str] | None = None  # None while no writer runs
        self.cancel_scope = trio.CancelScope()
        self.close_reason = ""
        self.close_kind: StreamRefusal = "protocol"
        self.close_code: int | None = None  # None: 1008 with a reason, else 1000

    def queue(self, text: str) -> bool:
        """Queue a frame; False (and the stream closing) when too many wait unwritten."""
        if self.outbox is None:
            self.outbox = deque((text,))
            self.nursery.start_soon(self._write)
            return True
        if len(self.outbox) >= OUTBOX_SIZE:
            self.close(f"{OUTBOX_SIZE} messages wait unread", "backlog")
            return False
        self.outbox.append(text)
        return True

    async def _write(self) -> None:
        """Write the outbox in order, then end (the next frame starts a new writer)."""
        outbox = self.outbox
        assert outbox is not None
        try:
            while outbox:
                await self.ws.send(outbox[0])
                outbox.popleft()
        except PeerClosed:
            self.cancel_scope.cancel()  # the owner's read ends the stream
        finally:
            self.outbox = None

    def close(self, reason: str, kind: StreamRefusal) -> None:
        self.close_reason, self.close_kind = reason, kind
        self.cancel_scope.cancel()


class _Turn:
    """A registration's turn among REGISTRATIONS_AT_ONCE, given back once."""

    __slots__ = ("_held", "_turns")

    def __init__(self, turns: trio.Semaphore) -> None:
        self._turns = turns
        self._held = True

    def end(self) -> None:
        if self._held:
            self._held = False
            self._turns.release()


class AgentEvents(Protocol):
    """What the streams report to: the control plane (which imports this module, never
    the other way round)."""

    metrics: ControlMetrics
    clock: AwakeTime  # what a ping's answer window is counted in
    epoch: int  # its leadership's, on every message to an agent (0: no store)

    def registered(self, message: Register, heartbeat_interval_s: float) -> None: ...
    def heartbeat(self, node: str) -> None: ...
    def paced(self, node: str, heartbeat_interval_s: float) -> None: ...
    def disconnected(self, node: str) -> None: ...
    def shard_update(self, node: str, message: ShardUpdate) -> None: ...


class AgentService:
    def __init__(
        self,
        plane: AgentEvents,
        heartbeat_interval_s: float,
        *,
        heartbeats_per_s: float = float("inf"),
        require_certificates: bool = False,
        deny_serials: frozenset[int] = frozenset(),
    ) -> None:
        self.plane = plane
        self.require_certificates = require_certificates
        self.deny_serials = deny_serials
        # The shortest interval, given while the fleet's heartbeats stay within
        # `heartbeats_per_s`; longer past that (heartbeat_pace).
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeats_per_s = heartbeats_per_s
        self.streams: dict[str, _Stream] = {}
        self.registering = trio.Semaphore(REGISTRATIONS_AT_ONCE)  # FIFO
        self._claimed: set[str] = set()  # nodes whose open stream is being asked for a pong
        self._command_ids = 0
        self.metrics = plane.metrics
        self.stopping = False  # this control plane is going away: no stream is taken
        self.streams_closed = trio.Event()  # set once stopping and no stream is left

    def stop_streams(self) -> None:
        """The control plane stops cleanly (a restart): close every stream, and each one
        that registers from now on, with STOPPING_CLOSE, so that its agent dials again
        after a small jitter (the next process's) rather than after its backoff. Called
        once requests in flight have drained: before then, the agents' redials would only
        reach this process again."""
        self.stopping = True
        if self.streams:
            log.info("closing %d agent streams: the control plane is stopping", len(self.streams))
        for stream in self.streams.values():
            stream.close_code = STOPPING_CLOSE
            stream.close(_STOPPING, "protocol")
        if not self.streams:
            self.streams_closed.set()

    def send(self, node: str, message: DownMessage) -> bool:
        """Queue a message for a node, stamped with this control plane's epoch (read at
        each send: a leadership won again has a new one); False when the node has no open
        stream."""
        stream = self.streams.get(node)
        if stream is None:
            return False
        epoch = self.plane.epoch
        if message.epoch != epoch:
            message = attrs.evolve(message, epoch=epoch)
        if not stream.queue(encode(message)):
            return False
        self.metrics.frame_out(message)
        return True

    def close_silent(self, transitions: Iterable[NodeTransition], guard: str | None) -> None:
        """Close the streams of nodes that `transitions` declare no longer reachable, unless
        the mass-loss `guard` holds (as `silent_streams` decides)."""
        for node, reason in silent_streams(transitions, self.streams, guard):
            self.streams[node].close(reason, "silent")

    def next_command_id(self) -> int:
        self._command_ids += 1
        return self._command_ids

    async def serve_upgrade(self, request: Request, raw: trio.abc.Stream) -> None:
        """The control port's upgrade handler: one agent stream per connection.

        The request is already parsed: the websocket handshake is answered here, and
        `raw` (which first gives back the bytes read so far) is read for what followed
        the head."""
        if request.path != AGENT_PATH:
            await _refuse(raw, 404, b"Not Found", b"the agent stream is at /v1/agent")
            return
        certificate = raw.peer_certificate() if isinstance(raw, ReplayStream) else None
        if self.require_certificates and not certificate:
            log.warning(
                "refused an agent stream from %s: no client certificate", peer_address(raw)[1]
            )
            self.metrics.streams_refused["no_certificate"] += 1
            await _refuse(
                raw, 403, b"Forbidden", b"a client certificate signed by the fleet CA is required"
            )
            return
        problem = handshake_problem(request)
        if problem is not None:
            await _refuse(raw, 400, b"Bad Request", problem.encode())
            return
        # Its turn among the registrations, within what an agent waits (its dial's
        # patience covers this queue): past that it is told to come back later.
        with trio.move_on_after(AGENT_QUEUE_S) as queued:
            await self.registering.acquire()
        if queued.cancelled_caught:
            await _refuse(
                raw,
                503,
                b"Service Unavailable",
                b"the control plane is busy registering other nodes: dial again later",
            )
            return
        registration = _Turn(self.registering)  # ended at the welcome, or with the stream
        try:
            rest = b""
            if isinstance(raw, ReplayStream):  # it gives back the head, and what came after
                rest = head_and_rest(bytes(await raw.receive_some()))
            try:
                await raw.send_all(accept_response(request))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            await self._serve_stream(raw, rest, certificate, registration)
        finally:
            registration.end()

    async def serve_accepted(self, request: Request, raw: trio.abc.Stream, rest: bytes) -> bool:
        """An agent's stream already answered 101 (a standby held it through the election
        this control plane then won): served as if it had just been upgraded here, its
        register read from `rest` and what follows. False (the stream untouched) when it
        is no agent's stream or no turn among the registrations comes within
        ADOPTED_QUEUE_S: the caller sends its peer here again."""
        if request.path != AGENT_PATH:
            return False
        certificate = raw.peer_certificate() if isinstance(raw, ReplayStream) else None
        with trio.move_on_after(ADOPTED_QUEUE_S) as queued:
            await self.registering.acquire()
        if queued.cancelled_caught:
            return False
        registration = _Turn(self.registering)
        try:
            # Checked at its register, as any stream's: a missing one is refused there.
            await self._serve_stream(raw, rest, certificate, registration)
        finally:
            registration.end()
        return True

    async def _serve_stream(
        self,
        raw: trio.abc.Stream,
        rest: bytes,
        certificate: dict[str, Any] | None,
        registration: _Turn,
    ) -> None:
        ws = ServerWebSocket(raw, rest, MAX_FRAME_BYTES)
        async with trio.open_nursery() as nursery:
            try:
                await self._serve(ws, nursery, peer_address(raw)[1], certificate, registration)
            finally:
                nursery.cancel_scope.cancel()

    def _check_identity(self, name: str, certificate: dict[str, Any] | None, peer: str) -> None:
        """A node registers only under the name its certificate carries, and not when denied."""
        if not self.require_certificates:
            return
        holder = peer_identity(certificate)
        if holder != name:
            raise StreamClosed(
                f"the certificate from {peer} is for {holder!r}, but it registered as {name!r}",
                kind="identity",
            )
        assert certificate is not None
        serial = int(str(certificate.get("serialNumber", "0")), 16)
        if serial in self.deny_serials:
            raise StreamClosed(
                f"the certificate of {name} (serial {serial:x}) is on the deny list", kind="denied"
            )

    async def _serve(
        self,
        ws: ServerWebSocket,
        nursery: trio.Nursery,
        peer: str,
        certificate: dict[str, Any] | None,
        registration: _Turn,
    ) -> None:
        stream: _Stream | None = None
        try:
            with trio.move_on_after(REGISTER_TIMEOUT_S) as register_scope:
                frame = await ws.receive()
            if register_scope.cancelled_caught:
                raise StreamClosed(f"no registration within {REGISTER_TIMEOUT_S:g} s")
            if self.stopping:
                raise StreamClosed(_STOPPING, code=STOPPING_CLOSE)
            register = self._decode(frame)
            if not isinstance(register, Register):
                raise StreamClosed(
                    f"the first message must be register, not {type(register).__name__}"
                )
            refused = accepts(register.protocol)
            if refused is not None:
                raise StreamClosed(refused)
            _check_node_name(register.inventory.name)
            self._check_identity(register.inventory.name, certificate, peer)
            certificate = None  # checked: not kept for the stream's life
            _check_own_shards(register.inventory.name, [s.spec for s in register.shards])
            await self._claim(register.inventory.name, peer)
            stream = _Stream(
                register.inventory.name,
                ws,
                nursery,
                pace=register.protocol >= PACE_PROTOCOL,
                peer=peer,
            )
            self.streams[stream.node] = stream
            log.info(
                "node %s registered from %s with %d shards", stream.node, peer, len(register.shards)
            )
            interval = stream.heartbeat_interval_s = self._fleet_interval()
            # The agent's own version: one behind during a rolling upgrade.
            self.send(stream.node, Welcome(register.protocol, interval))
            self.plane.registered(register, interval)
            registration.end()  # the next agent's turn
            del register
            with stream.cancel_scope:
                budget = TokenBucket(_RATE, _BURST)  # an agent that floods is closed, not obeyed
                while True:
                    frame = await ws.receive()
                    if not budget.take(trio.current_time()):
                        raise StreamClosed(
                            f"more than {_BURST} messages in a burst "
                            f"(at most {_RATE:g} a second are allowed)",
                            kind="flood",
                        )
                    message = self._decode(frame)
                    self._dispatch(stream.node, message)
                    if isinstance(message, Heartbeat):
                        await ws.pong()  # the ack: this control plane read it
                        self._repace(stream)
            code = stream.close_code or (1008 if stream.close_reason else 1000)
            raise StreamClosed(stream.close_reason, code=code, kind=stream.close_kind)
        except PeerClosed:
            pass  # the agent went away (a reason it gave is its own: nothing to add)
        except StreamClosed as closed:
            if closed.reason and closed.code != STOPPING_CLOSE:  # said once, by stop_streams
                self.metrics.streams_refused[closed.kind] += 1
                log.warning(
                    "closing the stream of %s: %s",
                    stream.node if stream else peer,
                    escaped(closed.reason),  # it may quote what the node sent
                )
            await ws.close(closed.code, closed.reason)
        finally:
            if stream is not None and self.streams.get(stream.node) is stream:
                del self.streams[stream.node]
                log.info("node %s disconnected", stream.node)
                self.plane.disconnected(stream.node)
                if stream.woken is not None:
                    stream.woken.set()
                if self.stopping and not self.streams:
                    self.streams_closed.set()

    async def _claim(self, node: str, peer: str) -> None:
        """Take `node`'s name for a stream from `peer`: at once when no stream holds it;
        else once its stream has not answered a ping within OLD_STREAM_ANSWER_S (it is
        closed, "replaced"). Raises StreamClosed (NAME_HELD_CLOSE) while it answers, or
        while another registration of the node waits on it."""
        old = self.streams.get(node)
        if old is None:
            return
        held = f"node {node} is connected from {old.peer}"
        if node in self._claimed:
            raise StreamClosed(
                f"{held}, and another agent's registration under its name is being checked",
                code=NAME_HELD_CLOSE,
                kind="duplicate",
            )
        self._claimed.add(node)
        woken = old.woken = trio.Event()  # a pong, or the old stream's end
        try:
            answered = await answers(old.ws, woken, OLD_STREAM_ANSWER_S, self.plane.clock)
        finally:
            self._claimed.discard(node)
            old.woken = None
        if self.streams.get(node) is not old:
            return  # it ended meanwhile: the name is free
        if answered:
            raise StreamClosed(
                f"{held} and answers: this second agent with its name is refused "
                "(a cloned machine or certificate?)",
                code=NAME_HELD_CLOSE,
                kind="duplicate",
            )
        log.warning(
            "node %s connected again from %s; its stream from %s did not answer a ping "
            "within %g s: closing it",
            node,
            peer,
            old.peer,
            OLD_STREAM_ANSWER_S,
        )
        old.close(
            f"node {node} connected again from {peer}; this stream did not answer a ping "
            f"within {OLD_STREAM_ANSWER_S:g} s",
            "replaced",
        )

    def _fleet_interval(self) -> float:
        return heartbeat_interval(
            len(self.streams), self.heartbeat_interval_s, self.heartbeats_per_s
        )

    def _repace(self, stream: _Stream) -> None:
        """Tell the node the fleet's interval, if it has moved far from its own."""
        wanted = self._fleet_interval()
        if stream.pace and new_pace(stream.heartbeat_interval_s, wanted):
            stream.heartbeat_interval_s = wanted
            self.send(stream.node, Pace(wanted))
            self.plane.paced(stream.node, wanted)

    def _decode(self, frame: str | bytes) -> UpMessage:
        try:
            message = decode_up(frame)
        except WireError as exc:
            self.metrics.bad_frame()
            raise StreamClosed(str(exc)) from None
        self.metrics.frame_in(message)
        return message

    def _dispatch(self, node: str, message: UpMessage) -> None:
        if isinstance(message, Heartbeat):
            self.plane.heartbeat(node)
        elif isinstance(message, ShardUpdate):
            _check_own_shards(node, [message.report.spec])
            self.plane.shard_update(node, message)
        elif isinstance(message, Ack):
            if not message.ok:
                log.warning(
                    "node %s refused command %d: %s",
                    node,
                    message.command_id,
                    escaped(message.error),
                )
        elif isinstance(message, Register):
            raise StreamClosed(f"{type(message).__name__} is out of order after registration")
        else:
            assert_never(message)


class Pinger(Protocol):
    async def ping(self, payload: bytes, answered: trio.Event) -> None: ...


async def answers(ws: Pinger, woken: trio.Event, within_s: float, clock: AwakeTime) -> bool:
    """Whether `woken` is set (the peer's pong, or the stream's end: the caller tells
    which) within `within_s` of awake time from when the ping goes out. A stall of this
    process is not the peer's silence: the pong waits unread in the socket, and the
    stream's owner reads it when the loop runs again, before awake time has moved on."""
    deadline = clock.awake(trio.current_time()) + within_s
    pinged = False
    while True:
        with trio.move_on_at(clock.monotonic(deadline, trio.current_time())):
            if not pinged:
                try:
                    await ws.ping(secrets.token_bytes(8), woken)
                except PeerClosed:
                    return False  # ended: gone from the streams, or closed with them
                pinged = True
            await woken.wait()
            return True
        # A ping that could not even be written in time (a full socket) is no answer.
        if not pinged or clock.awake(trio.current_time()) >= deadline:
            return False


def silent_streams(
    transitions: Iterable[NodeTransition], open_streams: Container[str], guard: str | None
) -> list[tuple[str, str]]:
    """The nodes whose open stream must close, with the reason, for these transitions,
    the lifecycle's mass-loss `guard` (its reason, None when it does not hold) as they left it.

    A stream that closed first has already left `open_streams`, so its own
    "stream closed" transition closes nothing. While the guard holds, a node turning
    unreachable keeps its stream: the control plane itself may have stalled past
    `unreachable_after` with every heartbeat waiting unread, and closing every stream
    would have the whole fleet dial and register again at once. Such a stream that
    really is dead ends otherwise: the agent cuts it for silence and registers anew
    (which replaces it), or the node is declared lost once the guard has released.
    """
    return [
        (t.node, f"declared {t.new}: {t.reason}")
        for t in transitions
        if t.node in open_streams
        and (t.new is NodeStatus.LOST or (t.new is NodeStatus.UNREACHABLE and guard is None))
    ]


_RATE = 50.0  # messages a second, sustained: heartbeats and transitions need far fewer
_BURST = 500


NODE_NAME_MAX = 253  # a DNS name's length: a node's name is its certificate's


def _check_node_name(name: str) -> None:
    """A node's name goes into every log line and status about it: printable and bounded,
    checked once at registration (what comes later is escaped where it is logged)."""
    if not name or len(name) > NODE_NAME_MAX or not name.isprintable():
        # Raw here: the log line escapes the reason, the agent gets its own words back.
        raise StreamClosed(
            f"a node name must be 1 to {NODE_NAME_MAX} printable characters, not '{name[:40]}'"
        )


def _check_own_shards(node: str, specs: list[LaunchSpec]) -> None:
    for spec in specs:
        if spec.node != node:
            raise StreamClosed(
                f"{node} reports replica {spec.replica_id} rank {spec.rank}, "
                f"which belongs to node {spec.node}"
            )


async def _refuse(raw: trio.abc.Stream, status: int, reason: bytes, body: bytes) -> None:
    with trio.move_on_after(2):
        try:
            await raw.send_all(refusal(status, reason, body))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
