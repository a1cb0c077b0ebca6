"""What a node offers to placement: its status, flags and the GPUs no shard holds."""

from __future__ import annotations

import attrs

from llmgw_core.inventory import Gpu, Inventory
from llmgw_server.control.lifecycle import NodeStatus


@attrs.frozen
class NodeCapacity:
    inventory: Inventory
    status: NodeStatus = NodeStatus.REACHABLE
    cordoned: bool = False
    draining: bool = False
    used_gpus: frozenset[int] = frozenset()  # indices held by any shard, whatever its state

    @property
    def name(self) -> str:
        return self.inventory.name


class NodeFree:
    """A node's free GPUs by GPU name, lowest index first; changes as replicas are placed.

    Hashed by identity: placement files these in buckets.
    """

    __slots__ = ("capacity", "free")

    def __init__(self, capacity: NodeCapacity) -> None:
        self.capacity = capacity
        self.free: dict[str, list[Gpu]] = {}
        for gpu in sorted(capacity.inventory.gpus, key=lambda g: g.index):
            if gpu.index not in capacity.used_gpus:
                self.free.setdefault(gpu.name, []).append(gpu)
