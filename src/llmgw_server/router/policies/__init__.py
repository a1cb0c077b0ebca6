"""Balancing policies, one module each, each owning its state (see policy.Policy).

A policy is one module of this package that declares, at module level, `POLICY =
PolicySpec(...)` (policy.py): its name (`[router] balancing`), its config section (its
own attrs class, the table `[router.<key>]`), its decisions (their labels and help on
/metrics), what it needs from the router (policy.Needs) and how one is built. Every
such module is found here (`registered`, by pkgutil over the package's `__path__`):
adding a policy adds its module and its tests, nothing else.

`PolicyBook` is what the server reads its config with (`load_config(...,
policies=PolicyBook())`): the name `[router] balancing` gives, and each policy's
section; llmgw_core knows no policy.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
from collections.abc import Mapping
from typing import Any

import attrs

from llmgw_core.config import RouterSection
from llmgw_core.config_schema import read_table
from llmgw_core.tomlshape import Table, did_you_mean
from llmgw_server.router.policies.policy import (
    ROUTER_DECISIONS,
    Choice,
    Decision,
    Given,
    Needs,
    Policy,
    PolicySpec,
)

__all__ = [
    "Choice",
    "Decision",
    "Given",
    "Needs",
    "Policy",
    "PolicyBook",
    "PolicySpec",
    "policy_for",
    "registered",
    "section_for",
    "spec_of",
]


def registered() -> dict[str, PolicySpec]:
    """Every policy, by name: the modules of this package (each `__path__` entry's) that
    declare a module-level `POLICY`, in the order of their names. Found anew each call
    (a router's start, a config's reading, a /metrics page): no request asks."""
    found: dict[str, PolicySpec] = {}
    modules = sorted({m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg})
    for module in modules:
        spec = getattr(importlib.import_module(f"{__name__}.{module}"), "POLICY", None)
        if not isinstance(spec, PolicySpec):
            continue
        if spec.name in found:
            raise ValueError(f"two policies named {spec.name!r}: policies.{module} and another")
        found[spec.name] = spec
    return dict(sorted(found.items()))


def spec_of(name: str) -> PolicySpec:
    """The policy named `name`; ValueError, with the names known, for another."""
    specs = registered()
    spec = specs.get(name)
    if spec is None:
        raise ValueError(_not_one_of(name, specs))
    return spec


def _not_one_of(name: str, specs: Mapping[str, PolicySpec]) -> str:
    return f"must be one of {', '.join(specs)}, not {name!r}{did_you_mean(name, specs)}"


def section_for(spec: PolicySpec, router: RouterSection) -> Any:
    """The policy's config section as `router` holds it: read by `PolicyBook`, or the
    RouterSection field of that name ([router.cache_aware]), or its defaults."""
    key = spec.table
    if key is None or spec.section is None:
        return None
    read = dict(router.policy_sections).get(key)
    if read is None and key in attrs.fields_dict(RouterSection):
        read = getattr(router, key)
    return spec.section() if read is None else read


def policy_for(name: str, section: Any, rng: random.Random, shared: Any = None) -> Policy:
    """A fresh policy for one model's replicas; `section`: its config section (None: its
    defaults); `shared`: its per-process state (None: a fresh one, where it needs one)."""
    spec = spec_of(name)
    if section is None and spec.section is not None:
        section = spec.section()
    if shared is None and spec.needs.shared is not None:
        shared = spec.needs.shared()
    return spec.build(Given(section, rng, shared))


def decisions_help() -> str:
    """The help of llmgw_balancing_decisions_total: every policy's decisions."""
    parts = [", ".join(f"{d.value} ({d.help})" for d in ROUTER_DECISIONS)]
    for name, spec in registered().items():
        if spec.decisions:
            own = ", ".join(f"{d.value} ({d.help})" for d in spec.decisions)
            parts.append(f"{name}: {own}")
    return "Replica choices by kind: " + "; ".join(parts) + "."


class PolicyBook:
    """How the server reads `[router]`'s policy part (llmgw_core.config.parse_config's
    `policies`): the name `balancing` gives must be a policy's, with a "did you mean";
    each policy's own table is read into its section class by the config's converter
    (`read_table`), an absent one as its defaults. A table that RouterSection reads
    itself ([router.cache_aware]) is taken from there."""

    def tables(self) -> frozenset[str]:
        """The tables under `[router]` that policies read, RouterSection's own aside."""
        own = attrs.fields_dict(RouterSection)
        keys = (s.table for s in registered().values())
        return frozenset(k for k in keys if k is not None and k not in own)

    def read(self, table: Table, router: RouterSection) -> RouterSection:
        specs = registered()
        if router.balancing not in specs:
            table.fail("balancing", _not_one_of(router.balancing, specs))
        own = attrs.fields_dict(RouterSection)
        sections: dict[str, object] = {}
        for spec in specs.values():
            key = spec.table
            if key is None or spec.section is None or key in own or key in sections:
                continue
            if table.has(key):
                sections[key] = read_table(table.table(key), spec.section)
            else:
                sections[key] = spec.section()
        return attrs.evolve(router, policy_sections=tuple(sorted(sections.items())))

    def __reduce__(self) -> tuple[type[PolicyBook], tuple[()]]:
        # Pickled with the config to a worker: found anew there.
        return (PolicyBook, ())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyBook)

    def __hash__(self) -> int:
        return hash(PolicyBook)
