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

Cost: a heartbeat is O(1) (it only moves `last_seen` on); `advance` visits only
the nodes whose deadline has come, through a heap of deadlines that are never
later than the node's real one (a heartbeat makes the real one later, and the
entry is moved on when it comes up), and the guard's counts are kept as nodes
change status, so that time passing costs nothing per node that stays quiet.
"""

from __future__ import annotations

import enum
import heapq

import attrs

from llmgw_core.control_config import ControlSection
from llmgw_core.durations import seconds
from llmgw_core.inventory import Inventory
from llmgw_server.control.heartbeat_pace import unreachable_after
from llmgw_server.control.work import Work


class NodeStatus(enum.StrEnum):
    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"  # silent: gets no new work, but its replicas probably still serve
    LOST = "lost"  # silent for long: its replicas are placed elsewhere


@attrs.define
class Node:
    inventory: Inventory
    status: NodeStatus
    last_seen: float
    # Added to `unreachable_after_s` and `lost_after_s` for this node: a large fleet's
    # node is given a longer heartbeat interval, and may be silent for three of them
    # (heartbeat_pace).
    paced_s: float
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
    drain_since: float | None = None  # when the operator's drain began (while draining)

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
    def __init__(
        self, settings: ControlSection, started_at: float, work: Work | None = None
    ) -> None:
        self.settings = settings
        self.started_at = started_at
        self.work = work if work is not None else Work()
        # Read freely; statuses change only here. Flags (cordoned, draining) are the
        # reconciler's to set.
        self.nodes: dict[str, Node] = {}
        # Why the mass-loss guard holds, or None while it does not.
        self.guard: str | None = None
        # ("host", address) and ("domain", fabric domain) -> the nodes there
        self._where: dict[tuple[str, str], set[str]] = {}
        self._lost = 0
        self._unreachable: dict[str, None] = {}  # in the order they turned unreachable
        # Unreachable nodes that turned so within the guard's window: name -> since,
        # with a heap to let them age out.
        self._recent: dict[str, float] = {}
        self._recent_heap: list[tuple[float, str]] = []
        # Deadlines: (when, seq, name); the entry whose seq is `_entry[name]` counts and
        # is never later than the node's real deadline.
        self._heap: list[tuple[float, int, str]] = []
        self._entry: dict[str, int] = {}
        self._seq = 0
        self._order: dict[str, int] = {}  # the order nodes registered in (as `nodes` has it)

    # -- events ------------------------------------------------------------------

    def register(
        self, inventory: Inventory, now: float, heartbeat_interval_s: float | None = None
    ) -> list[NodeTransition]:
        """O(1). `heartbeat_interval_s`: the one its agent was given (heartbeat_pace),
        when it is known."""
        name = inventory.name
        node = self.nodes.get(name)
        configured = self.settings.unreachable_after_s
        paced = 0.0
        if heartbeat_interval_s is not None:
            paced = unreachable_after(heartbeat_interval_s, configured) - configured
        if node is None:
            node = self.nodes[name] = Node(inventory, NodeStatus.REACHABLE, now, paced)
            self._seq += 1
            self._order[name] = self._seq
            self._place(node, add=True)
            self._schedule(node)
            return [NodeTransition(name, None, NodeStatus.REACHABLE, now, "registered")]
        self._place(node, add=False)
        node.inventory = inventory
        shorter, node.paced_s = paced < node.paced_s, paced
        self._place(node, add=True)
        transitions = self._revive(node, now, "registered again")
        if shorter:  # its deadline came nearer: an entry must not be later than it
            self._schedule(node)
        return transitions

    def pace(self, name: str, heartbeat_interval_s: float) -> None:
        """Its agent was told a new interval (heartbeat_pace): its timeouts follow, from
        its last word. O(log nodes)."""
        node = self.nodes.get(name)
        if node is None:
            return
        configured = self.settings.unreachable_after_s
        node.paced_s = unreachable_after(heartbeat_interval_s, configured) - configured
        self._schedule(node)

    def heartbeat(self, name: str, now: float) -> list[NodeTransition]:
        """O(1): a node that stays reachable only has its `last_seen` moved on."""
        node = self.nodes.get(name)
        return self._revive(node, now, "heartbeat") if node is not None else []

    def disconnected(self, name: str, now: float) -> list[NodeTransition]:
        """Its stream closed: no command can reach it, so it is unreachable now."""
        node = self.nodes.get(name)
        if node is None or node.status is not NodeStatus.REACHABLE:
            return []
        self._turn_unreachable(node, now)
        self._schedule(node)
        return [NodeTransition(name, NodeStatus.REACHABLE, node.status, now, "stream closed")]

    def forget(self, name: str) -> None:
        """Drop a node, lost or not (the caller checks)."""
        node = self.nodes.pop(name)
        self._place(node, add=False)
        self._lost -= node.status is NodeStatus.LOST
        self._unreachable.pop(name, None)
        self._recent.pop(name, None)
        self._entry.pop(name, None)
        del self._order[name]

    def on_hosts(self, hosts: set[str]) -> set[str]:
        """The nodes at these addresses (several simulated nodes may share one)."""
        return set().union(*(self._where.get(("host", h), ()) for h in hosts))

    def domain_mates(self, names: set[str]) -> set[str]:
        """The nodes in the fabric domains of these nodes (`fabric_key`), these included."""
        domains = {
            d
            for n in names
            if n in self.nodes
            and (d := self.nodes[n].inventory.fabric.get(self.settings.fabric_key)) is not None
        }
        return set(names).union(*(self._where.get(("domain", d), ()) for d in domains))

    # -- time --------------------------------------------------------------------

    def advance(self, now: float) -> list[NodeTransition]:
        """Apply the passage of time: silent nodes turn unreachable, then lost.

        O(nodes whose deadline came, log nodes); a guard's release visits the nodes
        unreachable then."""
        out: list[NodeTransition] = []
        due = self._pop_due(now)
        for node in due:
            silence = self.settings.unreachable_after_s + node.paced_s
            if node.status is NodeStatus.REACHABLE and now - node.last_seen >= silence:
                self._turn_unreachable(node, node.last_seen + silence)
                reason = f"no heartbeat for {silence:g} s"
                out.append(
                    NodeTransition(node.name, NodeStatus.REACHABLE, node.status, now, reason)
                )
        held = self.guard is not None
        self._update_guard(now)
        if self.guard is None:
            if held:
                for name in self._unreachable:
                    self.work.nodes += 1
                    node = self.nodes[name]
                    node.guard_released_at = now
                    self._schedule(node)
            lost = 0
            for node in due:
                if node.status is NodeStatus.UNREACHABLE and now >= self._lost_at(node):
                    del self._unreachable[node.name]
                    self._recent.pop(node.name, None)
                    node.status = NodeStatus.LOST
                    self._lost += 1
                    lost += 1
                    out.append(
                        NodeTransition(
                            node.name, NodeStatus.UNREACHABLE, node.status, now, self._why(node)
                        )
                    )
            if lost:
                # Fewer live nodes raise the unreachable share: judge it again now, not a tick late.
                self._update_guard(now)
        for node in due:
            self._schedule(node)
        return out

    def next_deadline(self) -> float | None:
        """When `advance` would next change something, if no event comes first.

        O(1) amortized: entries a heartbeat made early are moved on here."""
        heap = self._heap
        while heap:
            when, seq, name = heap[0]
            if self._entry.get(name) != seq:
                heapq.heappop(heap)
                continue
            real = self._deadline(self.nodes[name])
            if real == when:
                return when
            self.work.nodes += 1
            heapq.heappop(heap)
            del self._entry[name]
            if real is not None:
                self._push(name, real)
        return None

    # -- inside ------------------------------------------------------------------

    def _deadline(self, node: Node) -> float | None:
        if node.status is NodeStatus.REACHABLE:
            return node.last_seen + self.settings.unreachable_after_s + node.paced_s
        if node.status is NodeStatus.UNREACHABLE and self.guard is None:
            return self._lost_at(node)
        return None  # lost, or held by the guard (its release schedules it again)

    def _schedule(self, node: Node) -> None:
        when = self._deadline(node)
        if when is None:
            self._entry.pop(node.name, None)
        else:
            self._push(node.name, when)

    def _push(self, name: str, when: float) -> None:
        self._seq += 1
        self._entry[name] = self._seq
        heapq.heappush(self._heap, (when, self._seq, name))

    def _pop_due(self, now: float) -> list[Node]:
        """The nodes whose entry has come, in the order they registered (as a pass over
        every node would take them); their entries are gone until `_schedule`."""
        heap, due = self._heap, []
        while heap and heap[0][0] <= now:
            _, seq, name = heapq.heappop(heap)
            if self._entry.get(name) == seq:
                del self._entry[name]
                self.work.nodes += 1
                due.append(name)
        due.sort(key=self._order.__getitem__)
        return [self.nodes[name] for name in due]

    def _turn_unreachable(self, node: Node, since: float) -> None:
        node.status = NodeStatus.UNREACHABLE
        node.unreachable_since = since
        self._unreachable[node.name] = None
        self._recent[node.name] = since
        heapq.heappush(self._recent_heap, (since, node.name))

    def _place(self, node: Node, *, add: bool) -> None:
        """File the node under its address and fabric domain, or take it out."""
        inventory = node.inventory
        places = [("host", inventory.host)]
        domain = inventory.fabric.get(self.settings.fabric_key)
        if domain is not None:
            places.append(("domain", domain))
        for place in places:
            if add:
                self._where.setdefault(place, set()).add(node.name)
            else:
                names = self._where[place]
                names.discard(node.name)
                if not names:
                    del self._where[place]

    def _lost_at(self, node: Node) -> float:
        """When an unreachable node is declared lost, if the guard does not hold then:
        `lost_after` after the latest of its last word, the start, and the guard's release."""
        since = max(node.last_seen, self.started_at)
        if node.guard_released_at is not None:
            since = max(since, node.guard_released_at)
        return since + self.settings.lost_after_s + node.paced_s

    def _why(self, node: Node) -> str:
        after = self.settings.lost_after_s + node.paced_s
        released = node.guard_released_at
        if released is not None and released > max(node.last_seen, self.started_at):
            silent = self._lost_at(node) - node.last_seen
            return (
                f"no heartbeat for {seconds(silent)}, {after:g} s since the mass-loss guard "
                "released"
            )
        return f"no heartbeat for {after:g} s"

    def _revive(self, node: Node, now: float, reason: str) -> list[NodeTransition]:
        node.last_seen = max(node.last_seen, now)
        if node.status is NodeStatus.REACHABLE:
            return []
        old, node.status, node.unreachable_since = node.status, NodeStatus.REACHABLE, None
        if old is NodeStatus.LOST:
            self._lost -= 1
        else:
            del self._unreachable[node.name]
            self._recent.pop(node.name, None)
        node.guard_released_at = None
        self._schedule(node)
        return [NodeTransition(node.name, old, node.status, now, reason)]

    def _update_guard(self, now: float) -> None:
        """O(1) amortized: the counts are kept as nodes change status."""
        s = self.settings
        since = now - s.mass_loss_window_s
        while self._recent_heap and self._recent_heap[0][0] < since:
            at, name = heapq.heappop(self._recent_heap)
            if self._recent.get(name) == at:
                del self._recent[name]
        live = len(self.nodes) - self._lost
        unreachable = len(self._unreachable)
        limit = s.mass_loss_share * live
        if self.guard is None:
            recent = len(self._recent)
            if recent > limit:
                self.guard = (
                    f"{recent} of {live} nodes turned unreachable within "
                    f"{s.mass_loss_window_s:g} s (more than {s.mass_loss_share:.0%}): "
                    "the control plane may be the one cut off, so no node is declared "
                    "lost until fewer are unreachable"
                )
        elif unreachable <= limit:
            self.guard = None
