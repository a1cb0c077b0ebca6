"""The router's view of its replicas, off the request path.

Health probes: GET /health on every replica each interval, ejected ones after their
cooldown. Model cards: GET /v1/models on a healthy replica each `CARD_REFRESH_S`, the
engine's own description of its model for the router's /v1/models (model_cards.py).
Engine load, for the models whose policy reads it (cache_aware, precise): GET /metrics on
every available engine each `[router.cache_aware] metrics_interval_s`, once per engine
however many models it serves, with the engine key; a reading is used for
`metrics_max_age_s`, after which (or when the engine cannot be read) the router balances
on its own counts. A probe that timed out while this router itself was stalled for half
its wait or more is not judged (llmgw_core/awake_time.py): a router paused for seconds
would otherwise mark every engine down at once and answer 503 until the next round.
A router fed its routes by a control plane probes only once a complete table is applied
(`probe_once_followed`), so that /readyz says ready with every model placed.
"""

from __future__ import annotations

import logging
from collections.abc import Sized
from typing import Protocol

import httpx
import trio

from llmgw_core.awake_time import AwakeTime
from llmgw_core.catalog import Endpoint
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.front import Router
from llmgw_server.router.load_signals import parse_load
from llmgw_server.router.model_cards import MAX_LISTING_BYTES, card_of

log = logging.getLogger("llmgw.health")

CARD_REFRESH_S = 60.0  # an engine's description changes with its restart, if at all


class _AppliedTable(Protocol):
    @property
    def version(self) -> int: ...

    @property
    def models(self) -> Sized: ...


class FollowedFeed(Protocol):
    """What the first probes wait for: a route feed's follower (route_feed.follower),
    `complete` once it has applied a complete table, `table` the one applied last."""

    @property
    def complete(self) -> trio.Event: ...

    @property
    def table(self) -> _AppliedTable | None: ...


