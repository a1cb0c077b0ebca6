"""Admission of TLS handshakes on the control port: no anonymous peer can hold it, and
a storm of agents is refused cheaply, before any SSL object, when it cannot be served.

The port faces every node and every operator, before any credential is seen. What a
connection may hold, and for how long:

- Every connection must have sent its whole ClientHello `deadline_s` (3 s) after it
  was accepted, and may then wait for a place in its lane until a deadline counted
  from its arrival in the kernel (its age there read from TCP_INFO, so time spent
  in the accept queue counts): an agent's up to `agents_queue_s` (30 s), since
  agents wait that long (llmgw_core.agent_lane.AGENT_DIAL_PATIENCE_S), anyone
  else's up to `others_queue_s` (10 s, what an operator's client waits; a storm
  keeps connections in the kernel's queue for seconds). Once it has its place its
  handshake has `deadline_s`, and, but for an agent's, its client's Finished is due
  `flight_answer_s` (1 s) after the server's flight was sent: a peer that reads the
  flight and says nothing more frees its place within a second. A silent, trickling
  or stalled handshake is cut within 3 s; a queued connection holds a socket and no
  slot or place, and is served in its turn instead of dialling again.
- A handshake slot (`handshakes_at_once`) is taken only once the whole ClientHello
  is buffered in the kernel (peeked, with SO_RCVLOWAT so that waiting for the rest
  costs no wake-ups), and given back as soon as the server has sent its first
  flight: a slot covers the server's own CPU (the signature, ~1 ms), never a wait
  for the peer. A silent or slow peer therefore holds no slot at all, whatever it
  does, and slots pace CPU instead of being held by slow clients.
- A connection is pending from accept to the end of its handshake; past
  `per_source_pending` from one source address a new connection is reset at once
  (SO_LINGER 0): it costs an accept and a close, no SSL object. While `max_pending`
  in all are accepted and their hellos not yet whole, nothing more is accepted:
  connections wait in the kernel's accept queue, where their hellos arrive and
  their age counts, and are sorted at once when their turn comes. A client that
  reached the server too late to finish within its deadline (`min_left_s`) is reset
  the same way, as is one whose deadline is too near once its place comes: the
  server serves only clients that will still be there. An agent refused (or one
  not yet sorted into a lane) is first told when to come back, in a line written
  in place of the first TLS record (agent_lane.come_back_line): once the agents'
  lane has served half its queue, and after every agent refused before it, at its
  measured rate, with a little jitter. The refused come back once, in turn, instead of
  redialling at random into a full queue (finding 12: 4 dials a node at 10,000).
- Work past the handshake is bounded too: a whole hello takes an in-flight place
  in its lane before its handshake, held until the connection has had its
  answers (an agent: the websocket's 101 and the welcome; anyone else: one answer),
  closes, or `in_flight_s` has passed. Three lanes, told apart by the ClientHello
  alone: agents offer the ALPN name `llmgw-agent` (AGENT_ALPN), routers apart
  `llmgw-router` (ROUTER_ALPN), everyone else (operators' CLI, browsers, curl) is
  in the third lane, so a registration storm cannot crowd operators out, nor
  operators agents, nor anonymous peers routers. A lane decides the order of
  admission, never trust: a router still needs its token, an agent its certificate.
  In the operators' and the routers' lanes one source address (an IPv6 /64) holds
  at most `per_source_in_flight` places (2 of 16) and `per_source_queued` waiting
  hellos (past that it is reset), and a place given back goes to the source holding
  the fewest: 300 stalled hellos from 8 addresses hold the places they take for a
  second each, and an operator gets the next one. A hello waits for a place in
  its turn while the lane's queue holds no more than the lane serves within its
  queue deadline (its measured rate of places given back, in seconds when every
  place was taken; agents' queues at most `max_queued`); past that it is reset
  before any SSL object. Without this bound a storm on a starved server completed
  thousands of TLS handshakes whose clients then gave up during the websocket
  handshake (measured at 2,000 nodes: 3,463 of 6,381 dials); with agents given up
  after 10 s and queues of 2.5 s, a storm of 10,000 took 4 dials a node.

An attacker from one address can hold `per_source_pending` sockets for 3 s each, and
in the operators' (or the routers') lane 2 places for a second each and 6 waiting
hellos, and nothing else (for 30 s if they offer agents' hellos, in the agents' queue,
where filling it takes max_queued / per_source_pending addresses: 128); holding every
pending place (which holds new connections in the kernel's queue, as resets did
before) takes max_pending / per_source_pending addresses (16 with the defaults),
each redialling 340 times a second. Turns given to refused agents cannot be pushed
back by one address (its own refusals take none) and never past MAX_COME_BACK_S.
Operators behind the address of such an attacker (one NAT) share its two places: the
accepted cost of telling peers apart by address before any credential.

The decisions (`TLSAdmission`, `hello_bytes_needed`, `lane_of`, `source_key`) are
plain code fed the source, the ages and the bytes; the trio shell (`admit`,
`handshake`) only reads the socket and carries them out.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket
import ssl
import struct
from collections import Counter, deque
from collections.abc import Awaitable, Callable

import attrs
import trio

from llmgw_core.agent_lane import (
    AGENT_ALPN,
    AGENT_QUEUE_S,
    LOST_LEADER_ALPN,
    MAX_COME_BACK_S,
    ROUTER_ALPN,
    come_back_line,
    lost_epoch,
)
from llmgw_core.ratelog import RateLimit
from llmgw_http import sockio
from llmgw_http.sockio import peer_left

log = logging.getLogger(__name__)

_TLS_HANDSHAKE_RECORD = 0x16
HELLO_MAX_BYTES = 32 * 1024  # real ClientHellos are under 2 KiB, post-quantum shares included
_TCPI_LAST_DATA_SENT = 44  # offset in Linux's struct tcp_info (u32, milliseconds)
_TCP_INFO_BYTES = 104
_REFUSED_OPEN_S = 0.5  # how long a refused connection stays open for its come-back line
# Refused connections open at once (past that: reset at once, the line unsaid): a lost
# leader's whole fleet is answered within half a second, by the control plane after it.
_REFUSED_OPEN_MAX = 8192
# How long an agent's hello may wait for the answer its control plane gives before any
# TLS (Gate.redirect): the socket alone, no SSL object, while an election ends.
ANSWER_WAIT_S = 3.0


@attrs.frozen
class AdmissionLimits:
    handshakes_at_once: int = 32  # server flights being computed at once (CPU, not peers)
    # From a connection's accept to its whole hello, and from its place to its
    # handshake's end.
    deadline_s: float = 3.0
    agents_queue_s: float = AGENT_QUEUE_S  # from an agent's arrival to its place
    others_queue_s: float = 10.0  # from anyone else's arrival to its place
    max_pending: int = 1024  # connections between accept and their whole hello
    per_source_pending: int = 64  # from one source address, until their handshakes end
    max_queued: int = 8192  # agents' hellos waiting for a place (each holds a socket)
    min_left_s: float = 0.5  # a handshake begun with less time left would not finish
    # Agents between their hello and their welcome: as many as the lane gives back in
    # `in_flight_target_s` at its measured rate (Little's law: a registration then takes
    # about that long, well within an agent's patience), within these bounds. The floor
    # is high because a place waits on its agent most of the time (round trips, its
    # register), not on this server's CPU, which the handshake slots bound: with 32, a
    # storm of slow agents (a busy machine's) held every place while the server idled,
    # the rate measured fell with it, and the queue bound refused thousands.
    agents_in_flight: tuple[int, int] = (256, 2048)
    others_in_flight: int = 16  # anyone else between the hello and the first answer
    routers_in_flight: int = 16  # routers apart (ROUTER_ALPN) between the hello and the 101
    # In the operators' and the routers' lanes, what one source address (an IPv6 /64)
    # may hold: places (an eighth of the 16) and hellos waiting for one (a browser's 6
    # connections to a host wait their turn). Past that its next hello is reset, and a
    # place given back goes to a source holding fewer (Lane.ready): a few addresses
    # cannot keep the lane (issue 34: 300 stalled hellos from 8 let 0 of 18 admin
    # requests through within 5 s).
    per_source_in_flight: int = 2
    per_source_queued: int = 6
    # In those lanes, how long the client's Finished may take after the server's flight:
    # one round trip and a millisecond of the client's CPU, a satellite link's included.
    # A peer that reads the flight and says nothing more held its place for deadline_s.
    # Agents keep deadline_s: a booting fleet's starved simulator answered that late
    # (docs/performance.md), and their lane holds a storm's places.
    flight_answer_s: float = 1.0
    in_flight_target_s: float = 3.0
    in_flight_s: float = 10.0  # the longest a connection holds its place (an agent's budget)
    # Places given back a second, assumed until measured (a cold start into a storm):
    # one core registers a few hundred agents a second; this is a busy machine's share.
    assumed_rate: float = 50.0
    # A refused agent's come-back time is spread over this much more (stragglers told
    # the same turn never dial at the same instant).
    come_back_jitter_s: float = 2.0
    # Turns are given as if the lane served this many times its measured rate. Most
    # agents are refused in a storm's first seconds, when the rate measured is a starved
    # one (the booting fleet shares the cores), and their turns cannot be taken back:
    # given at that rate, they kept a 10,000-node fleet coming back at half what the
    # server then served, and the machine half idle (105 s to register all). Too early
    # costs a returning agent a place in a queue that holds half a minute of work; a
    # queue past its bound refuses it again, with a later turn.
    come_back_overbook: float = 2.0


AGENTS, OTHERS, ROUTERS = "agents", "others", "routers"


REFUSED_FULL = "too many handshakes pending"
REFUSED_SOURCE = "too many handshakes pending from this address"
REFUSED_LATE = "waited too long in the accept queue"
SHED_LATE = "waited too long for a handshake slot"
REFUSED_BUSY = "more hellos queued than the server can serve in time"
REFUSED_SOURCE_QUEUED = "too many hellos waiting from this address"


@attrs.define
class Lane:
    """Connections of one kind between their whole hello and their answers."""

    min_places: int
    max_places: int
    per_source: int | None = None  # places one source may hold (None: no cap)
    per_source_queued: int | None = None  # hellos one source may have waiting
    waiting: int = 0  # whole hellos queued for a place
    in_flight: int = 0
    begun: int = 0  # places ever taken (tests tell the lanes apart by it)
    held: Counter[str] = attrs.field(factory=Counter)  # places in flight, per source
    queued: Counter[str] = attrs.field(factory=Counter)  # hellos waiting, per source
    # Sources with a hello waiting that may take a place, by how many places they hold
    # (one level without a cap), each level in the order its sources joined it: a place
    # goes to a source holding the fewest, its oldest hello first, and a source that
    # took one goes to the back. So sources take turns, and a source given a place back
    # does not take it again ahead of one that holds none (FIFO did: 8 addresses at
    # their cap held all 16 places, and an operator waited behind their queue).
    ready: list[dict[str, None]] = attrs.field(init=False)
    rate: float | None = None  # places given back a second, while every one was taken
    bucket_start: float = 0.0
    bucket_done: int = 0
    bucket_busy: bool = False
    promised_until: float = 0.0  # the last come-back turn given to a refused agent

    def __attrs_post_init__(self) -> None:
        self.ready = [{} for _ in range(self.per_source or 1)]

    def level(self, source: str) -> int | None:
        """Where `source` is in `ready`: None when it waits for nothing or is at its cap."""
        if not self.queued[source]:
            return None
        if self.per_source is None:
            return 0
        held = self.held[source]
        return held if held < self.per_source else None

    def refile(self, source: str, before: int | None) -> None:
        """Move `source` from level `before` to where it is now (at the back of it)."""
        after = self.level(source)
        if before == after:
            return
        if before is not None:
            del self.ready[before][source]
        if after is not None:
            self.ready[after][source] = None

    def count(self, counter: Counter[str], source: str, step: int) -> None:
        counter[source] += step
        if counter[source] <= 0:
            del counter[source]

    def roll(self, now: float) -> None:
        """After each second in which every place was taken, the rate moves halfway to
        what that second did (a quiet second says nothing of capacity)."""
        elapsed = now - self.bucket_start
        if elapsed < 1.0:
            return
        if self.bucket_busy and elapsed < 2.0:  # (a longer gap had no events: no measure)
            observed = self.bucket_done / elapsed
            self.rate = observed if self.rate is None else (self.rate + observed) / 2
        self.bucket_start, self.bucket_done, self.bucket_busy = now, 0, False

    def places(self, limits: AdmissionLimits) -> int:
        rate = limits.assumed_rate if self.rate is None else self.rate
        wanted = int(rate * limits.in_flight_target_s)
        return min(self.max_places, max(self.min_places, wanted))


@attrs.define
class TLSAdmission:
    """Who may begin a handshake: counts of pending connections per source, the lanes,
    and how many connections were turned away, per reason (for metrics and tests)."""

    limits: AdmissionLimits = attrs.field(factory=AdmissionLimits)
    pending: Counter[str] = attrs.field(factory=Counter)
    refused: Counter[str] = attrs.field(factory=Counter)
    total_pending: int = 0
    lanes: dict[str, Lane] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        limits = self.limits
        capped = (limits.per_source_in_flight, limits.per_source_queued)
        self.lanes = {
            AGENTS: Lane(*limits.agents_in_flight),
            OTHERS: Lane(limits.others_in_flight, limits.others_in_flight, *capped),
            ROUTERS: Lane(limits.routers_in_flight, limits.routers_in_flight, *capped),
        }

    def arrive(self, source: str, age_s: float) -> str | None:
        """A connection accepted from `source` after `age_s` in the kernel's queue:
        None when it is admitted (pending until `leave`), else why it is refused."""
        why: str | None = None
        if age_s > self.limits.agents_queue_s - self.limits.min_left_s:
            why = REFUSED_LATE  # too late for any lane (its hello will say which)
        elif self.total_pending >= self.limits.max_pending:
            why = REFUSED_FULL
        elif self.pending[source] >= self.limits.per_source_pending:
            why = REFUSED_SOURCE
        if why is not None:
            self.refused[why] += 1
            return why
        self.pending[source] += 1
        self.total_pending += 1
        return None

    def leave(self, source: str, unsorted: bool = True) -> None:
        """An admitted connection's handshake ended (done, failed or cut); `unsorted`:
        before its hello was whole (still counted against max_pending)."""
        if unsorted:
            self.total_pending -= 1
        self.pending[source] -= 1
        if self.pending[source] <= 0:
            del self.pending[source]

    def deadline(self, accepted_at: float) -> float:
        """When an admitted connection's hello must be whole (trio's clock): a peer
        holds a pending place no longer, whatever it does."""
        return accepted_at + self.limits.deadline_s

    def queue_deadline(self, lane: str, arrived: float) -> float:
        """When a hello that arrived (in the kernel) at `arrived` must have its place."""
        return arrived + self._queue_s(lane)

    def _queue_s(self, lane: str) -> float:
        return self.limits.agents_queue_s if lane == AGENTS else self.limits.others_queue_s

    def queue_bound(self, lane: str) -> float:
        """The hellos that may wait for a place: as many as the lane gives back (at its
        measured rate) within its queue deadline, less the time a handshake takes. The
        agents' lane counts itself no slower than assumed_rate: a storm that arrives at
        once (a failover's fleet) holds every place for whole registrations in its first
        second, which measured ~5 places given back a second where the lane then served
        300, and cut the queue to its floor: the rest of the fleet was refused with
        come-back turns (737 in 4 failovers of 1,000 agents, the last back 5.3-7.5 s
        after the fault instead of about 4)."""
        held = self.lanes[lane]
        rate = self.limits.assumed_rate if held.rate is None else held.rate
        if lane == AGENTS:
            rate = max(rate, self.limits.assumed_rate)
        within = self._queue_s(lane) - self.limits.min_left_s
        return max(float(held.min_places), min(rate * within, float(self.limits.max_queued)))

    def come_back_s(self, now: float, why: str, jitter: float) -> float:
        """When an agent refused for `why` should dial again, in seconds: once the agents'
        lane has served half what it holds (it then still has work for half its queue
        deadline, so the server never idles while refused agents wait, and a returning
        agent waits in the queue well within its patience), and after every agent
        refused before it, one turn per 1 / rate: the refused come back each once, at
        about the rate the lane serves them. Plus `jitter` (in [0, 1)) of
        come_back_jitter_s. The rate is the lane's measured one times
        come_back_overbook, the measured one never below assumed_rate: a storm's
        first second measures few places given back (registrations take seconds), and
        turns given too late leave the server idle, where turns too early cost a
        refused agent one more connect and no handshake. A source refused for its own
        flood is told when the queue is half served, and holds no turn: one address
        must not push the fleet's turns back.

        No turn lies past the queue deadline: by then the lane has measured its own
        rate, where a storm's first seconds measure the starved fleet's (places held by
        agents slow to answer, the server's CPU idle). A turn past it is drawn at random
        from the deadline's second half (`jitter`) instead, and takes no place in the
        order: an agent that comes back to a queue past its bound is given another.
        Turns given in order at the first seconds' rate had a failover's 10,000 agents
        come back over a minute while the server, its queue served, idled (every agent
        back after 80 s, the queue empty after 40)."""
        held = self.lanes[AGENTS]
        rate = max(self.limits.assumed_rate, held.rate or 0.0, 1.0) * self.limits.come_back_overbook
        half = (self.limits.agents_queue_s - self.limits.min_left_s) / 2
        turn = now + max(0.0, (held.waiting + held.in_flight) / rate - half)
        if why != REFUSED_SOURCE:
            turn = max(turn, held.promised_until)
            if turn > now + 2 * half:
                return min(half * (1.0 + jitter), MAX_COME_BACK_S)
            held.promised_until = turn + 1.0 / rate
        wait = turn - now + jitter * self.limits.come_back_jitter_s
        return min(wait, MAX_COME_BACK_S)

    def answer_deadline(self, lane: str, now: float, handshake_by: float) -> float:
        """When a handshake whose server flight was sent at `now` must end: the client's
        Finished is due `flight_answer_s` later (agents': their handshake deadline)."""
        if lane == AGENTS:
            return handshake_by
        return min(handshake_by, now + self.limits.flight_answer_s)

    def sorted(self) -> None:
        """An admitted connection's hello is whole: its lane is known, and it no longer
        counts against max_pending (its lane's queue bounds it from now on)."""
        self.total_pending -= 1

    def hello(
        self, lane: str, now: float, arrived: float | None = None, source: str = "?"
    ) -> str | None:
        """A whole ClientHello from `source` arrived (its connection in the kernel at
        `arrived`): None when it joins its lane's queue for a place (until `grant` or
        `unqueue`), else why it is refused, before any SSL object: it came too late for
        its lane, its source has its share of the queue, or it would wait past its
        deadline, its handshake work thrown away. In a lane with per-source caps, the
        first hello of a source with none waiting is queued past that bound (up to
        max_queued): a few sources filling the queue must not refuse everyone else."""
        held = self.lanes[lane]
        held.roll(now)
        left = None if arrived is None else self.queue_deadline(lane, arrived) - now
        mine = held.queued[source]
        why = None
        if left is not None and left < self.limits.min_left_s:
            why = REFUSED_LATE
        elif held.per_source_queued is not None and mine >= held.per_source_queued:
            why = REFUSED_SOURCE_QUEUED
        elif held.waiting >= self.queue_bound(lane) and (
            held.per_source is None or mine or held.waiting >= self.limits.max_queued
        ):
            why = REFUSED_BUSY
        if why is not None:
            self.refused[why] += 1
            return why
        if held.in_flight + held.waiting >= held.places(self.limits):
            held.bucket_busy = True  # the places are the limit: this second shows capacity
        before = held.level(source)
        held.waiting += 1
        held.count(held.queued, source, 1)
        held.refile(source, before)
        return None

    def unqueue(self, lane: str, source: str = "?") -> None:
        """A queued hello left the queue without a place (cut at its deadline)."""
        held = self.lanes[lane]
        before = held.level(source)
        held.waiting -= 1
        held.count(held.queued, source, -1)
        held.refile(source, before)

    def grant(self, lane: str) -> str | None:
        """A place for the oldest queued hello of the source holding the fewest (and below
        its cap), taken now (held until `done` or `shed`): that source, or None when the
        lane has no room or nobody may take one."""
        held = self.lanes[lane]
        if held.in_flight >= held.places(self.limits):
            return None
        level = next((level for level in held.ready if level), None)
        if level is None:
            return None
        source = next(iter(level))
        del level[source]  # to the back of the level it joins next
        held.waiting -= 1
        held.in_flight += 1
        held.begun += 1
        held.count(held.queued, source, -1)
        held.count(held.held, source, 1)
        held.refile(source, None)
        return source

    def start(self, lane: str, source: str, now: float, deadline: float) -> bool:
        """A hello granted a place begins its handshake only if it can still finish in
        time; else the place is shed."""
        if deadline - now >= self.limits.min_left_s:
            return True
        self.refused[SHED_LATE] += 1
        self.shed(lane, source)
        return False

    def shed(self, lane: str, source: str) -> None:
        """A place granted and never used (too late, or its connection cut first): given
        back, and not counted as served."""
        held = self.lanes[lane]
        before = held.level(source)
        held.in_flight -= 1
        held.count(held.held, source, -1)
        held.refile(source, before)

    def done(self, lane: str, source: str, now: float) -> None:
        """A place given back (answered, closed, failed or timed out): counts for the rate."""
        held = self.lanes[lane]
        held.roll(now)
        self.shed(lane, source)
        held.bucket_done += 1


def offered_alpn(hello: bytes) -> list[bytes]:
    """The ALPN names a whole ClientHello offers (RFC 7301); [] when it offers none or
    cannot be read (then OpenSSL judges it). Reads the first record's fragment only:
    real hellos fit in one."""
    try:
        body = hello[5 + 4 : 5 + int.from_bytes(hello[3:5], "big")]
        pos = 2 + 32  # legacy_version, random
        pos += 1 + body[pos]  # legacy_session_id
        pos += 2 + int.from_bytes(body[pos : pos + 2], "big")  # cipher_suites
        pos += 1 + body[pos]  # legacy_compression_methods
        end = pos + 2 + int.from_bytes(body[pos : pos + 2], "big")
        pos += 2
        while pos + 4 <= min(end, len(body)):
            kind = int.from_bytes(body[pos : pos + 2], "big")
            size = int.from_bytes(body[pos + 2 : pos + 4], "big")
            if kind == 16:  # application_layer_protocol_negotiation
                names, at = [], pos + 6
                while at < pos + 4 + size:
                    names.append(body[at + 1 : at + 1 + body[at]])
                    at += 1 + body[at]
                return names
            pos += 4 + size
    except IndexError:
        pass
    return []


def lane_of(hello: bytes) -> str:
    offered = offered_alpn(hello)
    if AGENT_ALPN in offered:
        return AGENTS
    return ROUTERS if ROUTER_ALPN in offered else OTHERS


def source_key(address: str) -> str:
    """Whom per-source bounds count a peer as: its IPv4 address (an IPv4-mapped IPv6
    one included), or its IPv6 /64, which one host may hold whole."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def hello_bytes_needed(peeked: bytes) -> int:
    """How many bytes must be buffered before the ClientHello is whole (0: it is, or the
    bytes are no TLS handshake and OpenSSL may refuse them at once; -1: it would be over
    HELLO_MAX_BYTES, which no real client sends). The hello may span several records."""
    pos = 0
    head = b""  # the handshake message's 4-byte header (type, 24-bit length)
    body = 0  # handshake bytes in the whole records so far
    while True:
        if len(peeked) < pos + 5:
            return pos + 5
        record = int.from_bytes(peeked[pos + 3 : pos + 5], "big")
        if peeked[pos] != _TLS_HANDSHAKE_RECORD or record == 0:
            return 0  # not a handshake record (RFC 8446 5.1 forbids empty ones)
        end = pos + 5 + record
        if end > HELLO_MAX_BYTES:
            return -1
        if len(peeked) < end:
            return end
        head += peeked[pos + 5 : pos + 5 + min(record, 4 - len(head))]
        body += record
        pos = end
        if len(head) == 4 and body >= 4 + int.from_bytes(head[1:4], "big"):
            return 0


# -- the trio shell ------------------------------------------------------------


@attrs.define(eq=False)
class Ticket:
    """An admitted connection, before its handshake: the caller runs the handshake in
    `scope`, whose deadline the gate moves as the connection goes through its phases."""

    stream: trio.SocketStream
    source: str
    arrived: float  # in the kernel (trio's clock)
    scope: trio.CancelScope
    unsorted: bool = True  # its hello not yet whole (counted against max_pending)

    @property
    def deadline(self) -> float:
        return self.scope.deadline


def kernel_age_s(sock: socket.socket) -> float:
    """How long an accepted connection has existed (its wait in the accept queue): the
    time since it last sent data, which it never has yet. 0 where TCP_INFO is missing."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except (OSError, AttributeError):
        return 0.0
    if len(info) < _TCPI_LAST_DATA_SENT + 4:
        return 0.0
    (ms,) = struct.unpack_from("I", info, _TCPI_LAST_DATA_SENT)
    return float(ms) / 1000.0


def reset(stream: trio.SocketStream) -> None:
    """Close with a reset (SO_LINGER 0): nothing kept in TIME_WAIT, and the client
    learns at once, as a refused connection, that it must come back later."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    stream.socket.close()


def _raw(stream: trio.SocketStream) -> socket.socket:
    sock = sockio.raw_socket(stream)
    if sock is None:
        raise TypeError(f"a TCP socket stream expected, not {type(stream).__name__}")
    return sock


def _source(sock: socket.socket) -> str:
    try:
        return source_key(str(sock.getpeername()[0]))
    except (OSError, IndexError):
        return "?"


class Gate:
    """The control port's admission, for one HTTPServer: the decisions, the CPU slots
    and the lanes' places."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.core = TLSAdmission(limits or AdmissionLimits())
        self.slots = trio.Semaphore(self.core.limits.handshakes_at_once)  # FIFO
        # Hellos waiting for a place, per lane and source, oldest first: each woken once
        # the core grants its source a place (`dispatch`).
        self.queues: dict[str, dict[str, deque[_Waiter]]] = {name: {} for name in self.core.lanes}
        self.refusals_log = RateLimit(60.0)  # a storm refuses thousands: a line a minute
        self.rng = random.Random()
        # Refused connections told when to come back, reset once the line has had time
        # to arrive (at most _REFUSED_OPEN_MAX of them: past that, reset at once).
        self.refused_open: deque[tuple[float, trio.SocketStream]] = deque()
        self._pending_room = trio.lowlevel.ParkingLot()  # the accept loops, while it is full
        # Set on the port of a control plane among several: given the epoch an agent's
        # hello says it lost (None: it lost none) and its source (source_key), the line to
        # answer it with before any TLS (agent_lane: the leader's URL, or when to come
        # back), None to serve it here. It may take a while (an election under way): at
        # most ANSWER_WAIT_S.
        self.redirect: Callable[[int | None, str], Awaitable[bytes | None]] | None = None

    async def _leader_line(
        self, hello: bytes, scope: trio.CancelScope, source: str
    ) -> bytes | None:
        """The line answering an agent's hello before any TLS, None to serve it here. An
        agent of a version that says it lost a leader but not its epoch is served (it may
        be held for the election)."""
        assert self.redirect is not None
        offered = offered_alpn(hello)
        if LOST_LEADER_ALPN in offered:
            return None
        scope.deadline = max(scope.deadline, trio.current_time() + ANSWER_WAIT_S)
        return await self.redirect(lost_epoch(offered), source)

    async def reset_refused(self) -> None:
        """Reset the refused connections whose time has come, until cancelled (then all)."""
        try:
            while True:
                await trio.sleep(_REFUSED_OPEN_S / 2)
                now = trio.current_time()
                while self.refused_open and self.refused_open[0][0] <= now:
                    reset(self.refused_open.popleft()[1])
        finally:
            while self.refused_open:
                reset(self.refused_open.popleft()[1])

    def admit(self, stream: trio.SocketStream) -> Ticket | None:
        """At accept: a ticket, or None when the connection was refused (reset)."""
        raw = _raw(stream)
        age = kernel_age_s(raw)
        source = _source(raw)
        why = self.core.arrive(source, age)
        if why is not None:
            self._refused(stream, source, why)
            return None
        now = trio.current_time()
        deadline = self.core.deadline(now)
        return Ticket(stream, source, now - age, trio.CancelScope(deadline=deadline))

    def _refused(
        self, stream: trio.SocketStream, source: str, why: str, lane: str | None = None
    ) -> None:
        """Reset a refused connection; an agent's, or one whose lane is not known yet, is
        first told when to come back (agent_lane.come_back_line)."""
        if lane == OTHERS or len(self.refused_open) >= _REFUSED_OPEN_MAX:
            reset(stream)
        else:
            now = trio.current_time()
            self._say_and_reset(
                stream, come_back_line(self.core.come_back_s(now, why, self.rng.random()))
            )
        held = self.refusals_log.allow(why, trio.current_time())
        if held is not None:
            more = f" ({held} more since the last such line)" if held else ""
            log.warning("refused a TLS connection from %s: %s%s", source, why, more)

    def _say_and_reset(self, stream: trio.SocketStream, line: bytes) -> None:
        """Write `line` in place of the first TLS record, then reset the connection once
        it had time to arrive."""
        if len(self.refused_open) >= _REFUSED_OPEN_MAX:
            reset(stream)
            return
        raw = _raw(stream)
        try:
            raw.send(line)
            # Reset later, not now: a reset that reached the client before its connect()
            # had returned would fail the connect, the line unread.
            raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the client learns of the reset alone, and backs off as it would
        self.refused_open.append((trio.current_time() + _REFUSED_OPEN_S, stream))

    def leave(self, ticket: Ticket) -> None:
        self.core.leave(ticket.source, ticket.unsorted)
        if ticket.unsorted:
            self._pending_room.unpark_all()

    async def room_to_accept(self) -> None:
        """Wait until fewer than max_pending connections are between accept and their
        whole hello. A connection then waits in the kernel's accept queue (its age there
        counts, TCP_INFO) instead of being accepted only to be refused: by its turn its
        hello is there, and it is sorted at once (finding 12: a starved fleet's late
        hellos held every pending place, and agents and operators were refused)."""
        while self.core.total_pending >= self.core.limits.max_pending:
            await self._pending_room.park()

    def dispatch(self, lane: str) -> None:
        """Give every place the lane has room for to the hellos the core picks: the place
        is theirs from now (counted in flight) until they give it back."""
        queues = self.queues[lane]
        while (source := self.core.grant(lane)) is not None:
            waiting = queues[source]
            waiter = waiting.popleft()
            if not waiting:
                del queues[source]
            waiter.granted = True
            waiter.event.set()

    async def _place(self, lane: str, source: str) -> None:
        """Wait in the lane's queue until granted a place (cancelled: out of the queue,
        or the place given back if it was granted meanwhile)."""
        waiter = _Waiter()
        self.queues[lane].setdefault(source, deque()).append(waiter)
        self.dispatch(lane)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.core.shed(lane, source)
                self.dispatch(lane)
            else:
                waiting = self.queues[lane][source]
                waiting.remove(waiter)
                if not waiting:
                    del self.queues[lane][source]
                self.core.unqueue(lane, source)  # cut at its deadline while it waited
            raise

    async def handshake(
        self, ticket: Ticket, context: ssl.SSLContext
    ) -> trio.SSLStream[Watched] | None:
        """The whole ClientHello, a place in its lane, a CPU slot, the handshake: the
        TLS stream, or None when the peer left or was shed (closed already). Raises
        trio's stream errors as SSLStream does; the caller runs it in `ticket.scope`
        and calls `hold_place` with the stream it got."""
        stream = ticket.stream
        raw = _raw(stream)
        hello = await _whole_hello(raw)
        if hello is None:
            await trio.aclose_forcefully(stream)
            return None
        lane = lane_of(hello)
        self.core.sorted()
        ticket.unsorted = False
        self._pending_room.unpark_all()
        source = ticket.source
        if lane == AGENTS and self.redirect is not None:
            line = await self._leader_line(hello, ticket.scope, source)
            if line is not None:
                self._say_and_reset(stream, line)
                return None
        why = self.core.hello(lane, trio.current_time(), ticket.arrived, source)
        if why is not None:
            self._refused(stream, source, why, lane)
            return None
        deadline = self.core.queue_deadline(lane, ticket.arrived)
        ticket.scope.deadline = deadline
        await self._place(lane, source)
        now = trio.current_time()
        if not self.core.start(lane, source, now, deadline):
            self.dispatch(lane)  # the place it was granted goes to the next
            self._refused(stream, source, SHED_LATE, lane)
            return None
        # Its turn came: the handshake itself gets the usual deadline (an agent's even
        # past its queue deadline: it waits longer than that).
        handshake_by = now + self.core.limits.deadline_s
        if lane != AGENTS:
            handshake_by = min(deadline, handshake_by)
        ticket.scope.deadline = handshake_by
        place = _Place(self, lane, source, answers=2 if lane == AGENTS else 1)
        try:
            if peer_left(raw):  # a client that gave up while it waited costs no handshake
                await trio.aclose_forcefully(stream)
                place.give_back()
                return None
            slot = _Slot(self.slots)
            await slot.acquire()
            try:
                answer_by = _AnswerBy(self.core, lane, ticket.scope, handshake_by)
                watched = Watched(stream, slot, place, answer_by)
                tls = trio.SSLStream(watched, context, server_side=True)
                await tls.do_handshake()
            finally:
                slot.release()
            watched.handshaken = True
        except BaseException:
            place.give_back()
            raise
        return tls

    async def hold_place(self, tls: trio.SSLStream[Watched]) -> None:
        """Give the connection's place back after `in_flight_s` at the latest."""
        await trio.sleep(self.core.limits.in_flight_s)
        tls.transport_stream.place.give_back()


@attrs.define(eq=False)
class _Waiter:
    """A hello queued for a place: `granted` once the place is its own."""

    event: trio.Event = attrs.field(factory=trio.Event)
    granted: bool = False


class _Place:
    """A connection's place in its lane, given back once (answered, closed, timed out)."""

    def __init__(self, gate: Gate, lane: str, source: str, answers: int) -> None:
        self.gate, self.lane, self.source = gate, lane, source
        self.answers_left = answers  # sends after the handshake, each an answer or more
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.gate.core.done(self.lane, self.source, trio.current_time())
            self.gate.dispatch(self.lane)


@attrs.define(eq=False)
class _AnswerBy:
    """Moves a handshake's deadline once the server's flight is sent: from then on it
    waits on the peer alone (TLSAdmission.answer_deadline)."""

    core: TLSAdmission
    lane: str
    scope: trio.CancelScope
    handshake_by: float

    def flight_sent(self) -> None:
        now = trio.current_time()
        self.scope.deadline = self.core.answer_deadline(self.lane, now, self.handshake_by)


async def _whole_hello(sock: socket.socket) -> bytes | None:
    """Wait until the ClientHello is buffered whole (its bytes, still in the kernel's
    buffer), or the peer closed (None). SO_RCVLOWAT makes the socket readable only once
    the bytes still missing are there. Peeked first, before any wait: a client sends its
    hello with its connect, so it is mostly there at accept, and a busy server that
    waited for readiness first would lose a scheduling round on each connection."""
    try:
        while True:
            try:
                peeked: bytes | None = sock.recv(HELLO_MAX_BYTES, socket.MSG_PEEK)
            except BlockingIOError:
                peeked = None
            except OSError:
                return None
            if peeked is not None:
                if not peeked:
                    return None
                needed = hello_bytes_needed(peeked)
                if needed == -1:
                    return None
                if needed == 0:
                    return peeked
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, needed)
            await trio.lowlevel.wait_readable(sock)
    finally:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        except OSError:
            pass


class _Slot:
    """A handshake slot, given back early by `release` (the first flight was sent)."""

    def __init__(self, slots: trio.Semaphore) -> None:
        self.slots = slots
        self.held = False

    async def acquire(self) -> None:
        await self.slots.acquire()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()


class Watched(trio.abc.Stream):
    """The TCP stream under a server-side SSLStream. It gives the CPU slot back once the
    server's first flight is sent, since what follows waits on the peer, and from each
    flight sent gives the peer its answer's time (`answer_by`); then it gives the
    connection's place back once its answers are sent (each send after the handshake
    carries one; an agent's are the 101 and the welcome) or it closes."""

    def __init__(
        self, stream: trio.SocketStream, slot: _Slot, place: _Place, answer_by: _AnswerBy
    ) -> None:
        self.stream = stream
        self.socket = stream.socket  # lets the peer be named
        self._slot: _Slot | None = slot
        self.place = place
        self.answer_by = answer_by
        self.handshaken = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._slot is not None:
            self._slot.release()
            self._slot = None
        await self.stream.send_all(data)
        if not self.handshaken:
            self.answer_by.flight_sent()
        elif self.place.held:
            self.place.answers_left -= 1
            if self.place.answers_left <= 0:
                self.place.give_back()

    def answered(self) -> None:
        """The connection's place goes back before its answers are all sent: what it waits
        for from now on is no work of this server's (h11_connection.ReplayStream)."""
        self.place.give_back()

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        self.place.give_back()
        await self.stream.aclose()
