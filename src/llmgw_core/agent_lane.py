"""What agents and routers apart agree on with the control port about their lanes: the
ALPN name each offers, how long an agent waits for its dial, and how long the port may
queue it. Both ends read it here, so the port's admission needs nothing of the dialers."""

# Offered by agents in their ClientHello: the control port admits them on a lane of their
# own (llmgw_http.tls_admission).
AGENT_ALPN = b"llmgw-agent"
# Offered by routers apart dialing the route feed: a lane of their own too, so that
# anonymous peers crowding the operators' lane do not keep a router from its table. A
# lane orders admission only: the feed still takes the router token, as without it.
ROUTER_ALPN = b"llmgw-router"

# How long an agent waits for its dial to be answered: the TCP connect, the TLS handshake
# and the websocket handshake together. A control plane that a whole fleet dials at once
# (its first start, a restart) serves agents' connections in the order they came, within
# a deadline it can meet (llmgw_http.tls_admission): an agent that waits its turn is
# registered with one handshake, where one that gave up sooner dialled again, each time
# at the back of the queue (issue 17: 4 to 9 attempts a node at 10,000 nodes).
AGENT_DIAL_PATIENCE_S = 45.0
# Of that, how long the control port may keep an agent's connection queued for its TLS
# handshake, counted from its arrival in the server's kernel; the rest leaves room for
# the TCP connect's retries, the handshakes and the answer to the websocket handshake.
AGENT_QUEUE_S = 30.0

# A control port too busy to serve an agent soon refuses it before any TLS (no SSL
# object, no handshake's CPU) and says when to come back: it writes this line, in
# place of its first TLS record, then resets the connection. The dialer reads it from
# the first bytes it got and waits that long (llmgw_agent.agent.reconnect_delay): the
# port spaces the agents it refuses at the rate it registers them, so a storm comes
# back once, in turn, instead of redialling at random into a full queue.
COME_BACK_PREFIX = b"LLMGW-BUSY come-back-s="
# The longest wait a control port may ask for, and an agent accepts (a longer one, or
# nonsense, from a broken or hostile port cannot park a fleet).
MAX_COME_BACK_S = 300.0


def come_back_line(seconds: float) -> bytes:
    return COME_BACK_PREFIX + b"%.2f\r\n" % min(max(seconds, 0.0), MAX_COME_BACK_S)


def come_back_s(first: bytes) -> float | None:
    """The wait a control port's refusal asked for, from the first bytes it sent; None
    when they are no such refusal."""
    if not first.startswith(COME_BACK_PREFIX):
        return None
    digits = first[len(COME_BACK_PREFIX) :].partition(b"\r\n")[0]
    try:
        seconds = float(digits.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not 0.0 <= seconds <= MAX_COME_BACK_S:  # NaN fails both
        return MAX_COME_BACK_S if seconds > MAX_COME_BACK_S else None
    return seconds


# A standby that knows who leads answers an agent's ClientHello with this line naming the
# leader's agent URL, in place of its first TLS record, then resets the connection: no
# handshake on either side (a fleet booting down its list of control planes, or moving
# to a new leader, paid a TLS handshake at a standby first: 10,000 of them queued there
# for up to half a minute). The agent dials that leader at once, if it is one of its own
# control planes (llmgw_agent.following), as for a standby's NOT_LEADER close. An agent
# that has just lost a leader offers, besides AGENT_ALPN, LOST_LEADER_ALPN with the newest
# epoch it has seen (lost_leader_alpn): a control plane then names a leader only of a newer
# epoch (itself, when it leads: the agent dials it again with a named leader's patience);
# while none is known it takes the first few thousand through their handshake and holds
# their streams through the election, and has the rest wait, before any TLS, for a leader
# to name (or to come back). A lost leader's fleet so pays one handshake per agent at
# most, but for those first ones, at the new leader, whose admission paces it as it paces
# a restart storm: at 10,000 agents the handshakes standbys did for streams they held
# and then closed naming another winner, and the handshakes given up after a short
# failover patience, kept the fleet away 3 minutes. The bare name (an agent older than
# the epoch in it) always gets a handshake, and a standby may hold its stream.
NOT_LEADER_PREFIX = b"LLMGW-NOT-LEADER leader="
LOST_LEADER_ALPN = b"llmgw-agent-lost-leader"
MAX_LEADER_URL_BYTES = 200


def lost_leader_alpn(epoch: int) -> bytes:
    """The ALPN name of an agent that lost its leader and has seen `epoch` at most."""
    return LOST_LEADER_ALPN + b"/%d" % max(epoch, 0)


def lost_epoch(offered: list[bytes]) -> int | None:
    """The newest epoch an agent that lost its leader has seen, from the ALPN names its
    hello offers; None when it offers no such name with an epoch (or a malformed one)."""
    prefix = LOST_LEADER_ALPN + b"/"
    for name in offered:
        if name.startswith(prefix):
            digits = name[len(prefix) :]
            if digits.isdigit() and len(digits) <= 19:
                return int(digits)
    return None


def not_leader_line(url: str) -> bytes | None:
    """The line naming the leader at `url`; None when it cannot be said in one (too
    long, or not plain ASCII without spaces)."""
    try:
        data = url.encode("ascii")
    except UnicodeEncodeError:
        return None
    if len(data) > MAX_LEADER_URL_BYTES or not _plain(data):
        return None
    return NOT_LEADER_PREFIX + data + b"\r\n"


def not_leader_url(first: bytes) -> str | None:
    """The leader a standby's line named, from the first bytes it sent; None when they
    are no such line (or a malformed one)."""
    if not first.startswith(NOT_LEADER_PREFIX):
        return None
    data, crlf, _ = first[len(NOT_LEADER_PREFIX) :].partition(b"\r\n")
    if not crlf or not data or len(data) > MAX_LEADER_URL_BYTES or not _plain(data):
        return None
    return data.decode("ascii")


def _plain(data: bytes) -> bool:
    return all(0x21 <= b <= 0x7E for b in data)