async def probe_forever(
    router: Router,
    client: httpx.AsyncClient,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe health and read engine load; `started()` after the first full health round."""
    clock = AwakeTime(trio.current_time())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_stalls, clock)
        if router.tuning.cache_aware.metrics_interval_s > 0:
            nursery.start_soon(read_load_forever, router, client)
        await nursery.start(_health_forever, router, client, clock)
        task_status.started()


async def _watch_stalls(clock: AwakeTime) -> None:
    while True:
        await trio.sleep(clock.tick_s)
        clock.watched(trio.current_time())


async def probe_once_followed(
    follower: FollowedFeed, router: Router, client: httpx.AsyncClient
) -> None:
    """Probe the replicas (and with the first round, turn /readyz 200) once `follower`
    has applied a complete table, then forever."""
    await follower.complete.wait()
    async with trio.open_nursery() as nursery:
        await nursery.start(probe_forever, router, client)
        table = follower.table
        log.info(
            "ready: route table %d applied (%d models placed) and its replicas probed",
            table.version if table is not None else -1,
            len(table.models) if table is not None else 0,
        )


async def _health_forever(
    router: Router,
    client: httpx.AsyncClient,
    clock: AwakeTime,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    interval = router.tuning.health_interval_s
    first = True
    cards_read: dict[tuple[str, Endpoint], float] = {}  # when each replica's card was read
    while True:
        async with trio.open_nursery() as nursery:
            now = trio.current_time()
            for model, balancer in router.served.balancers.items():
                for replica in balancer.replicas:
                    if balancer.due_for_probe(replica, now):
                        nursery.start_soon(_probe, client, clock, model, balancer, replica)
                    read = cards_read.get((model, replica.endpoint))
                    if replica.available and (read is None or now - read >= CARD_REFRESH_S):
                        cards_read[(model, replica.endpoint)] = now
                        nursery.start_soon(_read_card, router, client, model, replica.endpoint)
        live = {(m, r.endpoint) for m, b in router.served.balancers.items() for r in b.replicas}
        for gone in cards_read.keys() - live:
            del cards_read[gone]
        # A replica back (or new from the route table) frees slots with no request
        # ending: the requests waiting in the fair queues look again.
        router.dispatch_queues()
        if first:
            router.ready = True
            task_status.started()
            first = False
        await trio.sleep(interval)


def _auth(endpoint: Endpoint) -> dict[str, str] | None:
    return {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else None


async def _probe(
    client: httpx.AsyncClient,
    clock: AwakeTime,
    model: str,
    balancer: Balancer,
    replica: Replica,
) -> None:
    endpoint = replica.endpoint
    asked_at = trio.current_time()
    awake_at = clock.awake(asked_at)
    try:
        response = await client.get(endpoint.url + "/health", headers=_auth(endpoint))
        ok = response.status_code == 200
        why = f"answered {response.status_code}"
    except httpx.TimeoutException as exc:
        now = trio.current_time()
        stalled = (now - asked_at) - (clock.awake(now) - awake_at)
        if stalled >= (now - asked_at) / 2:
            # This router was not running for half the wait or more: no word on the engine.
            log.info(
                "%s for %s: a health probe timed out while this router stalled %.1f s: not counted",
                endpoint,
                model,
                stalled,
            )
            return
        ok, why = False, f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        ok = False
        why = f"{type(exc).__name__}: {exc}"
    was = replica.available
    balancer.probed(replica, ok, trio.current_time(), asked_at)
    if replica.available != was:
        if replica.available:
            log.info("%s for %s is healthy again", replica.endpoint, model)
        else:
            log.warning("%s for %s is unhealthy: %s", replica.endpoint, model, why)


async def _read_card(
    router: Router, client: httpx.AsyncClient, model: str, endpoint: Endpoint
) -> None:
    """The engine's description of `model`, kept for the router's /v1/models; an engine
    that cannot say leaves the last one (or none) in place."""
    url = endpoint.url + "/v1/models"
    body = bytearray()
    try:
        async with client.stream("GET", url, headers=_auth(endpoint)) as response:
            if response.status_code != 200:
                return
            async for data in response.aiter_bytes():
                body += data
                if len(body) > MAX_LISTING_BYTES:
                    return  # read no further than the limit
    except httpx.HTTPError:
        return
    card = card_of(bytes(body), model)
    if card is not None and model in router.served.balancers:
        router.served.cards[model] = card


async def read_load_forever(router: Router, client: httpx.AsyncClient) -> None:
    """Read every available engine's /metrics each interval, all engines at once."""
    interval = router.tuning.cache_aware.metrics_interval_s
    unreadable: set[Endpoint] = set()  # said once when it starts and once when it ends
    while True:
        engines: dict[Endpoint, list[Replica]] = {}
        for balancer in router.served.balancers.values():
            for replica in balancer.replicas if balancer.policy.reads_engine_load else ():
                if replica.available:
                    engines.setdefault(replica.endpoint, []).append(replica)
        async with trio.open_nursery() as nursery:
            for endpoint, replicas in engines.items():
                nursery.start_soon(_read_load, router, client, endpoint, replicas, unreadable)
        await trio.sleep(interval)


async def _read_load(
    router: Router,
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    replicas: list[Replica],
    unreadable: set[Endpoint],
) -> None:
    try:
        response = await client.get(endpoint.url + "/metrics", headers=_auth(endpoint))
        if response.status_code != 200:
            raise _Unreadable(f"it answered {response.status_code}")
        signal = parse_load(response.text)
        if signal is None:
            raise _Unreadable("its /metrics has no running or waiting requests llmgw knows")
    except (httpx.HTTPError, _Unreadable) as exc:
        router.metrics.engine_errors[endpoint.url] += 1
        if endpoint not in unreadable:
            unreadable.add(endpoint)
            log.warning(
                "cannot read the load of %s (%s): balancing on the router's own counts",
                endpoint,
                exc,
            )
        return
    if endpoint in unreadable:
        unreadable.discard(endpoint)
        log.info("reading the load of %s again", endpoint)
    now = trio.current_time()
    for replica in replicas:
        replica.took_reading(signal, now)


class _Unreadable(Exception):
    pass
