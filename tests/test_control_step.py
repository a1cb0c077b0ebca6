"""The control shell knows the core by its steps alone (issue 37): after a step it reads
nothing back, so what it publishes, counts, closes and prunes comes from what the step
carries. Here the shell's reconciler answers its events and fails any other read, and
a replica's life (placed, serving, failed with an output tail, restarted, drained when
its model goes, stopped) shows the route table, the failures counted and the tails kept
as the core's own queries say they should be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from llmgw_core.catalog import Catalog
from llmgw_core.config import parse_config
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_core.wire import Register, ShardUpdate
from llmgw_server.control.reconciler import Reconciler
from llmgw_server.control_shell.controlplane import ControlPlane

CONFIG: dict[str, object] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "agents": {"insecure": True},
    "control": {"settle_after_start_s": 0, "reconcile_interval_s": 0},
    "models": [
        {
            "name": "m",
            "profile": {
                "engine": "vllm",
                "model": "org/m",
                "lora": [{"name": "m-sql", "path": "/lora/sql"}],
            },
        }
    ],
}
NODE = Inventory(
    name="n1",
    gpus=(Gpu(0, "GPU-0", "NVIDIA L4", 23034, 22500),),
    engines=(EngineInfo("vllm", True, "1"),),
)


class EventsOnly:
    """A reconciler that takes events and answers no other question."""

    EVENTS = frozenset(
        {
            "tick",
            "register",
            "paced",
            "heartbeat",
            "disconnected",
            "shard_status",
            "replica_drained",
            "set_catalog",
            "cordon",
            "request_drain",
            "drain_node",
            "autoscale",
            "wake",
            "restore",
        }
    )

    def __init__(self, core: Reconciler) -> None:
        self.core = core

    def __getattr__(self, name: str) -> Callable[..., Any]:
        assert name in self.EVENTS, f"the shell read reconciler.{name} back after a step"
        method: Callable[..., Any] = getattr(self.core, name)
        return method


def head(core: Reconciler) -> LaunchSpec:
    (replica,) = core.view().replicas
    spec = core.known.store.head(replica.replica_id)
    assert spec is not None
    return spec


def table_as_the_core_says(plane: ControlPlane, core: Reconciler) -> None:
    table = plane.routes.table
    assert dict(table.models) == core.serving()
    assert dict(table.adapters) == core.catalog.adapters
    assert table.autoscaled == frozenset(core.scaling.specs)
    assert table.complete is not core.awaiting


async def test_the_shell_acts_on_what_each_step_carries(autojump_clock: trio.abc.Clock) -> None:
    plane = ControlPlane(parse_config(CONFIG, "<test>"), heartbeat_interval_s=5.0)
    core = plane.reconciler
    plane.reconciler = EventsOnly(core)  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        await nursery.start(plane.run)
        plane.registered(Register(1, "test", NODE), 5.0)
        spec = head(core)
        assert plane.routes.table.models == {"m": ()}
        table_as_the_core_says(plane, core)

        plane.shard_update("n1", ShardUpdate(ShardReport(spec, ShardState.READY)))
        (serving,) = plane.routes.table.models["m"]
        assert serving.url == spec.url and serving.api_key == spec.api_key
        table_as_the_core_says(plane, core)

        failed = ShardReport(spec, ShardState.FAILED, "exit status 1")
        plane.shard_update("n1", ShardUpdate(failed, ("CUDA out of memory",)))
        assert plane.metrics.engine_failures == {"m": 1}
        assert plane.routes.table.models == {"m": ()}
        for _ in range(6):  # the restart's backoff: started again, its tail kept
            await trio.sleep(5)
            plane.heartbeat("n1")
        spec = head(core)
        assert spec.attempt == 1
        plane.shard_update("n1", ShardUpdate(ShardReport(spec, ShardState.READY)))
        (serving,) = plane.routes.table.models["m"]
        assert serving.url == spec.url
        assert dict(plane.output_tails) == {("n1", spec.replica_id, 0): ("CUDA out of memory",)}
        table_as_the_core_says(plane, core)

        # The model goes: its serving replica drains, kept in the table until it is idle.
        plane.set_catalog(Catalog(models=()))
        assert plane.routes.table.draining == {serving}
        assert plane.routes.table.models == {"m": (serving,)}
        assert plane.routes.table.adapters == {}
        await trio.sleep(1)  # no router has a request in flight there: stopped
        assert plane.routes.table.models == {}
        assert plane.routes.table.draining == frozenset()
        plane.shard_update("n1", ShardUpdate(ShardReport(spec, ShardState.STOPPED)))
        assert not core.knows_replica(spec.replica_id)
        assert dict(plane.output_tails) == {}
        table_as_the_core_says(plane, core)
        nursery.cancel_scope.cancel()
