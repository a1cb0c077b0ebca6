"""Placing missing replicas, and what is known of the models placement falls short on.

Placement over the whole fleet is O(nodes). A model it fell short on is tried again
only on the nodes that may hold more since (`grown`: registered, back, uncordoned or
with GPUs freed): the same answer, since a node that held no replica of a profile then
holds none now unless it changed. A replica that spans nodes may pair a grown node
with unchanged ones of its fabric domain: for such a model the grown nodes' domains
are tried. (docs/control-plane.md, "How the control core decides": the costs and the
tests that count them.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from llmgw_core.catalog import ModelEntry, Profile
from llmgw_core.control_config import ControlSection
from llmgw_server.control.placement import Assignment, NodeCapacity, PlacementRequest, place
from llmgw_server.control.work import Work


class Shortfall:
    def __init__(self, settings: ControlSection, started_at: float, work: Work) -> None:
        self.settings = settings
        self.settle_until = started_at + settings.settle_after_start_s
        self.work = work
        # Model -> replicas wanted but not placed, and why placement waits (None when it
        # tried and nothing fits): what views show.
        self.short: dict[str, tuple[int, str | None]] = {}
        self.grown: set[str] = set()  # nodes that may hold more since the last attempt
        # The models the last attempt fell short on, with the profile it tried: no node
        # outside `grown` can take one more.
        self._tried: dict[str, Profile] = {}
        # The settle time's start and end go to the log once each: what is to say next.
        self._settle_said: Literal["start", "end", "said"] = (
            "start" if settings.settle_after_start_s > 0 else "said"
        )

    def settle_notes(self, now: float) -> list[str]:
        """One line when the first step sees the settle time, one when it has passed."""
        settle_s, settle_until = self.settings.settle_after_start_s, self.settle_until
        if self._settle_said == "start" and now < settle_until:
            self._settle_said = "end"
            return [
                f"no new replica is placed for {settle_until - now:g} s after the start "
                f"(settle_after_start_s = {settle_s:g}), so that re-registering agents get "
                "their engines adopted"
            ]
        if self._settle_said != "said" and now >= settle_until:
            self._settle_said = "said"
            return [f"settle time of {settle_s:g} s over: missing replicas are placed from now on"]
        return []

    def end_settle(self, now: float) -> bool:
        """What runs is known (every node a store named has registered: control.persisted),
        so the settle time ends now; False when it was over already."""
        if now >= self.settle_until:
            return False
        self.settle_until = now
        self._settle_said = "said"  # the caller says why it ended
        return True

    def place(
        self,
        missing: Mapping[str, int],
        wanted: Mapping[str, ModelEntry],
        now: float,
        capacities: Callable[[Iterable[str] | None], list[NodeCapacity]],
        domain_mates: Callable[[set[str]], set[str]],
    ) -> tuple[list[Assignment], float | None]:
        """Place the `missing` replicas of each model; returns the assignments (`key`
        is "model#i") and, during the settle time after the start, when it ends.
        `capacities(names)` gives those nodes' capacity, every node's for None;
        `domain_mates(names)` the nodes in their fabric domains."""
        missing = {name: n for name, n in missing.items() if n > 0}
        if missing and now < self.settle_until:
            waiting = (
                f"placement waits {self.settle_until - now:g} s more after the control plane's "
                "start, so that re-registering agents get their engines adopted"
            )
            self.short = {name: (n, waiting) for name, n in missing.items()}
            return [], self.settle_until
        if not missing:
            self.short, self._tried = {}, {}
            self.grown.clear()
            return [], None
        profiles = {name: wanted[name].profile for name in missing}
        retried = all(p is not None and self._tried.get(name) == p for name, p in profiles.items())
        if retried and not self.grown:
            self.short = {name: (n, None) for name, n in missing.items()}
            return [], None  # nothing that could help has changed since it fell short
        names = None
        if retried:
            spans = any(p is not None and p.pipeline_parallel > 1 for p in profiles.values())
            names = sorted(domain_mates(self.grown) if spans else self.grown)
        nodes = capacities(names)
        self.work.nodes += len(nodes)
        self.grown.clear()
        requests = []
        for name, n in missing.items():
            profile = profiles[name]
            assert profile is not None
            requests += [PlacementRequest(f"{name}#{i}", name, profile) for i in range(n)]
        result = place(
            requests,
            nodes,
            fabric_key=self.settings.fabric_key,
            spread=self.settings.spread,
            explain_unplaced=False,  # explanations are made when someone reads them
        )
        self.short = {}
        for request in result.unplaced:
            count, _ = self.short.get(request.model, (0, None))
            self.short[request.model] = (count + 1, None)
        self._tried = {}
        for name in self.short:
            profile = profiles[name]
            assert profile is not None
            self._tried[name] = profile
        return list(result.assignments), None
