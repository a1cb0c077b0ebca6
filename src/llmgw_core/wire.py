"""The agent stream's messages and their one converter.

Each message is a frozen attrs class; a frame is one JSON text with a "type"
tag. Decoding never raises anything but `WireError`, whose text says what was
wrong, so a bad frame closes its own stream with a clear reason and nothing
else.
"""

from __future__ import annotations

import json

import attrs
from cattrs.preconf.json import make_converter
from cattrs.strategies import configure_tagged_union

from llmgw_core.inventory import Inventory, LaunchSpec, ShardReport
from llmgw_core.tagged_json import TaggedFrames

PROTOCOL = 3
# The first version whose agents take a `Pace`: an older one keeps its welcome's interval.
PACE_PROTOCOL = 2
MAX_FRAME_BYTES = 1024 * 1024
# The websocket close code (private range, after HTTP's 409 Conflict) of a registration
# refused because another agent's stream for the node's name is live: two machines share
# the name (a cloned image, a copied certificate). The reason says which node.
NAME_HELD_CLOSE = 4409
# The close code (after HTTP's 503) of every agent stream when the control plane stops
# cleanly (SIGTERM, as a restart does): the agent dials again after a small jitter rather
# than its backoff, for as long as a restart takes (llmgw_agent.agent, RESTART_*).
STOPPING_CLOSE = 4503
# The close code (after HTTP's 307 Temporary Redirect) of a stream (an agent's or a
# router's route feed) opened to a control plane that does not lead: a standby of a
# control plane kept in a store (`[control.store]`). Its reason is `not_leader_reason`:
# where the leader is, or why none leads now; the peer dials that leader (or, with none,
# the next control plane it knows after a short jitter).
NOT_LEADER_CLOSE = 4307
# The close code (after HTTP's 412 Precondition Failed) an agent closes a stream with
# whose welcome carries an epoch below the highest it has seen: a control plane that led
# once and no longer does (paused past its lease, then woken). The reason is
# `stale_epoch_reason`; the agent moves on to its next control plane.
STALE_EPOCH_CLOSE = 4412
_LEADER_AT = "leader at "


# A peer that lost its leader (its stream broke, or a dial of it failed) names it in this
# header of its next dials: a standby that would name that same leader (its key lives until
# its lease ends) holds the stream until the election says otherwise, rather than send the
# peer back to a dead control plane.
LOST_LEADER_HEADER = b"x-llmgw-lost-leader"


def not_leader_reason(leader_url: str | None, why: str = "no leader is elected now") -> str:
    """The close reason of NOT_LEADER_CLOSE: `leader at URL`, or why none leads."""
    return f"{_LEADER_AT}{leader_url}" if leader_url else why


def leader_from_reason(reason: str | None) -> str | None:
    """The leader's URL a NOT_LEADER_CLOSE names, None when it names none."""
    if reason and reason.startswith(_LEADER_AT):
        url = reason[len(_LEADER_AT) :].strip()
        if url.startswith(("ws://", "wss://")) and " " not in url:
            return url
    return None


def stale_epoch_reason(epoch: int, highest: int) -> str:
    """Why an agent refuses a welcome or a command of `epoch` (STALE_EPOCH_CLOSE, an Ack)."""
    return f"stale epoch {epoch}: this agent follows epoch {highest}"


def accepts(agent_protocol: int) -> str | None:
    """Why the control plane refuses an agent of this protocol version, None when it
    takes it.

    Version policy: the control plane speaks PROTOCOL and PROTOCOL - 1, so that a
    fleet upgrades in rolling fashion, control plane first, then agents one by one;
    it answers each agent in the agent's own version (the Welcome carries it). An
    agent two or more versions behind, or newer than the control plane, is refused.
    Version 2 added `Pace`, never sent to an agent of version 1. Version 3 added the
    leader's epoch to the welcome and to every command (0 from a control plane without a
    store); it is sent to an agent of version 2 as well, which ignores a key it does not
    know (the converter forbids no extra key), and which follows one control plane only.
    """
    if agent_protocol == PROTOCOL or agent_protocol == PROTOCOL - 1:
        return None
    speaks = f"this control plane speaks {PROTOCOL - 1} and {PROTOCOL}"
    if agent_protocol > PROTOCOL:
        return (
            f"protocol version {agent_protocol} is not supported ({speaks}): "
            "upgrade the control plane before its agents"
        )
    return f"protocol version {agent_protocol} is not supported ({speaks}): upgrade the agent"


