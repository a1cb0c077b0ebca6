"""Active health probes: GET /health on every replica, ejected ones after their cooldown."""

from __future__ import annotations

import logging

import httpx
import trio

from llmgw_server.balancer import Balancer, Replica
from llmgw_server.router import Router

log = logging.getLogger("llmgw.health")


async def probe_forever(
    router: Router,
    client: httpx.AsyncClient,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Probe every replica each interval; `started()` after the first full round."""
    interval = router.tuning.health_interval_s
    first = True
    while True:
        async with trio.open_nursery() as nursery:
            now = trio.current_time()
            for model, balancer in router.balancers.items():
                for replica in balancer.replicas:
                    if balancer.due_for_probe(replica, now):
                        nursery.start_soon(_probe, client, model, balancer, replica)
        if first:
            router.ready = True
            task_status.started()
            first = False
        await trio.sleep(interval)


async def _probe(
    client: httpx.AsyncClient, model: str, balancer: Balancer, replica: Replica
) -> None:
    endpoint = replica.endpoint
    headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else None
    try:
        response = await client.get(endpoint.url + "/health", headers=headers)
        ok = response.status_code == 200
        why = f"answered {response.status_code}"
    except httpx.HTTPError as exc:
        ok = False
        why = f"{type(exc).__name__}: {exc}"
    was = replica.available
    balancer.probed(replica, ok, trio.current_time())
    if replica.available != was:
        if replica.available:
            log.info("%s for %s is healthy again", replica.endpoint, model)
        else:
            log.warning("%s for %s is unhealthy: %s", replica.endpoint, model, why)
