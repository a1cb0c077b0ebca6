"""Balancing policies as plugins: one per `[router] balancing` name, each owning its state."""

from __future__ import annotations

import random

import pytest

from llmgw_core.catalog import Endpoint
from llmgw_core.config import BALANCING, Balancing, CacheAwareSection
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.policies import Decision, policy_for
from llmgw_server.router.policies.cache_aware import CacheAware
from llmgw_server.router.prefix import PromptKey, prompt_key


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint("127.0.0.1", 9000 + i) for i in range(n)]


def prompt(text: str) -> PromptKey:
    key = prompt_key({"messages": [{"role": "user", "content": text}]}, True, 256)
    assert key is not None
    return key


# What each name's policy decides with no prompt and equal loads, and what it reads.
EXPECTED: dict[str, tuple[Decision, bool]] = {
    "cache_aware": (Decision.FALLBACK, True),
    "least_outstanding": (Decision.LEAST_OUTSTANDING, False),
    "round_robin": (Decision.ROUND_ROBIN, False),
}


@pytest.mark.parametrize("name", BALANCING)
def test_every_balancing_name_has_its_own_policy(name: Balancing) -> None:
    decision, reads = EXPECTED[name]
    policy = policy_for(name, CacheAwareSection(), random.Random(0))
    assert (policy.reads_prompt, policy.reads_engine_load) == (reads, reads)
    balancer = Balancer([Replica(e) for e in endpoints(2)], balancing=name)
    choice = balancer.choose(now=0.0)
    assert choice is not None and choice.decision is decision
    # Two balancers never share a policy: each model's state is its own.
    assert Balancer([], balancing=name).policy is not balancer.policy


def test_every_name_is_mapped_and_nothing_else() -> None:
    assert sorted(EXPECTED) == sorted(BALANCING)


def test_round_robin_takes_each_available_replica_in_turn() -> None:
    balancer = Balancer([Replica(e) for e in endpoints(4)], balancing="round_robin")
    rs = balancer.replicas
    balancer.mark_draining({rs[2].endpoint})
    picks = [balancer.pick() for _ in range(6)]
    assert picks == [rs[1], rs[3], rs[0], rs[1], rs[3], rs[0]]


def test_cache_aware_state_lives_in_the_policy_and_follows_the_replica_set() -> None:
    balancer = Balancer([Replica(e) for e in endpoints(3)], balancing="cache_aware")
    policy = balancer.policy
    assert isinstance(policy, CacheAware)
    assert not hasattr(balancer.replicas[0], "prefixes")  # nothing of it rides on Replica
    assert not hasattr(balancer.replicas[0], "share")
    assert [policy.remembered(r) for r in balancer.replicas] == [0, 0, 0]
    home = balancer.pick(prompt=prompt("hello " * 100), now=0.0)
    assert home is not None and (policy.remembered(home) or 0) > 0
    others = [r for r in balancer.replicas if r is not home]
    assert [policy.remembered(r) for r in others] == [0, 0]
    # The replica goes from the model: so does what the policy held for it.
    removed = balancer.set_endpoints([r.endpoint for r in others])
    assert removed == [home] and policy.remembered(home) is None
    # Back as a new replica: it starts empty, and the others keep theirs.
    balancer.set_endpoints([home.endpoint, *(r.endpoint for r in others)])
    back = balancer.replicas[0]
    assert back is not home and policy.remembered(back) == 0


def test_the_policy_forgets_a_replica_that_failed_not_one_that_answered_busy() -> None:
    balancer = Balancer(
        [Replica(e) for e in endpoints(1)], balancing="cache_aware", eject_after_failures=1
    )
    policy = balancer.policy
    (only,) = balancer.replicas
    balancer.pick(prompt=prompt("hello " * 100), now=0.0)
    held = policy.remembered(only)
    assert held
    balancer.busy(only, 5.0, now=1.0)
    assert policy.remembered(only) == held
    assert balancer.failed(only, now=2.0)
    assert policy.remembered(only) == 0


def test_outstanding_is_counted_by_the_balancer() -> None:
    balancer = Balancer([Replica(e) for e in endpoints(2)])
    a, b = balancer.replicas
    balancer.sent(a)
    balancer.sent(a)
    balancer.sent(b)
    balancer.finished(a)
    assert (a.outstanding, b.outstanding) == (1, 1)
    balancer.sent(b)
    assert balancer.pick() is a  # least outstanding reads what the balancer counted
