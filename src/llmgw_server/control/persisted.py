"""What the leader keeps in the store (issue 35), and what a new leader reads back.

Pure: values in and out as bytes, keys as names relative to the store's prefix (the
shell adds it); no I/O, no clock. Only what cannot come back from the agents is kept:

- `replicas/<id>`: each replica's placement (its model, every rank's node and GPUs, its
  ports, its attempt, whether it retires), so that a new leader waits for exactly the
  nodes that run something instead of a blanket settle time, and places nothing twice.
  Not the engine key: every agent keeps its shards' specs, key included, and reports
  them back when it registers; the router is only ever given a replica whose shards an
  agent reported ready, and adoption is the agent's business. The store (its backups,
  its snapshots) then holds no secret.
- `nodes/<name>`: an operator's cordon and drain, when the drain began, and whether it is
  forced (an agent keeps no `forced`); only for a node with a flag set.
- `models/<name>`: what each started autoscaler decided: its count, when it last changed
  (the down window counts from there), since when it is idle when no router saw a
  request, the readings that still hold replicas in the down window, the last change.
- `format`: this layout's version; written with every snapshot, so that an empty store
  (no leader ever wrote one) tells a first leader to take the agents' word.

Nodes' inventories and shard states come back from the agents, as after a restart.

Times are kept as wall-clock seconds (time.time()): a new leader's monotonic clock has
another origin. `wall_minus_monotonic` is the offset between the two on the host that
converts (time.time() - the core's clock, read once when it leads): stored = monotonic +
offset; read back, monotonic = stored - offset, never later than `now` (a clock ahead on
the old leader's host must not push a window into the future).

Decoding is hostile input (another version's value, a corrupted key): a value that
cannot be used is skipped with a note, never raised, and kept as it is in the store (a
newer leader may read it); a leader overwrites it only with a value of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import cattrs
from cattrs.preconf.json import make_converter

from llmgw_core.autoscaling import MAX_REPLICAS
from llmgw_core.inventory import ShardState
from llmgw_server.control.autoscale import Autoscaler, Decision, Reason
from llmgw_server.control.lifecycle import Node
from llmgw_server.control.scaling import Change, Scaling
from llmgw_server.control.shards import ShardRecord

if TYPE_CHECKING:
    from llmgw_server.control.reconciler import Reconciler

__all__ = [
    "FORMAT",
    "FORMAT_KEY",
    "Keeper",
    "OperatorFlags",
    "Restored",
    "ResumedModel",
    "StoredModel",
    "StoredNode",
    "StoredReplica",
    "StoredShard",
    "Touched",
    "Writes",
    "diff",
    "read",
    "snapshot",
]

FORMAT = 1
FORMAT_KEY = "format"
REPLICAS = "replicas/"
NODES = "nodes/"
MODELS = "models/"
# A value larger than this is not one of ours: skipped unread.
MAX_VALUE_BYTES = 64 * 1024
# A down window kept as its staircase has at most one reading per count (0..max).
MAX_WINDOW = MAX_REPLICAS + 1
MAX_RANKS = 64
MAX_GPUS = 64
MAX_TEXT = 1024

Writes = tuple[dict[str, bytes], list[str]]  # puts, deletes


# -- what is stored ----------------------------------------------------------------------


@attrs.frozen
class StoredShard:
    node: str
    gpus: tuple[int, ...] = ()  # () for a rank whose record the leader did not have


@attrs.frozen
class StoredReplica:
    model: str
    ranks: tuple[StoredShard, ...]  # in rank order; ranks[0] is the head
    head_address: str
    port: int  # the head's HTTP port; the rendezvous port, and with kv_events two more
    dist_port: int
    kv_events: bool = False
    attempt: int = 0  # the launch: (replica id, rank, attempt) names what an agent runs
    retiring: bool = False  # a drain or stop was sent (or reported): counts toward nothing

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(r.node for r in self.ranks)


@attrs.frozen
class StoredNode:
    cordoned: bool = False
    draining: bool = False
    drain_forced: bool = False
    drain_since: float | None = None  # wall clock


@attrs.frozen
class StoredChange:
    before: int
    after: int
    reason: str
    detail: str


@attrs.frozen
class StoredModel:
    desired: int
    changed_at: float  # wall clock: the down window counts from the last change
    idle_since: float  # wall clock: idle since then when no router has seen a request
    # (wall clock, replicas needed) of the readings that can still hold replicas in the
    # down window (Autoscaler.window), each time rounded up to a step of the window.
    window: tuple[tuple[float, int], ...] = ()
    last_change: StoredChange | None = None


@attrs.frozen
class StoredFormat:
    version: int


converter = make_converter(forbid_extra_keys=False, omit_if_default=True)


def _strict(kind: type[Any], accepts: tuple[type[Any], ...]) -> None:
    """No coercion: "yes" is not a bool, 1.5 not a count, 3 not a name."""

    def structure(value: Any, _: type[Any]) -> Any:
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, accepts):
            raise TypeError(f"{value!r:.40} is not a {kind.__name__}")
        return kind(value)

    converter.register_structure_hook(kind, structure)


_strict(bool, (bool,))
_strict(int, (int,))
_strict(float, (int, float))
_strict(str, (str,))


def encode(value: StoredReplica | StoredNode | StoredModel | StoredFormat) -> bytes:
    data = converter.unstructure(value)
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


_FORMAT_BYTES = encode(StoredFormat(FORMAT))


def replica_key(replica_id: str) -> str:
    return REPLICAS + replica_id


def node_key(name: str) -> str:
    return NODES + name


def model_key(name: str) -> str:
    return MODELS + name


# -- what the core holds, as stored --------------------------------------------------------


def stored_replica(records: Iterable[ShardRecord]) -> StoredReplica:
    """A replica's placement from its records (at least one)."""
    by_rank = {r.spec.rank: r for r in records}
    head = by_rank[min(by_rank)].spec
    ranks = tuple(
        StoredShard(node, by_rank[rank].spec.gpu_indices if rank in by_rank else ())
        for rank, node in enumerate(head.nodes)
    )
    return StoredReplica(
        head.model_name,
        ranks,
        head.head_address,
        head.port,
        head.dist_port,
        head.kv_events,
        head.attempt,
        _retiring(list(by_rank.values())),
    )


