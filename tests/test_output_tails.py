"""The engines' output tails the control plane keeps for the admin status: bounded, and
dropped with their replica."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from llmgw_core.catalog import Catalog
from llmgw_core.config import parse_config
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_core.wire import Register, ShardUpdate
from llmgw_server.control_shell.controlplane import ControlPlane
from llmgw_server.control_shell.output_tails import MAX_TAILS, OutputTails


def test_the_oldest_failure_goes_first_past_the_bound() -> None:
    tails = OutputTails(limit=3)
    for i in range(5):
        tails.record(("n1", f"r{i}", 0), (f"line {i}",))
    assert list(tails) == [("n1", "r2", 0), ("n1", "r3", 0), ("n1", "r4", 0)]
    tails.record(("n1", "r2", 0), ("again",))  # failed again: now the newest
    tails.record(("n1", "r5", 0), ("line 5",))
    assert dict(tails) == {
        ("n1", "r4", 0): ("line 4",),
        ("n1", "r2", 0): ("again",),
        ("n1", "r5", 0): ("line 5",),
    }
    assert OutputTails().limit == MAX_TAILS == 1_000


def test_prune_drops_the_tails_of_replicas_gone() -> None:
    tails = OutputTails()
    tails.record(("n1", "a", 0), ("x",))
    tails.record(("n2", "a", 1), ("y",))
    tails.record(("n1", "b", 0), ("z",))
    tails.prune(lambda rid: rid == "b")
    assert dict(tails) == {("n1", "b", 0): ("z",)}


CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "control": {"settle_after_start_s": 0, "reconcile_interval_s": 0},
    "models": [{"name": "m", "profile": {"engine": "vllm", "model": "org/m"}}],
}


NODE = Inventory(
    name="n1",
    gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),),
    engines=(EngineInfo("vllm", True, "1"),),
)


@asynccontextmanager
async def plane_with_a_replica() -> AsyncIterator[tuple[ControlPlane, LaunchSpec]]:
    """A control plane in process, node n1 registered, its one replica placed there."""
    async with trio.open_nursery() as nursery:
        plane = ControlPlane(parse_config(CONFIG, "<test>"), heartbeat_interval_s=5.0)
        await nursery.start(plane.run)
        plane.registered(Register(1, "test", NODE), 5.0)
        (replica,) = plane.reconciler.view().replicas
        spec = plane.reconciler.known.store.head(replica.replica_id)
        assert spec is not None
        yield plane, spec
        nursery.cancel_scope.cancel()


async def test_the_control_plane_keeps_a_tail_while_its_replica_is_known(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with plane_with_a_replica() as (plane, spec):
        failed = ShardReport(spec, ShardState.FAILED, "exit status 1")
        plane.shard_update("n1", ShardUpdate(failed, ("CUDA out of memory",)))
        await trio.sleep(60)  # restarts come and go: the replica is known, its tail kept
        assert dict(plane.output_tails) == {("n1", spec.replica_id, 0): ("CUDA out of memory",)}
        plane.set_catalog(Catalog(models=()))  # the model goes: its replica is stopped
        plane.shard_update("n1", ShardUpdate(ShardReport(spec, ShardState.STOPPED)))
        assert not plane.reconciler.knows_replica(spec.replica_id)
        assert dict(plane.output_tails) == {}


async def test_a_failure_registered_then_reported_with_its_tail_counts_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An engine failed while its agent was away: the registration carries the failure,
    the update after the welcome its output tail (the agent's unsent report)."""
    async with plane_with_a_replica() as (plane, spec):
        plane.disconnected("n1")
        failed = ShardReport(spec, ShardState.FAILED, "the engine exited with status 1")
        # And one of a model the catalog does not have: no label of the agent's naming.
        unknown = attrs.evolve(spec, replica_id="x-1", model_name="x", port=spec.port + 10)
        reports = (failed, ShardReport(unknown, ShardState.FAILED, "exit status 1"))
        plane.registered(Register(1, "test", NODE, shards=reports), 5.0)
        assert plane.metrics.engine_failures == {"m": 1}
        plane.shard_update("n1", ShardUpdate(failed, ("CUDA error",)))
        assert plane.metrics.engine_failures == {"m": 1}
        assert dict(plane.output_tails) == {("n1", spec.replica_id, 0): ("CUDA error",)}
