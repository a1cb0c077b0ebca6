"""The admin API on the control port: what the fleet runs, and why something cannot run.

Who may call it is `[admin]` in the config (`AdminSection`): reads (GET status and
explain) and actions (POST cordon/drain...) need `Authorization: Bearer <admin token>`
unless the config opens them.

`GET /metrics` is the control plane's metrics (`control_metrics`), a read like status:
it needs the admin token unless `open_status`, and also takes `[server] metrics_token`
where one is set, so that a scraper needs no token that may act on the fleet.

`POST /v1/admin/reload` reads the config file again (its API keys and static models;
400 with the error when it does not validate, and the running config stays).

`POST /v1/admin/nodes/NODE/drain` takes an optional JSON body `{"force": true}`: without
it, a drain that would leave a replica nowhere to go is refused with 409 and why.

Before any of it, the control port's gate (`cross_site`) refuses a Host not its own and
actions from other sites' pages or without `Content-Type: application/json`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, assert_never, get_args
from urllib.parse import parse_qs

import attrs

from llmgw_core.bearer import bearer_matches
from llmgw_core.config import AdminSection
from llmgw_core.inventory import Inventory
from llmgw_core.openai_errors import error_body
from llmgw_core.tomlshape import ConfigError
from llmgw_http.server import Request, Responder
from llmgw_server.control.documents import (
    AutoscaleDoc,
    ControlDoc,
    EngineDoc,
    ExplainDoc,
    GpuDoc,
    KeptDocs,
    ModelDoc,
    NodeDoc,
    PageDoc,
    ReplicaDoc,
    ShardDoc,
    StatusDoc,
    TenantLimitDoc,
    UnplacedDoc,
    to_json,
)
from llmgw_server.control.explanation import Explanation
from llmgw_server.control.reconciler import DrainRefused
from llmgw_server.control.scaling import ScaleView
from llmgw_server.control.views import ControlView, NodeView, ReplicaView
from llmgw_server.control_shell import ui_server
from llmgw_server.route_feed.hub import ShareRow

if TYPE_CHECKING:
    from llmgw_server.control_shell.controlplane import ControlPlane
    from llmgw_server.reload import ReloadPlan

# POST /v1/admin/nodes/NODE/ACTION
AdminAction = Literal["cordon", "uncordon", "drain", "undrain"]
_ACTIONS: Final[dict[str, AdminAction]] = {a: a for a in get_args(AdminAction)}


log = logging.getLogger("llmgw.admin")

# The engines' last lines by (node, replica id, rank): the control plane's `OutputTails`.
OutputTailsOf = Mapping[tuple[str, str, int], tuple[str, ...]]

_SET_TOKEN = "set [admin] token_digest or token_env"


class SeatView(Protocol):
    """A control plane among several sharing a store (seat.Seat), as status shows it."""

    async def control_doc(self) -> ControlDoc: ...

    def metrics_page(self) -> bytes: ...


class AdminAPI:
    def __init__(
        self,
        plane: ControlPlane,
        access: AdminSection | None = None,
        reload: Callable[[], Awaitable[ReloadPlan]] | None = None,
        seat: SeatView | None = None,
    ) -> None:
        self.plane = plane
        self.seat = seat  # where control planes share a store: who leads, the store's health
        self.access = plane.config.admin if access is None else access
        self.reload = reload  # POST /v1/admin/reload: the config file again (router.reload)
        self.node_parts = NodeParts()
        self._warn_at_start()

    def _warn_at_start(self) -> None:
        access = self.access
        where = self.plane.config.server.control_listen
        if not access.declared:
            if access.open_writes:
                log.warning(
                    "no [admin] section: the admin API on %s (loopback) is open to every "
                    "local user without a token; %s",
                    where,
                    _SET_TOKEN,
                )
            else:
                log.warning(
                    "no [admin] section and control_listen %s is not a loopback address: "
                    "the admin API refuses every request; %s",
                    where,
                    _SET_TOKEN,
                )
        elif access.token_digest is None:
            log.warning(
                "[admin] has no token: admin actions are refused%s; %s",
                "" if access.open_status else ", and so is status",
                _SET_TOKEN,
            )

    def _refusal(self, request: Request, write: bool) -> tuple[int, str, str] | None:
        """Why this request may not go on (status, message, code), or None."""
        access = self.access
        if access.open_writes or (not write and access.open_status):
            return None
        if access.token_digest is None:
            return (
                403,
                f"the admin API takes no {'actions' if write else 'requests'} without a "
                f"configured admin token: {_SET_TOKEN}",
                "admin_closed",
            )
        # Digests compared in constant time; the raw token is never compared.
        if bearer_matches(request.header(b"authorization"), access.token_digest):
            return None
        return 401, "a valid admin token is required (Authorization: Bearer)", "invalid_admin_token"

    async def handle(self, request: Request, responder: Responder) -> None:
        if request.path == b"/metrics":
            await self._metrics(request, responder)
            return
        if ui_server.is_page(request.path):
            await ui_server.page(request, responder)
            return
        parts = request.path.decode("utf-8", errors="replace").strip("/").split("/")
        if parts[:2] != ["v1", "admin"]:
            await responder.error(404, "the admin API is under /v1/admin")
            return
        refusal = self._refusal(request, write=request.method not in (b"GET", b"HEAD"))
        if refusal is not None:
            status_code, message, code = refusal
            await responder.whole(status_code, error_body(status_code, message, code))
            return
        rest = parts[2:]
        if request.method == b"POST" and rest == ["reload"] and self.reload is not None:
            try:
                plan = await self.reload()
            except ConfigError as exc:
                await responder.error(400, f"reload refused, the running config stays: {exc}")
                return
            await self._json(responder, 200, {"reloaded": True, **plan.as_json()})
        elif request.method == b"GET" and rest == ["status"]:
            query = parse_qs(request.target.partition(b"?")[2].decode("utf-8", "replace"))
            reconciler = self.plane.reconciler
            try:
                chosen, page = status_page(reconciler.node_names(), query)
            except ValueError as exc:
                await responder.error(400, str(exc))
                return
            view = reconciler.view(chosen)
            doc = status_doc(
                view,
                self.plane.output_tails,
                self.plane.now(),
                self.node_parts,
                len(view.nodes) if page is None else page.of,
                held=self.plane.held(),
            )
            control = None if self.seat is None else await self.seat.control_doc()
            tenants = tenant_docs(self.plane.routes.share_rows())
            data = to_json(attrs.evolve(doc, page=page, control=control, tenants=tenants))
            # Compact: with 10,000 nodes, indenting (Python's encoder, not C's) takes 4.5x longer.
            await responder.whole(200, json.dumps(data, separators=(",", ":")).encode())
        elif request.method == b"GET" and rest == ["stream"]:
            plane, kept = self.plane, self.node_parts
            await ui_server.stream(
                plane.feed,
                lambda: to_json(
                    attrs.evolve(
                        status_doc(
                            plane.reconciler.view(),
                            plane.output_tails,
                            plane.now(),
                            kept,
                            held=plane.held(),
                        ),
                        tenants=tenant_docs(plane.routes.share_rows()),
                    )
                ),
                responder,
                lambda seq: (plane.history.seq, to_json(plane.history.since(seq))),
                plane.routes.traffic,
            )
        elif request.method == b"GET" and len(rest) == 2 and rest[0] == "explain":
            explanation = self.plane.reconciler.explain(rest[1])
            if explanation is None:
                await responder.error(404, f"no model {rest[1]!r} with a profile")
                return
            await self._json(responder, 200, to_json(explain_doc(explanation)))
        elif (
            request.method == b"POST"
            and len(rest) == 3
            and rest[0] == "nodes"
            and rest[2] in _ACTIONS
        ):
            node, action = rest[1], _ACTIONS[rest[2]]
            try:
                force = _force(request.body, action)
            except ValueError as exc:
                await responder.error(400, str(exc))
                return
            try:
                match action:
                    case "cordon" | "uncordon":
                        self.plane.cordon(node, action == "cordon")
                    case "drain" | "undrain":
                        self.plane.drain_node(node, action == "drain", force=force)
                    case _:
                        assert_never(action)
            except KeyError:
                await responder.error(404, f"no node {node!r}")
                return
            except DrainRefused as refused:
                await self._json(responder, 409, _refusal_body(refused))
                return
            await self._json(responder, 200, {"node": node, "action": action, "force": force})
        else:
            await responder.error(404, "no such admin route")

    async def _metrics(self, request: Request, responder: Responder) -> None:
        if request.method not in (b"GET", b"HEAD"):
            await responder.error(405, "/metrics takes GET")
            return
        refusal = self._refusal(request, write=False)
        if refusal is not None and not self._metrics_token(request):
            status_code, message, code = refusal
            if status_code == 401:
                message = "a valid admin or metrics token is required (Authorization: Bearer)"
            await responder.whole(status_code, error_body(status_code, message, code))
            return
        plane = self.plane
        page = plane.metrics.render(plane.reconciler.view(), len(plane.agents.streams))
        if self.seat is not None:
            page += self.seat.metrics_page()
        await responder.whole(200, page, [(b"content-type", b"text/plain; version=0.0.4")])

    def _metrics_token(self, request: Request) -> bool:
        # getattr: [server] metrics_token is newer than this API; None where it is not set.
        digest: str | None = getattr(self.plane.config.server, "metrics_token_digest", None)
        return bearer_matches(request.header(b"authorization"), digest)

    @staticmethod
    async def _json(responder: Responder, status_code: int, data: Any) -> None:
        await responder.whole(status_code, json.dumps(data, indent=1).encode())


def _force(body: bytes, action: AdminAction) -> bool:
    """The `force` of an action's optional JSON body; raises ValueError saying what is wrong."""
    if not body.strip():
        return False
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError('the request body must be a JSON object, such as {"force": true}')
    unknown = sorted(set(data) - ({"force"} if action == "drain" else set()))
    if unknown:
        raise ValueError(f"{action} takes no field {unknown[0]!r}")
    force = data.get("force", False)
    if not isinstance(force, bool):
        raise ValueError("'force' must be true or false")
    return force