def _retiring(records: list[ShardRecord]) -> bool:
    """Drained or stopped for good: a failed replica's other ranks are stopped for its
    restart, and it still counts toward its model."""
    if any(r.drain_at is not None or r.state is ShardState.DRAINING for r in records):
        return True
    return any(r.stop_sent for r in records) and not any(
        r.state is ShardState.FAILED for r in records
    )


def stored_node(node: Node | OperatorFlags, wall_minus_monotonic: float) -> StoredNode | None:
    """A node's operator flags; None when it has none (nothing is stored for it)."""
    if not (node.cordoned or node.draining):
        return None
    since = node.drain_since if node.draining else None
    return StoredNode(
        node.cordoned,
        node.draining,
        node.draining and node.drain_forced,
        None if since is None else since + wall_minus_monotonic,
    )


def _round_up(t: float, step: float) -> float:
    return math.ceil(t / step) * step


def window_step(scale_down_after_s: float) -> float:
    """The readings' times are stored rounded up to this: a steady load then rewrites its
    model once a step, not once a cycle, and a new leader holds replicas at most this
    much longer than the old one would have."""
    return max(1.0, scale_down_after_s / 16)


def stored_model(
    scaler: Autoscaler, idle_since: float, last: Change | None, wall_minus_monotonic: float
) -> StoredModel:
    w = wall_minus_monotonic
    step = window_step(scaler.spec.scale_down_after_s)
    window = tuple((_round_up(at + w, step), n) for at, n in scaler.window())
    change = None
    if last is not None:
        d = last.decision
        change = StoredChange(last.before, last.after, str(d.reason), d.detail)
    return StoredModel(scaler.desired, scaler.changed_at + w, idle_since + w, window, change)


def _model_of(scaling: Scaling, name: str, w: float) -> StoredModel | None:
    scaler = scaling.autoscalers.get(name)
    if scaler is None:
        return None
    return stored_model(scaler, scaling.started[name], scaling.changes.get(name), w)


def _model_value(scaling: Scaling, name: str, w: float) -> bytes | None:
    model = _model_of(scaling, name, w)
    return None if model is None else encode(model)


def _replica_value(reconciler: Reconciler, rid: str) -> bytes | None:
    records = reconciler.known.store.replica(rid)
    if records:
        return encode(stored_replica(records))
    awaited = reconciler.awaited_replica(rid)
    return None if awaited is None else encode(awaited)


def _node_value(reconciler: Reconciler, name: str, w: float) -> bytes | None:
    known = reconciler.known
    node: Node | OperatorFlags | None = known.lifecycle.nodes.get(name)
    if node is None and known.stored_flags is not None:
        node = known.stored_flags.get(name)  # restored, not registered yet: kept
    value = None if node is None else stored_node(node, w)
    return None if value is None else encode(value)


