"""The admin API's documents: the status (nodes, replicas, models) and an explanation.

The control port builds them (`control_shell.admin`), and the CLI, the demo and the
tests read them back through these classes; the fleet page reads the same JSON
(tests/test_admin_documents.py pins the fields it uses). They go through the one
JSON converter of the project (`llmgw_core.wire.converter`), which ignores fields
it does not know, so a CLI reads the status of a newer control plane.

Engine keys never appear here: these are shown to operators and written to logs.

Not frozen: a 10,000-node status makes some 120,000 of them, and a frozen attrs class
takes two and a half times as long to make. Nothing changes one once made.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn

from llmgw_core.inventory import ShardState
from llmgw_core.wire import converter
from llmgw_server.control.lifecycle import NodeStatus
from llmgw_server.control.shards import Phase


@attrs.define
class GpuDoc:
    index: int
    name: str
    memory_total_mib: int
    memory_free_mib: int
    used: bool  # a shard the control plane placed holds it


@attrs.define
class EngineDoc:
    name: str
    found: bool
    version: str


@attrs.define
class NodeDoc:
    name: str
    status: NodeStatus
    cordoned: bool
    draining: bool
    # Newer than the status: a control plane before it sent none (read as False).
    drain_forced: bool = attrs.field(default=False, kw_only=True)
    last_seen_s_ago: float
    address: str  # where engines on it are reached
    labels: dict[str, str]
    fabric: dict[str, str]
    cpus: int
    memory_mib: int
    gpus: tuple[GpuDoc, ...]
    engines: tuple[EngineDoc, ...]


@attrs.define
class ShardDoc:
    node: str
    rank: int
    state: ShardState
    gpus: tuple[int, ...]
    detail: str
    retiring: bool
    output_tail: tuple[str, ...]  # the engine's last lines when it failed


@attrs.define
class ReplicaDoc:
    replica_id: str
    model: str
    phase: Phase
    serving: bool  # the router sends it requests
    kept: bool  # counted toward the model's replicas
    # On a draining node, serving until a replacement serves. Newer than the status: a
    # control plane before it sent none (read as False).
    moving: bool = attrs.field(default=False, kw_only=True)
    reason: str  # why it is failed or broken
    url: str
    attempt: int
    failures: int  # consecutive failures so far
    crash_loop: bool
    restart_in_s: float | None
    shards: tuple[ShardDoc, ...]


@attrs.define
class UnplacedDoc:
    count: int  # replicas wanted but not placed
    explanation: str  # why, against the fleet as it is now
    waiting: str | None  # set when placement is deferred rather than impossible


@attrs.define
class AutoscaleDoc:
    """[models.autoscale]: its bounds and target, what the last cycle said (`now`), and
    the last change of `desired` with its reason; `held`: the requests its routers hold
    now, waiting for a replica to serve (as they last reported, every 2 s or at once)."""

    min: int
    max: int
    target: str
    now: str | None
    last_change: str | None
    held: int = 0


@attrs.define
class ModelDoc:
    name: str
    desired: int
    kept: int  # replicas counted toward `desired`
    unplaced: UnplacedDoc | None
    autoscale: AutoscaleDoc | None = None


@attrs.define
class PageDoc:
    """Which part of the fleet a status with `?limit=`, `?after=` or `?node=` holds."""

    nodes: int  # on this page
    of: int  # in the fleet
    next_after: str | None  # `after` for the next page; None on the last


@attrs.define
class ControlPlaneDoc:
    id: str
    url: str  # as its peers dial it (wss://HOST:PORT)
    started_at: float  # wall-clock seconds


@attrs.define
class ControlDoc:
    """Control planes that share a store ([control.store]): who leads and since when
    (wall-clock seconds), the leadership's epoch, every control plane that is up (None:
    the store did not say in time), and the store's health as the answering one sees it."""

    this: str  # the control plane that answered
    leader: ControlPlaneDoc | None
    epoch: int
    since: float | None
    why: str
    store_ok: bool
    store_latency_ms: float | None
    leadership_changes: int  # this control plane's, since it started
    control_planes: tuple[ControlPlaneDoc, ...] | None


