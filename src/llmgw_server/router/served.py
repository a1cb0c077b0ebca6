"""The models a router serves: each one's balancer over its replicas, the engines'
connection pools, the adapters served under their own names, and the meters of the
models whose requests are held while none of their replicas serves.

This is what the route feed writes (route_feed.follower.RouteTarget: the control
plane's table), what a reload of the config changes (static models), what health
probes mark, and what the request path reads. One instance a router process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import trio

from llmgw_core.autoscaling import RouterLoad
from llmgw_core.catalog import Endpoint
from llmgw_core.config import Config
from llmgw_core.tomlshape import did_you_mean
from llmgw_core.traffic import MODEL_ROW, Sample
from llmgw_server.reload import ReloadPlan
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.meter import ModelMeter
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.model_cards import plain_card
from llmgw_server.router.policies import section_for, spec_of
from llmgw_server.router.stored import Holder, model_tag
from llmgw_server.router.traffic_meter import TrafficMeter
from llmgw_server.router.upstream import Pool


class ServedModels:
    def __init__(
        self, config: Config, metrics: RouterMetrics, traffic: TrafficMeter, shared: object
    ) -> None:
        self.config = config
        self.tuning = config.router
        self.metrics = metrics
        self.traffic = traffic  # by model and replica, for the fleet page
        # The policy's per-process state, every model's (precise: what each engine
        # holds, by its own KV-cache events); None where it declares none.
        self.shared = shared
        self.section = section_for(spec_of(self.tuning.balancing), self.tuning)
        self.pools: dict[Endpoint, Pool] = {}
        self.balancers: dict[str, Balancer] = {}
        # Each model's description from its engines (health.py reads them): /v1/models.
        self.cards: dict[str, dict[str, object]] = {}
        # LoRA adapter -> the model whose replicas serve it under its name (route feed).
        self.adapters: dict[str, str] = {}
        # Each autoscaled model's meter and held requests (route feed; router.meter).
        self.meters: dict[str, ModelMeter] = {}
        self._autoscaled: frozenset[str] = frozenset()  # the route feed's
        self._start_hold: frozenset[str] = frozenset()  # see hold_at_start
        self._load_wanted = trio.Event()  # set when a request is held: report at once
        # A request was held since the last load report: one held while no one waited
        # (the feed between two reports, or between two control planes) is not missed.
        self._held_unreported = False
        for model in config.catalog.models:
            self.set_endpoints(model.name, model.endpoints)

    def reload(self, config: Config, plan: ReloadPlan) -> None:
        """The static models a reload added, changed or removed."""
        self.config = config
        for name, endpoints in {**plan.models_added, **plan.models_changed}.items():
            self.set_endpoints(name, endpoints)
        for name in plan.models_removed:
            self.set_endpoints(name, ())
            del self.balancers[name]
            self.cards.pop(name, None)

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint]) -> None:
        """The replicas of a model: static from the catalog, or the control plane's ready shards."""
        balancer = self.balancers.get(model)
        if balancer is None:
            balancer = self.balancers[model] = Balancer(
                [],
                eject_after_failures=self.tuning.eject_after_failures,
                eject_cooldown_s=self.tuning.eject_cooldown_s,
                balancing=self.tuning.balancing,
                tuning=self.section,
                shared=self.shared,
            )
        for endpoint in endpoints:
            if endpoint not in self.pools:
                self.pools[endpoint] = Pool(
                    endpoint,
                    self.tuning.connect_timeout_s,
                    self.tuning.read_idle_timeout_s,
                    self.tuning.upstream_idle_s,
                )
        removed = balancer.set_endpoints(endpoints)
        if removed and model not in self.static_models():
            # The control plane took it out without a drain: its node was lost, or its
            # engine failed. Streams still read from it are cut, to go on elsewhere.
            for replica in removed:
                pool = self.pools.get(replica.endpoint)
                if not replica.draining and pool is not None:
                    replica.lost = True
                    pool.cut()
        meter = self.meters.get(model)
        if meter is not None and endpoints:
            meter.may_serve()
        in_use = {r.endpoint for b in self.balancers.values() for r in b.replicas}
        for endpoint in [e for e in self.pools if e not in in_use]:
            self.pools.pop(endpoint).close()

    def base_of(self, model: str) -> str:
        """The model whose replicas serve `model` (itself, or an adapter's); "": none."""
        return model if model in self.balancers else self.adapters.get(model, "")

    # -- what the route feed needs (route_feed.follower.RouteTarget) --

    def forget_model(self, model: str) -> None:
        """A model gone from the route table (a reload removed it, and its drain ended):
        a request naming it gets 404, not 503 "no healthy replica" for good."""
        self.set_endpoints(model, ())  # its engines' pools closed, unless shared
        self.balancers.pop(model, None)

    def static_models(self) -> frozenset[str]:
        return frozenset(m.name for m in self.config.catalog.models if m.profile is None)

    def set_draining(self, draining: frozenset[Endpoint], *, skip: frozenset[str]) -> None:
        for model, balancer in self.balancers.items():
            if model not in skip:
                balancer.mark_draining(draining)

    def set_adapters(self, adapters: Mapping[str, str]) -> None:
        self.adapters = dict(adapters)

    def set_autoscaled(self, models: frozenset[str]) -> None:
        """Meter these models for the autoscaler, and hold their requests while none of
        their replicas serves; a model no longer autoscaled releases what it held."""
        self._autoscaled = models
        for model in [m for m in self.meters if m not in models and m not in self._start_hold]:
            self.meters.pop(model).may_serve()
        for model in models:
            if model not in self.meters:
                self.meters[model] = ModelMeter()

    def load_report(self) -> dict[str, RouterLoad]:
        """Each autoscaled model's load since the last report (route_feed.messages.Load)."""
        now = trio.current_time()
        self._held_unreported = False
        report = {}
        for model, meter in self.meters.items():
            if model not in self._autoscaled:
                continue  # held at start alone (hold_at_start): not the autoscaler's
            balancer = self.balancers.get(model)
            readings = [
                r.engine_load.kv_usage
                for r in (balancer.replicas if balancer else ())
                if r.engine_load is not None and r.engine_load.kv_usage is not None
            ]
            kv = sum(readings) / len(readings) if readings else None
            in_flight = self.metrics.in_flight
            sent = in_flight[model] + sum(
                in_flight[a] for a, m in self.adapters.items() if m == model
            )
            report[model] = meter.report(now, sent, kv)
        return report

    def traffic_report(self) -> tuple[Sample, ...]:
        """What it answered since the last report, by model and replica (messages.Traffic)."""
        in_flight: dict[tuple[str, str], int] = {}
        for model, n in self.metrics.in_flight.items():
            if n:
                key = (self.adapters.get(model, model), MODEL_ROW)
                in_flight[key] = in_flight.get(key, 0) + n
        for model, balancer in self.balancers.items():
            for replica in balancer.replicas:
                if replica.outstanding:
                    in_flight[(model, replica.endpoint.url)] = replica.outstanding
        return self.traffic.report(in_flight)

    def hold_at_start(self) -> None:
        """Just started (a restart): the control plane has not heard from its agents yet,
        so hold each placed model's requests as for a model at zero (same budgets and
        hold_timeout_s) until its replicas are back, rather than answer 503 "no healthy
        replica"; `end_start_hold` ends this (the wiring, after STARTUP_HOLD_S)."""
        self._start_hold = frozenset(
            m.name for m in self.config.catalog.models if m.profile is not None
        )
        for model in self._start_hold:
            self.meters.setdefault(model, ModelMeter())

    def end_start_hold(self) -> None:
        """What is still held for a model that is not autoscaled is answered now."""
        for model in self._start_hold - self._autoscaled:
            meter = self.meters.pop(model, None)
            if meter is not None:
                meter.may_serve()
        self._start_hold = frozenset()

    def table_refused(self, reason: str) -> None:
        """The route feed refused a table (route_feed.follower): counted on /metrics."""
        self.metrics.tables_refused[reason] += 1

    def load_wanted(self) -> None:
        """A request is held: the control plane should hear the load at once."""
        self._held_unreported = True
        self._load_wanted.set()
        self._load_wanted = trio.Event()

    async def wait_load_wanted(self) -> None:
        """Until a request is held (the control plane should hear of it at once): at once
        when one was held since the last `load_report`."""
        if not self._held_unreported:
            await self._load_wanted.wait()

    def held_bytes(self) -> int:
        """The bodies this process holds, all models."""
        return sum(m.held_bytes for m in self.meters.values())

    def in_flight(self, endpoints: frozenset[Endpoint]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for balancer in self.balancers.values():
            for replica in balancer.replicas:
                if replica.endpoint in endpoints:
                    url = replica.endpoint.url
                    counts[url] = counts.get(url, 0) + replica.outstanding
        return counts

    def endpoints(self) -> set[Endpoint]:
        """Every replica's endpoint, all models."""
        return {r.endpoint for b in self.balancers.values() for r in b.replicas}

    def replica(self, model: str, endpoint: Endpoint) -> Replica | None:
        balancer = self.balancers.get(model)
        for replica in balancer.replicas if balancer else ():
            if replica.endpoint == endpoint:
                return replica
        return None

    # -- what clients are told of the models --

    def listing(self, allowed: frozenset[str] | None) -> bytes:
        """/v1/models: the models (and adapters) this key may use that serve, or wake."""
        # An autoscaled model scaled to zero is listed: a request for it wakes it.
        meters = self.meters
        data = [
            self.cards.get(name) or plain_card(name)
            for name, balancer in self.balancers.items()
            if (balancer.healthy_count or name in meters) and (allowed is None or name in allowed)
        ]
        # An adapter while its model is listed, as vLLM lists one: its parent, and its
        # name as its root (its path is the node's business).
        for name, base in self.adapters.items():
            balancer = self.balancers.get(base)
            listed = balancer is not None and (balancer.healthy_count > 0 or base in meters)
            if listed and name not in self.balancers and (allowed is None or name in allowed):
                owner = (self.cards.get(base) or plain_card(base))["owned_by"]
                data.append({**plain_card(name), "owned_by": owner, "root": name, "parent": base})
        return json.dumps({"object": "list", "data": data}).encode()

    def hint(self, model: str, allowed: frozenset[str] | None) -> str:
        """A "did you mean" among the models (adapters included) that this key may use and
        the router serves, never one it may not: only on the way to a 403 or 404."""
        balancers = self.balancers
        names = [*balancers, *(a for a, base in self.adapters.items() if base in balancers)]
        return did_you_mean(model, names if allowed is None else set(names) & allowed)

    def healthy_counts(self) -> dict[str, int]:
        return {name: b.healthy_count for name, b in self.balancers.items()}

    def holding(
        self, holder: Holder, allowed: frozenset[str] | None
    ) -> tuple[str, Balancer, Replica] | None:
        """The replica `holder` names, of a model (or an adapter: its base's replicas)
        the key may use."""
        served = [*self.balancers.items()]
        served += [(name, self.balancers[base]) for name, base in self.adapters.items()
                   if base in self.balancers]  # fmt: skip
        for model, balancer in served:
            if allowed is None or model in allowed:
                replica = holder_replica(model, balancer, holder)
                if replica is not None:
                    return model, balancer, replica
        return None


def holder_replica(model: str, balancer: Balancer, holder: Holder) -> Replica | None:
    """The model's replica that `holder` names, available or not: only it holds the
    response, and what it answers (or its failure) is the truth."""
    if holder.model_tag != model_tag(model):
        return None
    for replica in balancer.replicas:
        if replica.rid == holder.rid:
            return replica
    return None
