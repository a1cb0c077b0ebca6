"""What the reconciler asks of agents. The shell delivers each to its node's stream."""

from __future__ import annotations

import attrs

from llmgw_core.inventory import LaunchSpec


@attrs.frozen
class StartShard:
    node: str
    spec: LaunchSpec  # a shard with the same replica id and rank is replaced


@attrs.frozen
class DrainShard:
    """Take no new requests; the shard keeps running until StopShard."""

    node: str
    replica_id: str
    rank: int


@attrs.frozen
class StopShard:
    node: str
    replica_id: str
    rank: int


@attrs.frozen
class MarkNode:
    """The operator's cordon and drain flags, for the agent to keep and report when it
    registers: a restarted control plane learns them back from the node."""

    node: str
    cordoned: bool
    draining: bool


Command = StartShard | DrainShard | StopShard | MarkNode