def snapshot(reconciler: Reconciler, wall_minus_monotonic: float) -> dict[str, bytes]:
    """Everything the leader keeps, as stored. O(replicas, nodes and autoscaled models):
    for the first write of a leadership; each step after writes only what it touched
    (`Keeper.step`)."""
    w = wall_minus_monotonic
    out = {FORMAT_KEY: _FORMAT_BYTES}
    known = reconciler.known
    for rid, records in known.store.replicas():
        out[replica_key(rid)] = encode(stored_replica(records))
    for rid in reconciler.awaited_replicas():
        value = _replica_value(reconciler, rid)
        if value is not None:
            out[replica_key(rid)] = value
    names: Iterable[str] = known.lifecycle.nodes
    if known.stored_flags is not None:
        names = [*names, *(n for n in known.stored_flags if n not in known.lifecycle.nodes)]
    for name in names:
        value = _node_value(reconciler, name, w)
        if value is not None:
            out[node_key(name)] = value
    scaling = reconciler.scaling
    for name in scaling.autoscalers:
        value = _model_value(scaling, name, w)
        if value is not None:
            out[model_key(name)] = value
    return out


def diff(before: Mapping[str, bytes], after: Mapping[str, bytes]) -> Writes:
    """What to write to turn `before` into `after`: the puts (new or changed values) and
    the deletes, in key order. O(keys)."""
    puts = {k: v for k, v in sorted(after.items()) if before.get(k) != v}
    deletes = sorted(k for k in before if k not in after)
    return puts, deletes


@attrs.frozen
class Touched:
    """What a step may have changed of what is stored (the Step carries it)."""

    replicas: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.replicas or self.nodes or self.models)


class Keeper:
    """The leader's copy of what it stored, kept current step by step.

    `everything` once when it starts to lead (after `Reconciler.restore`), then `step`
    after each Step: O(what the step touched). Writing a step's puts before delivering
    its commands keeps the store a superset of what was launched: a leader that dies
    between the two leaves a replica stored that its node does not run (awaited for
    nothing, until the node registers without it), never one running unstored."""

    def __init__(self, stored: Mapping[str, bytes]) -> None:
        # Values this version cannot read are left alone: never deleted by a diff.
        self.stored = {k: v for k, v in stored.items() if _readable(k, v)}
        # Each autoscaled model as last written: an autoscaling cycle touches every one,
        # and most are as they were (their readings' times are stored rounded up).
        self._models: dict[str, StoredModel] = {}

    def everything(self, reconciler: Reconciler, wall_minus_monotonic: float) -> Writes:
        self._models.clear()
        after = snapshot(reconciler, wall_minus_monotonic)
        writes = diff(self.stored, after)
        self.stored = after
        return writes

    def step(self, reconciler: Reconciler, touched: Touched, wall_minus_monotonic: float) -> Writes:
        w = wall_minus_monotonic
        values: dict[str, bytes | None] = {}
        for rid in touched.replicas:
            values[replica_key(rid)] = _replica_value(reconciler, rid)
        for name in touched.nodes:
            values[node_key(name)] = _node_value(reconciler, name, w)
        for name in touched.models:
            key, model = model_key(name), _model_of(reconciler.scaling, name, w)
            if model is None:
                self._models.pop(name, None)
                values[key] = None
            elif self._models.get(name) != model or key not in self.stored:
                self._models[name] = model
                values[key] = encode(model)
        puts, deletes = {}, []
        for key in sorted(values):
            value = values[key]
            if value is None:
                if self.stored.pop(key, None) is not None:
                    deletes.append(key)
            elif self.stored.get(key) != value:
                self.stored[key] = puts[key] = value
        return puts, deletes


# -- reading back ------------------------------------------------------------------------


@attrs.define
class OperatorFlags:
    """A node's flags as the core holds them (monotonic time), before it registers."""

    cordoned: bool = False
    draining: bool = False
    drain_forced: bool = False
    drain_since: float | None = None


@attrs.frozen
class ResumedModel:
    """An autoscaler's state on the new leader's monotonic clock."""

    desired: int
    changed_at: float
    idle_since: float
    window: tuple[tuple[float, int], ...]
    last_change: Change | None


@attrs.frozen
class Restored:
    # Whether any leader ever wrote here: only then is the store the operator's word (an
    # empty store, as on a first start with one, leaves the agents' flags in force).
    found: bool
    replicas: dict[str, StoredReplica]
    nodes: dict[str, OperatorFlags]
    # Nodes whose record could not be read: their agents' flags are taken.
    unreadable_nodes: frozenset[str]
    models: dict[str, ResumedModel]
    notes: tuple[str, ...]


class _Bad(ValueError):
    pass


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise _Bad(what)


def _name(text: str, what: str) -> None:
    _check(0 < len(text) <= MAX_TEXT, f"{what} must be 1 to {MAX_TEXT} characters")


def _time(t: float, what: str) -> None:
    _check(math.isfinite(t), f"{what} must be a finite time")


