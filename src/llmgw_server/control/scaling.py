"""Every autoscaled model's replica count, from what the routers report (issue 23).

Pure, like the reconciler that owns it: routers' reports and the time in, replica counts
and their reasons out. Each router (a worker, a server's own, a router apart; a workers'
parent sums its workers') reports each autoscaled model's load (`RouterLoad`) over the
route feed it already follows; `merge` makes one `ModelLoad` of them; one `Autoscaler`
per model (control.autoscale) turns it into a count.

A control plane that starts does not know what runs until its agents registered: an
autoscaler starts at its first cycle (after `settle_after_start_s`, once the table is
complete), at the replicas then kept. Until then the reconciler keeps what runs, up to
`max`, and places up to the count a new model starts at (`catalog._default_replicas`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from llmgw_core.autoscaling import Autoscale, RouterLoad, combine
from llmgw_core.catalog import Catalog
from llmgw_server.control.autoscale import Autoscaler, Decision, ModelLoad


def merge(reports: Iterable[RouterLoad], now: float) -> ModelLoad:
    """All routers' reports of one model as one load (autoscaling.combine), at `now`."""
    r = combine(reports)
    last = None if r.idle_s is None else now - r.idle_s
    return ModelLoad(r.in_flight, r.held, r.ttft_p90_ms, r.kv_use, last)


@attrs.frozen(slots=True)
class Change:
    model: str
    before: int
    after: int
    decision: Decision


@attrs.frozen(slots=True)
class ScaleView:
    """What status, explain and the page say of an autoscaled model."""

    min: int
    max: int
    target: str  # "2 in flight a replica, TTFT p90 500 ms"
    now: str | None  # the last cycle's reason; None before the first
    last_change: str | None  # "1 -> 3: 13 in flight, target 4 a replica"; None: none yet


def describe_target(spec: Autoscale) -> str:
    parts = []
    if spec.target_in_flight is not None:
        parts.append(f"{spec.target_in_flight:g} in flight a replica")
    if spec.target_kv_use is not None:
        parts.append(f"KV-cache use {spec.target_kv_use:g}")
    if spec.ttft_p90_ms is not None:
        parts.append(f"TTFT p90 {spec.ttft_p90_ms:g} ms")
    return ", ".join(parts)


class Scaling:
    """The autoscalers of a catalog's autoscaled models; started one by one."""

    def __init__(self) -> None:
        self.specs: dict[str, Autoscale] = {}
        self.autoscalers: dict[str, Autoscaler] = {}  # started ones
        self.changes: dict[str, Change] = {}  # each model's last change
        self.started: dict[str, float] = {}  # when each autoscaler started
        # Models whose autoscaler's state may have changed since the reconciler last
        # looked (it takes them for the store each step: control.persisted).
        self.touched: set[str] = set()

    def follow(self, catalog: Catalog) -> None:
        """The catalog's autoscaled models from now on. A model whose bounds or targets
        changed keeps its count (within the new bounds) and its windows; one that is no
        longer autoscaled is forgotten."""
        specs = {m.name: m.autoscale for m in catalog.profiled if m.autoscale is not None}
        for name in list(self.autoscalers):
            spec = specs.get(name)
            self.touched.add(name)
            if spec is None:
                del self.autoscalers[name]
                self.changes.pop(name, None)
                self.started.pop(name, None)
            elif spec != self.specs[name]:
                scaler = self.autoscalers[name]
                scaler.spec = spec
                scaler.desired = min(max(scaler.desired, spec.min), spec.max)
        self.specs = specs

    def counts(self) -> dict[str, int]:
        """Each started autoscaler's replica count."""
        return {name: s.desired for name, s in self.autoscalers.items()}

    def unstarted(self) -> dict[str, int]:
        """Each autoscaled model not started yet -> the most running replicas to keep."""
        return {n: spec.max for n, spec in self.specs.items() if n not in self.autoscalers}

    def decide(
        self, loads: Mapping[str, ModelLoad], kept: Mapping[str, int], now: float
    ) -> list[Change]:
        """One cycle: each model's decision on its load (none reported: idle, nothing in
        flight). A model's autoscaler starts here, at the replicas `kept` now."""
        changes = []
        for name, spec in self.specs.items():
            scaler = self.autoscalers.get(name)
            if scaler is None:
                # At what runs, within bounds: a model at min 0 with nothing running stays
                # at 0 until a request is held for it.
                start = max(min(kept.get(name, 0), spec.max), spec.min)
                scaler = self.autoscalers[name] = Autoscaler.start(spec, now, start)
                self.started[name] = now
            self.touched.add(name)
            load = loads.get(name, ModelLoad())
            if load.last_request_at is None:
                # No router has seen a request: idle since the autoscaler started.
                load = attrs.evolve(load, last_request_at=self.started[name])
            before = scaler.desired
            decision = scaler.decide(load, now)
            if decision.desired != before:
                changes.append(Change(name, before, decision.desired, decision))
        self.changes.update((c.model, c) for c in changes)
        return changes

    def wake(self, model: str, now: float, held: int = 1) -> Change | None:
        """Routers hold `held` requests for `model`, which has no replica: decide it now
        (as many replicas as they need at once)."""
        scaler = self.autoscalers.get(model)
        if scaler is None or scaler.desired:
            return None
        before = scaler.desired
        self.touched.add(model)
        decision = scaler.decide(ModelLoad(held=held, last_request_at=now), now)
        if decision.desired == before:
            return None
        change = self.changes[model] = Change(model, before, decision.desired, decision)
        return change

    def resume(
        self,
        model: str,
        desired: int,
        changed_at: float,
        idle_since: float,
        window: Iterable[tuple[float, int]] = (),
        last_change: Change | None = None,
    ) -> bool:
        """Start `model`'s autoscaler where another control plane left it (its count
        within the current bounds, its windows going on); False when the model is not
        autoscaled in this catalog."""
        spec = self.specs.get(model)
        if spec is None:
            return False
        self.autoscalers[model] = Autoscaler.resume(spec, desired, changed_at, window)
        self.started[model] = idle_since
        if last_change is not None:
            self.changes[model] = last_change
        self.touched.add(model)
        return True

    def view(self, model: str) -> ScaleView | None:
        spec = self.specs.get(model)
        if spec is None:
            return None
        scaler = self.autoscalers.get(model)
        last = None if scaler is None else scaler.last
        now = None if last is None else f"{last.reason}: {last.detail}"
        change = self.changes.get(model)
        said = None
        if change is not None:
            d = change.decision
            said = f"{change.before} -> {change.after} ({d.reason}: {d.detail})"
        return ScaleView(spec.min, spec.max, describe_target(spec), now, said)
