"""Node lifecycle: reachable -> unreachable -> lost, and back on a heartbeat.

Times are logical: a node turns unreachable at `last_seen + unreachable_after`
however late the clock is advanced, so the outcome does not depend on how often
the shell ticks.

Two guards keep a control plane that is itself cut off from tearing the fleet
down: a mass-loss guard (too many nodes went silent at once) and a start-up
guard (after a restart, nobody is lost before `lost_after` has passed). A node
registers after the start, so the start-up guard bites hardest on what a
restarted control plane has not heard from at all: the ranks of a multi-node
replica whose nodes have not registered yet, which `shards.classify` awaits
until `lost_after` after the start.

The mass-loss guard's release gives a fresh grace: a node still unreachable
when the guard releases is declared lost no earlier than `lost_after` after the
release. Nodes cut off together come back one by one, over their reconnection
backoff; the first ones back release the guard, and the last must not be
declared lost in that instant for having been silent while the guard held.
"""

from __future__ import annotations

import enum

import attrs

from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import Inventory


class NodeStatus(enum.StrEnum):
    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"  # silent: gets no new work, but its replicas probably still serve
    LOST = "lost"  # silent for long: its replicas are placed elsewhere


@attrs.define
class Node:
    inventory: Inventory
    status: NodeStatus
    last_seen: float
    unreachable_since: float | None = None
    # The mass-loss guard released while it was unreachable: lost no earlier than
    # lost_after after this.
    guard_released_at: float | None = None
    cordoned: bool = False  # no new placements
    draining: bool = False  # everything moves off
    # The operator forced the drain: a replica that fits nowhere else stops without a
    # replacement. Kept by this control plane only (agents keep `draining`, not this):
    # after a restart a drain goes on unforced, the side that takes no model offline.
    drain_forced: bool = False

    @property
    def name(self) -> str:
        return self.inventory.name


@attrs.frozen
class NodeTransition:
    node: str
    old: NodeStatus | None  # None for a node registering for the first time
    new: NodeStatus
    at: float
    reason: str


class Lifecycle:
    def __init__(self, settings: ControlSection, started_at: float) -> None:
        self.settings = settings
        self.started_at = started_at
        self.nodes: dict[str, Node] = {}
        # Why the mass-loss guard holds, or None while it does not.
        self.guard: str | None = None

    def register(self, inventory: Inventory, now: float) -> list[NodeTransition]:
        node = self.nodes.get(inventory.name)
        if node is None:
            self.nodes[inventory.name] = Node(inventory, NodeStatus.REACHABLE, now)
            return [NodeTransition(inventory.name, None, NodeStatus.REACHABLE, now, "registered")]
        node.inventory = inventory
        return self._revive(node, now, "registered again")

    def heartbeat(self, name: str, now: float) -> list[NodeTransition]:
        node = self.nodes.get(name)
        return self._revive(node, now, "heartbeat") if node is not None else []

    def disconnected(self, name: str, now: float) -> list[NodeTransition]:
        """Its stream closed: no command can reach it, so it is unreachable now."""
        node = self.nodes.get(name)
        if node is None or node.status is not NodeStatus.REACHABLE:
            return []
        node.status = NodeStatus.UNREACHABLE
        node.unreachable_since = now
        return [NodeTransition(name, NodeStatus.REACHABLE, node.status, now, "stream closed")]

    def advance(self, now: float) -> list[NodeTransition]:
        """Apply the passage of time: silent nodes turn unreachable, then lost."""
        s = self.settings
        out: list[NodeTransition] = []
        for node in self.nodes.values():
            if (
                node.status is NodeStatus.REACHABLE
                and now - node.last_seen >= s.unreachable_after_s
            ):
                node.status = NodeStatus.UNREACHABLE
                node.unreachable_since = node.last_seen + s.unreachable_after_s
                reason = f"no heartbeat for {s.unreachable_after_s:g} s"
                out.append(
                    NodeTransition(node.name, NodeStatus.REACHABLE, node.status, now, reason)
                )
        held = self.guard is not None
        self._update_guard(now)
        if self.guard is None:
            if held:
                for node in self.nodes.values():
                    if node.status is NodeStatus.UNREACHABLE:
                        node.guard_released_at = now
            lost = 0
            for node in self.nodes.values():
                if node.status is NodeStatus.UNREACHABLE and now >= self._lost_at(node):
                    node.status = NodeStatus.LOST
                    lost += 1
                    out.append(
                        NodeTransition(
                            node.name, NodeStatus.UNREACHABLE, node.status, now, self._why(node)
                        )
                    )
            if lost:
                # Fewer live nodes raise the unreachable share: judge it again now, not a tick late.
                self._update_guard(now)
        return out

    def next_deadline(self) -> float | None:
        """When `advance` would next change something, if no event comes first."""
        s = self.settings
        times: list[float] = []
        for node in self.nodes.values():
            if node.status is NodeStatus.REACHABLE:
                times.append(node.last_seen + s.unreachable_after_s)
            elif node.status is NodeStatus.UNREACHABLE and self.guard is None:
                times.append(self._lost_at(node))
        return min(times, default=None)

    def _lost_at(self, node: Node) -> float:
        """When an unreachable node is declared lost, if the guard does not hold then:
        `lost_after` after the latest of its last word, the start, and the guard's release."""
        since = max(node.last_seen, self.started_at)
        if node.guard_released_at is not None:
            since = max(since, node.guard_released_at)
        return since + self.settings.lost_after_s

    def _why(self, node: Node) -> str:
        after = self.settings.lost_after_s
        released = node.guard_released_at
        if released is not None and released > max(node.last_seen, self.started_at):
            silent = self._lost_at(node) - node.last_seen
            return f"no heartbeat for {silent:g} s, {after:g} s since the mass-loss guard released"
        return f"no heartbeat for {after:g} s"

    def _revive(self, node: Node, now: float, reason: str) -> list[NodeTransition]:
        node.last_seen = max(node.last_seen, now)
        if node.status is NodeStatus.REACHABLE:
            return []
        old, node.status, node.unreachable_since = node.status, NodeStatus.REACHABLE, None
        node.guard_released_at = None
        return [NodeTransition(node.name, old, node.status, now, reason)]

    def _update_guard(self, now: float) -> None:
        s = self.settings
        live = [n for n in self.nodes.values() if n.status is not NodeStatus.LOST]
        unreachable = [n for n in live if n.status is NodeStatus.UNREACHABLE]
        limit = s.mass_loss_share * len(live)
        if self.guard is None:
            since = now - s.mass_loss_window_s
            recent = sum(1 for n in unreachable if (n.unreachable_since or now) >= since)
            if recent > limit:
                self.guard = (
                    f"{recent} of {len(live)} nodes turned unreachable within "
                    f"{s.mass_loss_window_s:g} s (more than {s.mass_loss_share:.0%}): "
                    "the control plane may be the one cut off, so no node is declared "
                    "lost until fewer are unreachable"
                )
        elif len(unreachable) <= limit:
            self.guard = None
