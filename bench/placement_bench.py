"""Placement benchmark: 500 replicas of mixed sizes on 1,000 nodes of 8 GPUs.

Budgets (issue 3): placing them all at most 1 s; explaining why one model
cannot be placed on that fleet at most 100 ms. Also measured, for the shell
that will call it: one reconcile of a Reconciler that holds that fleet.

    .venv/bin/python bench/placement_bench.py [--runs N]

Prints the median of N runs per case. A benchmark, not a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from llmgw_core.catalog import Catalog, ModelEntry, Profile
from llmgw_core.control_config import ControlSection
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, ShardState
from llmgw_server.control.placement import (
    NodeCapacity,
    PlacementRequest,
    explain,
    place,
)
from llmgw_server.control.reconciler import Reconciler

NODES, GPUS, PODS = 1000, 8, 20
H100 = "NVIDIA H100 80GB HBM3"
ENGINES = (EngineInfo("vllm", True, "0.11.0"), EngineInfo("mock", True, "0.1.0"))
# (tensor_parallel, pipeline_parallel, share of the 500 replicas)
SIZES = ((1, 1, 0.40), (2, 1, 0.25), (4, 1, 0.20), (8, 1, 0.10), (8, 2, 0.05))


def fleet() -> list[Inventory]:
    rng = random.Random(7)
    out = []
    for n in range(NODES):
        name = f"gpu-{n:04d}"
        gpus = tuple(
            Gpu(i, f"GPU-{n}-{i}", H100, 81559, 81559 - rng.choice((0, 0, 512, 2048)))
            for i in range(GPUS)
        )
        out.append(
            Inventory(
                name=name,
                address=f"10.{n // 250}.{n % 250}.1",
                labels={"pool": "prod" if n % 10 else "dev"},
                fabric={"ib_domain": f"pod-{n % PODS:02d}"},
                cpus=192,
                memory_mib=2 * 1024 * 1024,
                gpus=gpus,
                engines=ENGINES,
            )
        )
    return out


def size_at(share: float) -> tuple[int, int]:
    """The replica size found `share` of the way through the mix."""
    for tp, pp, part in SIZES:
        if share <= part:
            return tp, pp
        share -= part
    return SIZES[-1][0], SIZES[-1][1]


def catalog() -> Catalog:
    """25 models of 20 replicas each: 500 replicas in the size mix of SIZES."""
    models = []
    per_model = 20
    for i in range(25):
        tp, pp = size_at((i + 0.5) / 25)
        profile = Profile(
            engine="vllm",
            model=f"org/model-{i}",
            tensor_parallel=tp,
            pipeline_parallel=pp,
            gpu_memory_gib=(60, 70, 0)[i % 3],
            gpu_model="H100" if i % 2 else None,
            node_selector={"pool": "prod"} if i % 4 == 0 else {},
        )
        models.append(ModelEntry(name=f"model-{i}", profile=profile, replicas=per_model))
    return Catalog(tuple(models))


def requests(cat: Catalog) -> list[PlacementRequest]:
    out = []
    for m in cat.profiled:
        assert m.profile is not None
        out += [PlacementRequest(f"{m.name}#{k}", m.name, m.profile) for k in range(m.replicas)]
    return out


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs

    inventories = fleet()
    cat = catalog()
    reqs = requests(cat)
    nodes = [NodeCapacity(inv) for inv in inventories]
    result = place(reqs, nodes)
    gpus = sum(len(s.gpus) for a in result.assignments for s in a.shards)
    multi = sum(1 for a in result.assignments if len(a.shards) > 1)
    assert not result.unplaced, result.explanations

    # The fleet as it is once those replicas run, for the explanations.
    used: dict[str, set[int]] = {}
    for a in result.assignments:
        for s in a.shards:
            used.setdefault(s.node, set()).update(s.gpus)
    after = [NodeCapacity(inv, used_gpus=frozenset(used.get(inv.name, ()))) for inv in inventories]
    too_big = Profile(engine="vllm", model="org/huge", tensor_parallel=8, pipeline_parallel=64)
    too_hungry = Profile(engine="vllm", model="org/hungry", tensor_parallel=8, gpu_memory_gib=90)
    why_big = explain("huge", too_big, after)
    why_hungry = explain("hungry", too_hungry, after)
    assert not why_big.placeable and not why_hungry.placeable

    # A Reconciler holding the same fleet with every replica ready: the cost of one
    # reconcile, which any event that changes something sets off.
    settings = ControlSection(settle_after_start_s=0, reconcile_interval_s=0.2)
    rec = Reconciler(settings, cat, now=0.0, instance="bench")
    t = 0.0
    commands = [c for inv in inventories for c in rec.register(inv, [], t).commands]
    t += 1
    commands += rec.tick(t).commands
    for command in commands:
        spec = command.spec  # type: ignore[union-attr]
        rec.shard_status(command.node, spec.replica_id, spec.rank, ShardState.READY, t)
    assert sum(len(urls) for urls in rec.serving().values()) == len(reqs)

    def heartbeats() -> None:
        nonlocal t
        t += 1
        for inv in inventories:
            rec.heartbeat(inv.name, t)

    def reconcile() -> None:
        heartbeats()  # keeps every node reachable however many runs
        step = rec.set_catalog(cat, t)  # any change sets off the same full reconcile
        assert not step.commands

    rows = [
        (
            f"place {len(reqs)} replicas ({gpus} GPUs, {multi} multi-node) "
            f"on {NODES} nodes x {GPUS} GPUs",
            median_ms(lambda: place(reqs, nodes), runs),
            1000.0,
        ),
        (
            "explain: 8 x 64 GPUs across nodes (fabric domains too small)",
            median_ms(lambda: explain("huge", too_big, after), runs),
            100.0,
        ),
        (
            "explain: 8 GPUs with 90 GiB free each (every node lacks memory)",
            median_ms(lambda: explain("hungry", too_hungry, after), runs),
            100.0,
        ),
        (
            f"{NODES} heartbeats that change nothing",
            median_ms(heartbeats, runs),
            float("nan"),
        ),
        (
            f"{NODES} heartbeats, then a full reconcile of {len(reqs)} ready replicas",
            median_ms(reconcile, runs),
            float("nan"),
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"placement benchmark, median of {runs} runs (Python {sys.version.split()[0]})")
    print(f"{'case':<{width}}  {'median':>10}  {'budget':>9}")
    for case, ms, budget in rows:
        verdict = "" if budget != budget else ("ok" if ms <= budget else "OVER BUDGET")
        shown = "-" if budget != budget else f"{budget:.0f} ms"
        print(f"{case:<{width}}  {ms:>7.1f} ms  {shown:>9}  {verdict}")
    print()
    print(f"huge:   {why_big.text[:160]}...")
    print(f"hungry: {why_hungry.text[:160]}...")


if __name__ == "__main__":
    main()