def _refusal_body(refused: DrainRefused) -> dict[str, Any]:
    error = json.loads(error_body(409, str(refused), "drain_refused"))
    error["error"]["stuck"] = [
        {"replica_id": s.replica_id, "model": s.model, "explanation": s.explanation.text}
        for s in refused.stuck
    ]
    return dict(error)


@attrs.define
class _Parts:
    inventory: Inventory
    used_gpus: tuple[int, ...]
    gpus: KeptDocs
    engines: KeptDocs


@attrs.define
class NodeParts:
    """Each node's GPU and engine documents, made again only when its inventory (a new
    registration) or the GPUs placed on it change: a 10,000-node status holds 80,000
    GPU documents, and making them and their JSON data again for every status doubled
    its time. At most twice the fleet (and 100) nodes are kept: past that, all are
    forgotten and made again."""

    _by_node: dict[str, _Parts] = attrs.field(factory=dict)

    def of(self, view: NodeView, fleet_nodes: int) -> _Parts:
        parts = self._by_node.get(view.name)
        if (
            parts is not None
            and parts.inventory is view.inventory
            and parts.used_gpus == view.used_gpus
        ):
            return parts
        if len(self._by_node) >= 2 * fleet_nodes + 100:
            self._by_node.clear()
        parts = _node_parts(view)
        self._by_node[view.name] = parts
        return parts


