"""The route feed's messages and their one converter: how routers follow a control plane.

A router (a separate `llmgw-server router` process, a worker of a server, or the
server's own router) follows the control plane's route table: every model the
control plane places, with the endpoints that serve it, and the endpoints being
drained (drain intents: they take no new requests, those in flight finish).

Down (control plane -> router): `Routes`, the whole table, each time it changes.
Up (router -> control plane): `Hello` first, then `InFlight`: the requests the
router has in flight on each draining endpoint, for the table version it has
applied, so the control plane stops a drained replica only once no router is
still using it. While the table names autoscaled models, `Load` too: each one's
load as this router sees it (every `LOAD_INTERVAL_S`, and at once when it holds a
request for a model that no replica serves), for the control plane's autoscaler.
A control plane from before autoscaling names none, and is sent none.

Epochs (route feed protocol 2): a control plane kept in a store (`[control.store]`)
stamps each table with its leadership's epoch; a router refuses a table of an epoch
below the highest it has applied (a control plane that no longer leads: `StaleEpoch`)
and looks for the leader. Epoch 0 is a single control plane's, never fenced.

Versions: a router's `Hello` says the oldest protocol it speaks (`protocol`, what a
control plane of protocol 1 checks, word for word) and its newest (`newest`); the
control plane follows it in the newest both speak (`spoken`). A table is one shape for
every version: a router of protocol 1 ignores the epoch (as every router ignores a
field it does not know), and a control plane of protocol 1 sends none (epoch 0).
`Traffic` every `TRAFFIC_INTERVAL_S` while it served anything: each model's and
replica's requests, 4xx and 5xx answers, TTFT p90 and in flight, for the fleet page
(at most `MAX_TRAFFIC_ROWS` rows a frame: ~120 bytes each, ~500 KB at most).

A frame is one JSON text with a "type" tag. Decoding never raises anything but
`FeedError`, whose text says what was wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
from cattrs.preconf.json import make_converter
from cattrs.strategies import configure_tagged_union

from llmgw_core.autoscaling import RouterLoad
from llmgw_core.catalog import Endpoint
from llmgw_core.tagged_json import TaggedFrames
from llmgw_core.traffic import Sample

PROTOCOL = 2  # the newest route feed protocol: 2 stamps each table with an epoch
OLDEST_PROTOCOL = 1  # the oldest a router or a control plane of this release speaks
EPOCH_PROTOCOL = 2  # the first whose routers refuse a table of a stale epoch
MAX_FRAME_BYTES = 16 * 1024 * 1024  # a table of thousands of replicas still fits
LOAD_INTERVAL_S = 2.0  # how often a router reports its autoscaled models' load
MAX_LOAD_MODELS = 10_000  # models one load frame may name
TRAFFIC_INTERVAL_S = 5.0  # how often a router reports what it served (the page's traffic)
MAX_TRAFFIC_ROWS = 4096  # models and replicas one traffic frame may name
USAGE_INTERVAL_S = 0.25  # how often a router reports its limited tenants' use (shares)
MAX_SHARE_LIMITS = 100_000  # limits one usage or shares frame may name (~60 bytes each)
MAX_LIMIT_ID = 512  # a limit's id: "tenant/kind" or "tenant/kind/model"


class FeedError(Exception):
    """A frame that cannot be used: not JSON, unknown type, wrong fields, wrong protocol."""


class StaleEpoch(FeedError):
    """A table of an epoch below the highest this router applied: its control plane led
    once and no longer does (paused past its lease, then woken)."""

    def __init__(self, epoch: int, highest: int) -> None:
        super().__init__(
            f"a route table of stale epoch {epoch} was refused (this router follows "
            f"epoch {highest}): that control plane no longer leads"
        )
        self.epoch = epoch
        self.highest = highest


def stale(epoch: int, highest: int) -> bool:
    """Whether a table of `epoch` is refused by a router that applied `highest`: a lower
    epoch is; epoch 0 (a single control plane's) never is."""
    return 0 < epoch < highest


@attrs.frozen
class RouteTable:
    """What routers serve, as the control plane sees it at `version`.

    `models`: every model the control plane places -> its endpoints (empty: none serve
    now), the draining ones included so that routers keep counting what they have in
    flight there. `draining`: endpoints that take no new requests.
    `complete`: False while a control plane that just started may not yet have heard
    from every agent; a router that serves a complete table keeps its endpoints until
    a complete one comes (it still applies the drain intents).
    `adapters`: every LoRA adapter of the placed models -> the model it adapts, whose
    replicas serve it under its own name (a table from before adapters has none).
    `autoscaled`: the models whose replicas follow the load: routers report their load
    (`Load`) and hold their requests while no replica serves (scaled to zero).
    `traffic`: the control plane takes `Traffic` reports (one from before them would
    close the feed on an unknown message: its tables lack the field, False).
    `epoch`: the leadership of the control plane that sent it (0: a single control
    plane, or one from before epochs; never fenced).
    `shares`: the hub hands out shares of the tenants' limits (`Usage` up, `Shares`
    down); one from before tenants lacks the field, False, and is sent no usage.
    """

    version: int
    models: Mapping[str, tuple[Endpoint, ...]] = attrs.field(factory=dict, hash=False)
    draining: frozenset[Endpoint] = frozenset()
    complete: bool = True
    adapters: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    autoscaled: frozenset[str] = frozenset()
    traffic: bool = False
    epoch: int = 0
    shares: bool = False


EMPTY_TABLE = RouteTable(0, {}, frozenset(), complete=False)


# Down: control plane -> router


@attrs.frozen
class Routes:
    table: RouteTable


@attrs.frozen
class Shares:
    """This router's shares of the tenants' limits (llmgw_core.limit_shares: a Grant),
    by limit id. `full`: the whole map (a limit not named: 0); else the named change."""

    version: int
    shares: Mapping[str, float] = attrs.field(factory=dict, hash=False)
    full: bool = False


# Up: router -> control plane


@attrs.frozen
class Hello:
    """The first frame of every feed: the protocols the router speaks and a name for it
    (logs only). `protocol`: the oldest it speaks; `newest`: the newest (0: `protocol`
    alone, as a router of protocol 1 says it)."""

    protocol: int
    router: str
    newest: int = 0


def spoken(hello: Hello) -> int:
    """The protocol a control plane of this release follows the router of `hello` in:
    the newest both speak."""
    return min(max(hello.protocol, hello.newest), PROTOCOL)


@attrs.frozen
class InFlight:
    """Requests in flight per draining endpoint (keyed by its URL) once the router has
    applied table `version`; an endpoint left out has none."""

    version: int
    counts: Mapping[str, int] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class Load:
    """Each autoscaled model's load as this router (or a workers' parent, its workers
    summed) sees it now; a model left out has none."""

    models: Mapping[str, RouterLoad] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class Traffic:
    """What this router answered over its last `interval_s`: a row for each model it
    served (replica MODEL_ROW, "*": all its requests) and each replica; a row with
    nothing to say is left out."""

    interval_s: float
    rows: tuple[Sample, ...] = ()


@attrs.frozen
class Usage:
    """Each limit of this router's limited tenants, by id: its `total` as the router's
    config sets it, the share it enforces (`have`), what it has `used` (its window's, or
    in flight) and would have used (`wanted`: refused or queued demand too), after it
    applied the `applied` version of Shares on this connection (-1: none yet)."""

    applied: int
    totals: Mapping[str, float] = attrs.field(factory=dict, hash=False)
    have: Mapping[str, float] = attrs.field(factory=dict, hash=False)
    used: Mapping[str, float] = attrs.field(factory=dict, hash=False)
    wanted: Mapping[str, float] = attrs.field(factory=dict, hash=False)


UpMessage = Hello | InFlight | Load | Traffic | Usage
DownMessage = Routes | Shares

_TAGS: dict[type, str] = {
    Hello: "hello",
    InFlight: "in_flight",
    Load: "load",
    Traffic: "traffic",
    Usage: "usage",
    Routes: "routes",
    Shares: "shares",
}
_UP_TAGS = frozenset({"hello", "in_flight", "load", "traffic", "usage"})
_DOWN_TAGS = frozenset({"routes", "shares"})


converter = make_converter(forbid_extra_keys=False)


def _strict(kind: type) -> Any:
    # cattrs would call int("7") or bool("no"): a frame says what it means or is refused.
    def structure(value: object, _: type) -> object:
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return structure


for _kind in (int, bool, str):
    converter.register_structure_hook(_kind, _strict(_kind))


def _number(value: object, _: type) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise TypeError(f"expected a finite number, got {value!r}"[:80])
    return float(value)  # type: ignore[arg-type]


converter.register_structure_hook(float, _number)
configure_tagged_union(UpMessage, converter, tag_generator=_TAGS.__getitem__, tag_name="type")
configure_tagged_union(DownMessage, converter, tag_generator=_TAGS.__getitem__, tag_name="type")
_frames = TaggedFrames(converter, FeedError, "the route feed", MAX_FRAME_BYTES)


def encode(message: UpMessage | DownMessage) -> str:
    if isinstance(message, Routes | Shares):
        data = converter.unstructure(message, DownMessage)
    else:
        data = converter.unstructure(message, UpMessage)
    return json.dumps(data, separators=(",", ":"))


def decode_down(frame: str | bytes) -> DownMessage:
    message = _frames.decode(frame, DownMessage, _DOWN_TAGS)
    assert isinstance(message, Routes | Shares)
    if isinstance(message, Routes):
        _check_table(message.table)
    else:
        if message.version < 0:
            raise FeedError(f"a shares frame's version must not be negative: {message.version}")
        _check_amounts("shares", message.shares)
    return message


def decode_table(frame: str | bytes) -> RouteTable:
    """A frame that must be a route table (not a grant of shares)."""
    message = decode_down(frame)
    if not isinstance(message, Routes):
        raise FeedError(f"expected a route table, got {_TAGS[type(message)]}")
    return message.table


def decode_up(frame: str | bytes) -> UpMessage:
    message = _frames.decode(frame, UpMessage, _UP_TAGS)
    assert isinstance(message, Hello | InFlight | Load | Traffic | Usage)
    if isinstance(message, Hello):
        _check_hello(message)
    if isinstance(message, InFlight):
        if message.version < 0:
            raise FeedError(f"an in_flight frame's version must not be negative: {message.version}")
        for url, count in message.counts.items():
            if count < 0:
                raise FeedError(f"an in_flight count must not be negative: {url!r} has {count}")
    if isinstance(message, Load):
        _check_load(message)
    if isinstance(message, Traffic):
        _check_traffic(message)
    if isinstance(message, Usage):
        if message.applied < -1:
            raise FeedError(f"a usage frame's applied version is below -1: {message.applied}")
        for what in ("totals", "have", "used", "wanted"):
            _check_amounts(what, getattr(message, what))
    return message


def _check_amounts(what: str, amounts: Mapping[str, float]) -> None:
    if len(amounts) > MAX_SHARE_LIMITS:
        raise FeedError(f"a frame's {what} name {len(amounts)} limits, over {MAX_SHARE_LIMITS}")
    for limit, amount in amounts.items():
        if not limit or len(limit) > MAX_LIMIT_ID:
            raise FeedError(f"a limit id must be 1-{MAX_LIMIT_ID} characters: {limit[:80]!r}")
        if amount < 0:
            raise FeedError(f"an amount must not be negative: {limit[:80]!r} in {what}")


def _check_hello(hello: Hello) -> None:
    speaks = f"this control plane speaks {OLDEST_PROTOCOL} to {PROTOCOL}"
    if hello.protocol > PROTOCOL:
        raise FeedError(
            f"route feed protocol {hello.protocol} is not supported ({speaks}): "
            "upgrade the control plane before its routers"
        )
    if max(hello.protocol, hello.newest) < OLDEST_PROTOCOL:
        raise FeedError(
            f"route feed protocol {hello.protocol} is not supported ({speaks}): upgrade the router"
        )


def _check_traffic(message: Traffic) -> None:
    if len(message.rows) > MAX_TRAFFIC_ROWS:
        raise FeedError(f"a traffic frame names {len(message.rows)} rows, over {MAX_TRAFFIC_ROWS}")
    if not 0 < message.interval_s <= 3600:
        raise FeedError(f"a traffic interval must be 0-3600 s, not {message.interval_s}")
    for row in message.rows:
        if min(row.requests, row.e4xx, row.e5xx, row.in_flight) < 0:
            raise FeedError(f"a traffic count must not be negative: {row.model!r}")
        if row.ttft_p90_ms is not None and row.ttft_p90_ms < 0:
            raise FeedError(f"a TTFT must not be negative: {row.model!r}")


def _check_load(message: Load) -> None:
    if len(message.models) > MAX_LOAD_MODELS:
        raise FeedError(f"a load frame names {len(message.models)} models, over {MAX_LOAD_MODELS}")
    for model, load in message.models.items():
        if load.in_flight < 0 or load.held < 0:
            raise FeedError(f"a load count must not be negative: {model!r}")
        if load.ttft_p90_ms is not None and load.ttft_p90_ms < 0:
            raise FeedError(f"a TTFT must not be negative: {model!r}")
        if load.idle_s is not None and load.idle_s < 0:
            raise FeedError(f"an idle time must not be negative: {model!r}")
        if load.kv_use is not None and not 0 <= load.kv_use <= 1:
            raise FeedError(f"a KV-cache use is a share, 0-1: {model!r} has {load.kv_use}")


def _check_table(table: RouteTable) -> None:
    if table.version < 0:
        raise FeedError(f"a table's version must not be negative: {table.version}")
    if table.epoch < 0:
        raise FeedError(f"a table's epoch must not be negative: {table.epoch}")
    for model, endpoints in table.models.items():
        if not model:
            raise FeedError("a table names a model with an empty name")
        for endpoint in endpoints:
            _check_endpoint(endpoint, f"model {model!r}")
    for endpoint in table.draining:
        _check_endpoint(endpoint, "draining")
    for adapter, base in table.adapters.items():
        # The catalog's rule (catalog._names_once), held by the table too: a name clients
        # call is one model's or one adapter's, and an adapter's model is in the table.
        if not adapter or adapter in table.models:
            raise FeedError(f"a table names the adapter {adapter!r}, which is no adapter's name")
        if base not in table.models:
            raise FeedError(f"the adapter {adapter!r} adapts {base!r}, which the table lacks")
    for model in table.autoscaled:
        if model not in table.models:
            raise FeedError(f"a table autoscales {model!r}, which it does not place")


def _check_endpoint(endpoint: Endpoint, where: str) -> None:
    if not endpoint.host:
        raise FeedError(f"an endpoint of {where} has no host")
    if not 0 < endpoint.port < 65536:
        raise FeedError(f"an endpoint of {where} has port {endpoint.port}, not 1-65535")