@attrs.define
class TenantLimitDoc:
    """One limit of a tenant as the routers enforce it together ([[tenants]]): the
    limit, what they may be using of it now (in the last 60 s, or in flight), and each
    router's share. Only limits some router reports: a router enforces them."""

    tenant: str
    kind: str  # requests (per minute), tokens (per minute), in_flight
    model: str | None  # a [[tenants.models]] limit's model, None: the tenant's own
    limit: float
    used: float
    shares: dict[str, float]  # router (its name on the route feed) -> its share


@attrs.define
class StatusDoc:
    """GET /v1/admin/status: the fleet, or a page of it (`page` only then)."""

    nodes: tuple[NodeDoc, ...]
    replicas: tuple[ReplicaDoc, ...]
    models: tuple[ModelDoc, ...]
    guard: str | None  # why the mass-loss guard holds
    page: PageDoc | None = None
    control: ControlDoc | None = None  # where control planes share a store
    # Newer than the status: a control plane before tenants sent none.
    tenants: tuple[TenantLimitDoc, ...] = ()


@attrs.define
class RecentDoc:
    """A change the fleet page lists among the recent ones (GET /v1/admin/stream's
    `recent`): a node's transition or a shard's new state."""

    at: float  # wall-clock seconds
    subject: str  # "node NAME" or "replica ID rank N on NODE"
    change: str  # the new status or state, or "old -> new"
    reason: str


@attrs.define
class ExplainDoc:
    """GET /v1/admin/explain/MODEL: why one more replica could or could not be placed."""

    model: str
    placeable: bool
    text: str
    fitting: tuple[str, ...]
    passed_over: dict[str, str]  # node -> why it was passed over, in words


_LISTED = (GpuDoc, EngineDoc, NodeDoc, ShardDoc, ReplicaDoc, ModelDoc)


def _is_listed(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple and typing.get_args(tp)[:1] in [(d,) for d in _LISTED]


class KeptDocs(tuple[Any, ...]):
    """Documents that stay the same from one status to the next (a node's GPUs and
    engines, kept by the control port until its inventory or placement changes): their
    JSON data is made once, on the first status that holds them, and read again after.
    The data is shared: whoever reads it must not change it (nothing here does)."""

    data: list[Any] | None = None


def _as_list(tp: Any) -> Callable[[tuple[Any, ...]], list[Any]]:
    # cattrs's own makes a tuple through a generator: a third of a 10,000-node status's
    # encoding. JSON has lists only, so a list comprehension gives the same text.
    hook = converter.get_unstructure_hook(typing.get_args(tp)[0])

    def as_list(docs: tuple[Any, ...]) -> list[Any]:
        kept: list[Any] | None = getattr(docs, "data", None)
        if kept is not None:
            return kept
        data = [hook(d) for d in docs]
        if isinstance(docs, KeptDocs):
            docs.data = data
        return data

    return as_list


# Registered before any document is unstructured, so that no hook made earlier is kept.
converter.register_unstructure_hook_factory(_is_listed, _as_list)
# A whole status has no `page` key at all (as before pages existed), not a null one.
converter.register_unstructure_hook(
    StatusDoc, make_dict_unstructure_fn(StatusDoc, converter, _cattrs_omit_if_default=True)
)


class DocumentError(ValueError):
    """A document that does not have the shape of its class; the text says where."""


D = TypeVar("D")


def to_json(doc: object) -> dict[str, Any]:
    """A document as JSON-ready data."""
    data: dict[str, Any] = converter.unstructure(doc)
    return data


def from_json(data: object, kind: type[D]) -> D:
    """A document of `kind` from parsed JSON; raises DocumentError."""
    try:
        return converter.structure(data, kind)
    except cattrs.BaseValidationError as exc:
        raise DocumentError("; ".join(cattrs.transform_error(exc, path=kind.__name__))) from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise DocumentError(f"{kind.__name__}: {type(exc).__name__}: {exc}") from None