def _node_parts(view: NodeView) -> _Parts:
    # Positional and with list comprehensions: a 10,000-node status makes 100,000 of
    # these documents, and keywords and generators cost twice the time there.
    inventory = view.inventory
    used = view.used_gpus
    gpus = KeptDocs(
        [
            GpuDoc(g.index, g.name, g.memory_total_mib, g.memory_free_mib, g.index in used)
            for g in inventory.gpus
        ]
    )
    engines = KeptDocs([EngineDoc(e.name, e.found, e.version) for e in inventory.engines])
    return _Parts(inventory, used, gpus, engines)


def node_doc(view: NodeView, now: float, parts: _Parts | None = None) -> NodeDoc:
    if parts is None:
        parts = _node_parts(view)
    inventory = view.inventory
    return NodeDoc(
        view.name,
        view.status,
        view.cordoned,
        view.draining,
        round(now - view.last_seen, 1),
        inventory.host,
        inventory.labels,
        inventory.fabric,
        inventory.cpus,
        inventory.memory_mib,
        parts.gpus,
        parts.engines,
        drain_forced=view.drain_forced,
    )


def replica_doc(view: ReplicaView, output_tails: OutputTailsOf, now: float) -> ReplicaDoc:
    rid = view.replica_id
    return ReplicaDoc(
        replica_id=rid,
        model=view.model,
        phase=view.phase,
        serving=view.serving,
        kept=view.kept,
        moving=view.moving,
        reason=view.reason,
        url=view.url,
        attempt=view.attempt,
        failures=view.failures,
        crash_loop=view.crash_loop,
        restart_in_s=None if view.restart_at is None else round(max(0.0, view.restart_at - now), 1),
        shards=tuple(
            ShardDoc(
                s.node,
                s.rank,
                s.state,
                s.gpus,
                s.detail,
                s.retiring,
                output_tails.get((s.node, rid, s.rank), ()),
            )
            for s in view.shards
        ),
    )


