"""The control plane's core: pure decisions, no I/O.

The trio shell feeds a `Reconciler` events with the current time and delivers
the commands of each `Step` it gets back:

- lifecycle: node reachable -> unreachable -> lost, with the mass-loss and start-up guards
- placement: GPUs for replicas, and `explain` for those that cannot have any
- reconciler: desired replicas (catalog) against actual shards (agents' reports); its
  parts: known (events update what is known), store (shard records and their indexes),
  decide (the reconcile pass over the models an event touched), replicas (per-replica
  decisions), placing (missing replicas), drains (an operator's drain)
"""

from llmgw_server.control.commands import Command, DrainShard, MarkNode, StartShard, StopShard
from llmgw_server.control.lifecycle import NodeStatus, NodeTransition
from llmgw_server.control.placement import Explanation, explain, place
from llmgw_server.control.reconciler import Reconciler, Step
from llmgw_server.control.views import ControlView, NodeView, ReplicaView, ShardView, Unplaced

__all__ = [
    "Command",
    "ControlView",
    "DrainShard",
    "Explanation",
    "MarkNode",
    "NodeStatus",
    "NodeTransition",
    "NodeView",
    "Reconciler",
    "ReplicaView",
    "ShardView",
    "StartShard",
    "Step",
    "StopShard",
    "Unplaced",
    "explain",
    "place",
]