def _check_replica(r: StoredReplica) -> None:
    _name(r.model, "the model")
    _check(0 < len(r.ranks) <= MAX_RANKS, f"a replica has 1 to {MAX_RANKS} ranks")
    for shard in r.ranks:
        _name(shard.node, "a node")
        _check(len(shard.gpus) <= MAX_GPUS, f"a shard has at most {MAX_GPUS} GPUs")
        _check(all(0 <= g < 1024 for g in shard.gpus), "a GPU index is 0 to 1023")
    _check(0 < r.port < 65536 and 0 <= r.dist_port < 65536, "ports must be TCP ports")
    _check(0 <= r.attempt < 1 << 31, "the attempt must be a count")
    _check(len(r.head_address) <= MAX_TEXT, "the head address is too long")


def _check_node(n: StoredNode) -> None:
    if n.drain_since is not None:
        _time(n.drain_since, "drain_since")


def _check_model(m: StoredModel) -> None:
    _check(0 <= m.desired <= MAX_REPLICAS, f"desired must be 0 to {MAX_REPLICAS}")
    _time(m.changed_at, "changed_at")
    _time(m.idle_since, "idle_since")
    _check(len(m.window) <= MAX_WINDOW, f"a window holds at most {MAX_WINDOW} readings")
    for at, n in m.window:
        _time(at, "a reading's time")
        _check(0 <= n <= MAX_REPLICAS, "a reading needs 0 to the most replicas")
    c = m.last_change
    if c is not None:
        _check(0 <= c.before <= MAX_REPLICAS and 0 <= c.after <= MAX_REPLICAS, "a count")
        Reason(c.reason)  # ValueError for a reason this version does not know
        _check(len(c.detail) <= MAX_TEXT, "the change's detail is too long")


_KINDS: dict[str, tuple[type[Any], Any]] = {
    REPLICAS: (StoredReplica, _check_replica),
    NODES: (StoredNode, _check_node),
    MODELS: (StoredModel, _check_model),
}


def _decode(key: str, value: bytes) -> tuple[str, str, Any]:
    """(kind, name, value), or raises _Bad saying why it cannot be used."""
    if not isinstance(value, bytes | bytearray):
        raise _Bad("the value is not bytes")
    if len(value) > MAX_VALUE_BYTES:
        raise _Bad(f"a value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    if key == FORMAT_KEY:
        kind, name, cls, check = FORMAT_KEY, "", StoredFormat, None
    else:
        kind = next((k for k in _KINDS if key.startswith(k)), "")
        if not kind:
            raise _Bad("not a key of this layout")
        name = key[len(kind) :]
        _name(name, "the name in the key")
        cls, check = _KINDS[kind]
    try:
        data = json.loads(value)
        decoded = converter.structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise _Bad(_describe(exc)) from None
    if check is not None:
        try:
            check(decoded)
        except ValueError as exc:
            raise _Bad(str(exc)) from None
    return kind, name, decoded


def _readable(key: str, value: bytes) -> bool:
    try:
        _decode(key, value)
    except _Bad:
        return False
    return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, path="value"))
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def read(stored: Mapping[str, bytes], now: float, wall_minus_monotonic: float) -> Restored:
    """What the store says, on this leader's clock (`now`, monotonic). Never raises for a
    stored value: each one that cannot be used is left out with a note. O(keys)."""
    w = wall_minus_monotonic

    def back(t: float) -> float:
        return min(t - w, now)

    replicas: dict[str, StoredReplica] = {}
    nodes: dict[str, OperatorFlags] = {}
    unreadable: set[str] = set()
    models: dict[str, ResumedModel] = {}
    notes: list[str] = []
    found = False
    for key in sorted(stored):
        try:
            kind, name, value = _decode(key, stored[key])
        except _Bad as exc:
            notes.append(f"stored key {key[:200]!r} skipped: {exc}")
            if key.startswith(NODES) and len(key) > len(NODES):
                unreadable.add(key[len(NODES) :])
            found = found or key == FORMAT_KEY or any(key.startswith(k) for k in _KINDS)
            continue
        found = True
        if kind == FORMAT_KEY:
            if value.version != FORMAT:
                notes.append(
                    f"the store's layout is version {value.version}, this control plane's "
                    f"{FORMAT}: what it can read is used"
                )
        elif kind == REPLICAS:
            replicas[name] = value
        elif kind == NODES:
            since = None if value.drain_since is None else back(value.drain_since)
            nodes[name] = OperatorFlags(
                value.cordoned, value.draining, value.draining and value.drain_forced, since
            )
        else:
            m: StoredModel = value
            change = None
            if m.last_change is not None:
                c = m.last_change
                decision = Decision(c.after, Reason(c.reason), c.detail)
                change = Change(name, c.before, c.after, decision)
            window = tuple((back(at), n) for at, n in sorted(m.window))
            models[name] = ResumedModel(
                m.desired, back(m.changed_at), back(m.idle_since), window, change
            )
    return Restored(found, replicas, nodes, frozenset(unreadable), models, tuple(notes))
