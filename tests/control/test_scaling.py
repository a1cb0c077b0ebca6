"""Autoscaling in the control core: routers' loads merged, counts decided, replicas placed,
drained, scaled to zero and woken (control.scaling and Reconciler.autoscale / wake)."""

from __future__ import annotations

from typing import Any

import attrs
from fleetsim import Fleet, catalog, gpu_node, profile

from llmgw_core.autoscaling import Autoscale, RouterLoad
from llmgw_core.catalog import ModelEntry
from llmgw_core.inventory import ShardState
from llmgw_server.control.autoscale import ModelLoad
from llmgw_server.control.commands import DrainShard, StopShard
from llmgw_server.control.scaling import merge

READY = ShardState.READY
LIVE = (ShardState.PENDING, ShardState.STARTING, ShardState.READY)


def scaled(name: str = "chat", **kw: object) -> ModelEntry:
    spec: dict[str, Any] = {"min": 0, "max": 4, "target_in_flight": 4.0, "scale_down_after_s": 60.0}
    spec.update(kw)
    return ModelEntry(name=name, profile=profile(tensor_parallel=1), autoscale=Autoscale(**spec))


def fleet_of(*models: ModelEntry) -> Fleet:
    fleet = Fleet(cat=catalog(*models))
    fleet.join(gpu_node("n1", 2), gpu_node("n2", 2))
    fleet.ready_all()
    return fleet


def cycle(fleet: Fleet, **loads: ModelLoad) -> None:
    fleet.feed(fleet.cp.autoscale(loads, fleet.now))
    fleet.ready_all()


def test_merge_sums_counts_and_keeps_the_worst_latency_and_the_latest_request() -> None:
    reports = [
        RouterLoad(in_flight=3, held=1, ttft_p90_ms=120.0, idle_s=4.0, kv_use=0.5),
        RouterLoad(in_flight=2, ttft_p90_ms=300.0, idle_s=1.5),
        RouterLoad(),
    ]
    load = merge(reports, now=100.0)
    assert load == ModelLoad(
        in_flight=5, held=1, ttft_p90_ms=300.0, kv_use=0.5, last_request_at=98.5
    )
    assert merge([], now=100.0) == ModelLoad()


def test_a_new_autoscaled_model_at_min_zero_starts_at_zero_until_a_request() -> None:
    fleet = fleet_of(scaled())
    assert not fleet.replicas("chat", *LIVE)
    assert fleet.cp.view().models[0].desired == 0
    cycle(fleet)  # its autoscaler starts, with no request: nothing to load
    fleet.advance(30)
    cycle(fleet)
    assert not fleet.replicas("chat", *LIVE)
    assert fleet.cp.view().models[0].desired == 0
    fleet.feed(fleet.cp.wake("chat", fleet.now))
    fleet.ready_all()
    assert len(fleet.replicas("chat", READY)) == 1


def test_a_new_autoscaled_model_starts_at_its_min() -> None:
    fleet = fleet_of(scaled(min=2))
    assert len(fleet.replicas("chat", READY)) == 2
    cycle(fleet)
    assert fleet.cp.view().models[0].desired == 2


def test_load_scales_up_at_once_and_down_only_after_the_window() -> None:
    fleet = fleet_of(scaled())
    busy = ModelLoad(in_flight=13, last_request_at=fleet.now)
    cycle(fleet, chat=busy)  # first cycle: the autoscaler starts at 0 and goes to 4
    assert len(fleet.replicas("chat", READY)) == 4
    assert any("scaling chat from 0 to 4 replicas: 13 in flight" in n for n in fleet.notes)
    calm = ModelLoad(in_flight=3, last_request_at=fleet.now)
    fleet.advance(30)
    cycle(fleet, chat=attrs.evolve(calm, last_request_at=fleet.now))
    assert len(fleet.replicas("chat", READY)) == 4  # inside the window: held
    fleet.advance(31)
    cycle(fleet, chat=attrs.evolve(calm, last_request_at=fleet.now))
    assert fleet.cp.view().models[0].desired == 1
    drains = [c for c in fleet.commands if isinstance(c, DrainShard)]
    assert len(drains) == 3  # the surplus drains: its requests finish first
    for command in drains:
        fleet.feed(fleet.cp.replica_drained(command.replica_id, fleet.now))
    assert len(fleet.replicas("chat", *LIVE)) == 1


