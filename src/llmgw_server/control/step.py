"""What one step of the reconciler hands its shell: every command to deliver and every
fact the shell acts on, so that the shell never reads back into the core after a step.

The shell keeps the facts that change seldom (`Routes`) from the last step that carried
them; the others hold for their own step alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from llmgw_core.catalog import Endpoint
from llmgw_server.control.commands import Command
from llmgw_server.control.lifecycle import NodeTransition
from llmgw_server.control.persisted import Touched
from llmgw_server.control.placement import Assignment


@attrs.frozen
class Routes:
    """What the route table is made of, as the core knows it after a step."""

    # Where each profiled model's requests go: its serving replicas' heads, engine keys on.
    serving: Mapping[str, tuple[Endpoint, ...]] = attrs.field(factory=dict)
    adapters: Mapping[str, str] = attrs.field(factory=dict)  # LoRA adapter -> its model
    # Each autoscaled model -> the replicas it is scaled to now (for routers: which models
    # to report the load of; for the page's history: the count desired).
    autoscaled: Mapping[str, int] = attrs.field(factory=dict)
    # A replica a store named still waits for its nodes: what serves is not known whole.
    awaiting: bool = False


@attrs.frozen
class DrainHead:
    """The head of a replica whose drain a step sends: what routers are told to drain."""

    replica_id: str
    model: str
    endpoint: Endpoint  # carrying the engine key


@attrs.frozen
class Step:
    commands: tuple[Command, ...] = ()
    placements: tuple[Assignment, ...] = ()  # new replicas; `key` is the replica id
    transitions: tuple[NodeTransition, ...] = ()
    notes: tuple[str, ...] = ()  # for the log: guard changes, failures, adoption
    # Call `tick` by then at the latest, even if no event comes.
    wake_at: float | None = None
    # A reconcile ran: which replicas serve may have changed even without a command.
    reconciled: bool = False
    # The model of each shard newly reported failed, the catalog's models alone: an agent
    # names what it reports, and each name counted would be a metric's label kept for good.
    failed: tuple[str, ...] = ()
    # What may have changed of what a leader keeps in its store (control.persisted).
    touched: Touched = attrs.field(factory=Touched)
    # Why the mass-loss guard holds as this step left it, None while it does not: while it
    # holds, a node turning unreachable keeps its stream (agents.silent_streams).
    guard: str | None = None
    # The route table's makings, when they differ from the last step that carried them
    # (the first step carries them always).
    routes: Routes | None = None
    # The head of each replica whose rank 0 this step drains (a replica the store holds
    # no record of has none): routers keep it in the table, draining, until it is idle.
    drain_heads: tuple[DrainHead, ...] = ()
    # On a reconciled step: the replicas known no more since the last one (or never known:
    # a shard reported that no record names), whose output tails go.
    forgotten: frozenset[str] = frozenset()