class WireError(Exception):
    """A frame that cannot be used: not JSON, unknown type, wrong fields, too large."""


# Up: agent -> control plane


@attrs.frozen
class Register:
    """The first frame of every stream: the whole node, and every shard it runs now."""

    protocol: int
    agent_version: str
    inventory: Inventory
    shards: tuple[ShardReport, ...] = ()
    cordoned: bool = False
    draining: bool = False


@attrs.frozen
class Heartbeat:
    seq: int


@attrs.frozen
class ShardUpdate:
    """One shard's transition, with the engine's last output lines when it failed."""

    report: ShardReport
    output_tail: tuple[str, ...] = ()


@attrs.frozen
class Ack:
    command_id: int
    ok: bool = True
    error: str = ""


# Down: control plane -> agent


# Every message down carries the epoch of the leadership that sent it: the election's
# revision in the store, 0 from a control plane without one (never fenced). An agent
# refuses a welcome or a command from an epoch below the highest it has seen.


def _an_epoch(_: object, __: attrs.Attribute[int], epoch: int) -> None:
    if epoch < 0:
        raise ValueError(f"an epoch is 0 or more, not {epoch}")


@attrs.frozen
class Welcome:
    protocol: int
    heartbeat_interval_s: float
    epoch: int = attrs.field(default=0, validator=_an_epoch)


@attrs.frozen
class Pace:
    """The heartbeat interval from now on (a fleet that grew or shrank: heartbeat_pace)."""

    heartbeat_interval_s: float
    epoch: int = attrs.field(default=0, validator=_an_epoch)


@attrs.frozen
class Start:
    command_id: int
    spec: LaunchSpec
    epoch: int = attrs.field(default=0, validator=_an_epoch)


@attrs.frozen
class Drain:
    command_id: int
    replica_id: str
    rank: int
    epoch: int = attrs.field(default=0, validator=_an_epoch)


@attrs.frozen
class Stop:
    command_id: int
    replica_id: str
    rank: int
    epoch: int = attrs.field(default=0, validator=_an_epoch)


@attrs.frozen
class Mark:
    """The operator's cordon and drain flags, kept by the agent and reported at registration."""

    command_id: int
    cordoned: bool
    draining: bool
    epoch: int = attrs.field(default=0, validator=_an_epoch)


UpMessage = Register | Heartbeat | ShardUpdate | Ack
DownMessage = Welcome | Pace | Start | Drain | Stop | Mark

_TAGS: dict[type, str] = {
    Register: "register",
    Heartbeat: "heartbeat",
    ShardUpdate: "shard_update",
    Ack: "ack",
    Welcome: "welcome",
    Pace: "pace",
    Start: "start",
    Drain: "drain",
    Stop: "stop",
    Mark: "mark",
}

converter = make_converter(forbid_extra_keys=False)
for _union in (UpMessage, DownMessage):
    configure_tagged_union(_union, converter, tag_generator=_TAGS.__getitem__, tag_name="type")
_frames = TaggedFrames(converter, WireError, "the protocol", MAX_FRAME_BYTES)


def encode(message: UpMessage | DownMessage) -> str:
    union = UpMessage if isinstance(message, UpMessage) else DownMessage
    return json.dumps(converter.unstructure(message, union), separators=(",", ":"))


def decode_up(frame: str | bytes) -> UpMessage:
    message: UpMessage = _frames.decode(frame, UpMessage, _UP_TAGS)
    return message


def decode_down(frame: str | bytes) -> DownMessage:
    message: DownMessage = _frames.decode(frame, DownMessage, _DOWN_TAGS)
    return message


_UP_TAGS = frozenset(_TAGS[t] for t in (Register, Heartbeat, ShardUpdate, Ack))
_DOWN_TAGS = frozenset(_TAGS[t] for t in (Welcome, Pace, Start, Drain, Stop, Mark))