def status_page(
    names: Iterable[str], query: dict[str, list[str]]
) -> tuple[list[str] | None, PageDoc | None]:
    """Which of the fleet's nodes (`names`) a query asks for, and where the next page
    starts; None for the whole fleet (no query, and no page).

    `?node=NAME` (repeatable): those nodes; `?limit=N&after=NAME`: the first N nodes
    in name order after NAME. The status of either holds the replicas that have a shard
    on its nodes, and every model. Raises ValueError."""
    wanted, limit, after = query.get("node"), query.get("limit"), query.get("after", [""])[0]
    if wanted is None and limit is None and not after:
        return None, None
    fleet = sorted(names)
    if wanted is not None:
        named = set(wanted)
        chosen = [n for n in fleet if n in named]
    else:
        chosen = fleet
    chosen = [n for n in chosen if n > after]
    more = None
    if limit is not None:
        try:
            count = int(limit[0])
        except ValueError:
            raise ValueError(f"limit must be a whole number, not {limit[0]!r}") from None
        if not 1 <= count <= 100_000:
            raise ValueError(f"limit must be between 1 and 100000, not {count}")
        if len(chosen) > count:
            chosen = chosen[:count]
            more = chosen[-1]
    return chosen, PageDoc(nodes=len(chosen), of=len(fleet), next_after=more)


def status_doc(
    view: ControlView,
    output_tails: OutputTailsOf,
    now: float,
    kept: NodeParts | None = None,
    fleet_nodes: int = 0,
    *,
    held: Mapping[str, int] | None = None,
) -> StatusDoc:
    """The status of `view` (`fleet_nodes` in the whole fleet: `view` may be a page),
    with the node parts `kept` from earlier statuses where given, and the requests the
    routers hold for each autoscaled model (`held`, held_counts)."""
    held = held or {}
    unplaced = view.unplaced
    fleet_nodes = max(fleet_nodes, len(view.nodes))
    return StatusDoc(
        nodes=tuple(
            [
                node_doc(n, now) if kept is None else node_doc(n, now, kept.of(n, fleet_nodes))
                for n in view.nodes
            ]
        ),
        replicas=tuple([replica_doc(r, output_tails, now) for r in view.replicas]),
        models=tuple(
            ModelDoc(
                m.name,
                m.desired,
                m.kept,
                None
                if m.name not in unplaced
                else UnplacedDoc(
                    unplaced[m.name].count,
                    unplaced[m.name].explanation.text,
                    unplaced[m.name].waiting,
                ),
                None if m.autoscale is None else _autoscale_doc(m.autoscale, held.get(m.name, 0)),
            )
            for m in view.models
        ),
        guard=view.guard,
    )


def _autoscale_doc(scale: ScaleView, held: int) -> AutoscaleDoc:
    return AutoscaleDoc(scale.min, scale.max, scale.target, scale.now, scale.last_change, held)


def explain_doc(explanation: Explanation) -> ExplainDoc:
    return ExplainDoc(
        model=explanation.model,
        placeable=explanation.placeable,
        text=explanation.text,
        fitting=explanation.fitting,
        passed_over=explanation.passed_over_text(),
    )


def tenant_docs(rows: list[ShareRow]) -> tuple[TenantLimitDoc, ...]:
    """The routers' shared limits as the status says them."""
    docs = []
    for row in rows:
        tenant, kind, *model = row.limit.split("/", 2)
        docs.append(
            TenantLimitDoc(
                tenant,
                kind,
                model[0] if model else None,
                row.total,
                round(row.committed, 3),
                {name: round(share, 3) for name, share in sorted(row.shares.items())},
            )
        )
    return tuple(docs)
