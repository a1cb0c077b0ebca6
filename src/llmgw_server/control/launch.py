"""Turning a placement into launch specs: one per shard, with the replica's ports."""

from __future__ import annotations

from collections.abc import Iterable

from llmgw_core.catalog import Profile
from llmgw_core.inventory import LaunchSpec
from llmgw_server.control.placement import Assignment


def launch_specs(
    replica_id: str,
    profile: Profile,
    placed: Assignment,
    head_address: str,
    port: int,
    *,
    api_key: str = "",
) -> list[LaunchSpec]:
    """The spec of every shard of a newly placed replica, in rank order.

    Every shard carries every rank's node, so that a restarted control plane
    can tell from any one shard which others belong with it, and the replica's
    engine key, so that it learns the key back from whichever shard it hears of.
    """
    nodes = tuple(s.node for s in placed.shards)
    return [
        LaunchSpec(
            replica_id=replica_id,
            model_name=placed.model,
            engine=profile.engine,
            hf_model=profile.model,
            args=profile.args,
            env=dict(profile.env),
            tensor_parallel=profile.tensor_parallel,
            pipeline_parallel=profile.pipeline_parallel,
            rank=rank,
            nodes=nodes,
            gpu_indices=shard.gpus,
            head_address=head_address,
            port=port,
            dist_port=port + 1,
            api_key=api_key,
            max_model_len=profile.max_model_len,
            lora=profile.lora,
            max_lora_rank=profile.max_lora_rank,
            kv_events=profile.kv_events,
        )
        for rank, shard in enumerate(placed.shards)
    ]


def free_port(
    used: Iterable[int], lo: int, hi: int, *, after: int | None = None, width: int = 2
) -> int:
    """The first port P from `after` on (wrapping within lo..hi) with P .. P+width-1 unused.

    The HTTP port and the rendezvous port go in pairs (and the KV events' two after
    them, `width` 4). A restart searches from after the failed attempt's ports, so
    that a port some other process took costs one failed start, not a crash loop.
    """
    taken = set(used)
    span = max(hi - lo - (width - 2), 1)  # candidates whose last port is at most hi
    start = after - lo if after is not None and lo <= after < lo + span else 0
    for i in range(span):
        port = lo + (start + i) % span
        if all(port + j not in taken for j in range(width)):
            return port
    return lo + start  # every port is taken: the agent reports the clash
