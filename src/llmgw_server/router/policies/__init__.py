"""Balancing policies, one module each, each owning its state (see policy.Policy).

`[router] balancing` names one (`Balancing`, a closed set); `policy_for` is the one place
that maps a name to its policy. A new policy is a new module here, its name added to
`Balancing` and a case below.
"""

from __future__ import annotations

import random
from typing import assert_never

from llmgw_core.config import Balancing, CacheAwareSection
from llmgw_server.router.kv_index import KvIndex
from llmgw_server.router.policies.cache_aware import CacheAware
from llmgw_server.router.policies.least_outstanding import LeastOutstanding
from llmgw_server.router.policies.policy import Choice, Decision, Policy
from llmgw_server.router.policies.precise import Precise
from llmgw_server.router.policies.round_robin import RoundRobin

__all__ = ["Choice", "Decision", "Policy", "policy_for"]


def policy_for(
    name: Balancing, tuning: CacheAwareSection, rng: random.Random, kv: KvIndex | None = None
) -> Policy:
    """A fresh policy for one model's replicas; `kv`: the process's index of what the
    engines hold (precise reads it)."""
    match name:
        case "cache_aware":
            return CacheAware(tuning)
        case "precise":
            return Precise(tuning, kv if kv is not None else KvIndex())
        case "least_outstanding":
            return LeastOutstanding(rng)
        case "round_robin":
            return RoundRobin()
        case _:
            assert_never(name)