def test_a_model_never_asked_for_is_idle_from_its_autoscalers_start() -> None:
    fleet = fleet_of(scaled(idle_to_zero_s=120.0))
    # A held request wakes it (a router's report: no request finished); then no router
    # reports it: nothing in flight, no request seen.
    cycle(fleet, chat=ModelLoad(held=1))
    assert fleet.cp.view().models[0].desired == 1
    cycle(fleet)
    fleet.advance(119)
    cycle(fleet)
    assert fleet.cp.view().models[0].desired == 1
    fleet.advance(2)
    cycle(fleet)
    assert fleet.cp.view().models[0].desired == 0


def test_idle_scales_to_zero_and_a_held_request_wakes_it() -> None:
    fleet = fleet_of(scaled(idle_to_zero_s=120.0))
    start = fleet.now
    cycle(fleet, chat=ModelLoad(held=1, last_request_at=start))
    fleet.advance(121)
    cycle(fleet, chat=ModelLoad(last_request_at=start))
    assert fleet.cp.view().models[0].desired == 0
    (drain,) = [c for c in fleet.commands if isinstance(c, DrainShard)]
    fleet.feed(fleet.cp.replica_drained(drain.replica_id, fleet.now))
    assert any(isinstance(c, StopShard) for c in fleet.commands)
    assert not fleet.replicas("chat", *LIVE)
    assert any("its model is scaled to 0 replicas" in n for n in fleet.notes)
    fleet.advance(5)
    fleet.feed(fleet.cp.wake("chat", fleet.now))
    fleet.ready_all()
    assert len(fleet.replicas("chat", READY)) == 1
    # Woken once: a second wake while it has a replica changes nothing.
    assert not fleet.cp.wake("chat", fleet.now).commands


def test_a_wake_asks_for_as_many_replicas_as_the_held_requests_need() -> None:
    fleet = fleet_of(scaled(idle_to_zero_s=10.0))
    cycle(fleet, chat=ModelLoad(last_request_at=fleet.now))
    fleet.advance(11)
    cycle(fleet, chat=ModelLoad(last_request_at=fleet.now - 11))
    assert fleet.cp.view().models[0].desired == 0
    fleet.feed(fleet.cp.wake("chat", fleet.now, held=9))  # target 4 a replica
    assert fleet.cp.view().models[0].desired == 3


def test_a_restarted_control_plane_keeps_what_runs_until_its_first_cycle() -> None:
    fleet = fleet_of(scaled())
    cycle(fleet, chat=ModelLoad(in_flight=10, last_request_at=fleet.now))
    running = fleet.replicas("chat", READY)
    assert len(running) == 3
    fleet.restart_control_plane(instance="b")
    fleet.advance(10)
    assert fleet.replicas("chat", READY) == running  # none retired as surplus
    assert not [c for c in fleet.commands[-20:] if isinstance(c, DrainShard)]
    cycle(fleet, chat=ModelLoad(in_flight=10, last_request_at=fleet.now))
    assert fleet.cp.view().models[0].desired == 3  # started at the three it found
    assert fleet.replicas("chat", READY) == running


def test_a_reload_keeps_the_count_within_the_new_bounds() -> None:
    fleet = fleet_of(scaled())
    cycle(fleet, chat=ModelLoad(in_flight=16, last_request_at=fleet.now))
    assert fleet.cp.view().models[0].desired == 4
    fleet.set_catalog(catalog(scaled(max=2)))
    assert fleet.cp.view().models[0].desired == 2
    fleet.set_catalog(catalog(ModelEntry(name="chat", profile=profile(tensor_parallel=1))))
    assert fleet.cp.view().models[0].desired == 1  # a fixed count again


def test_a_scale_up_that_does_not_fit_is_explained() -> None:
    fleet = fleet_of(scaled(max=8))  # two nodes of two GPUs: four replicas at most
    cycle(fleet, chat=ModelLoad(in_flight=30, last_request_at=fleet.now))
    view = fleet.cp.view()
    assert (view.models[0].desired, view.models[0].kept) == (8, 4)
    unplaced = view.unplaced["chat"]
    assert unplaced.count == 4
    assert unplaced.explanation.text.startswith("0 of 2 nodes fit"), unplaced.explanation.text
