"""Balancing policies as plugins: one per `[router] balancing` name, each owning its state."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import attrs
import pytest

import llmgw_server
from llmgw_core.catalog import Endpoint
from llmgw_core.config import CacheAwareSection
from llmgw_core.kv_events import BlockStored, KvBatch
from llmgw_server.router.balancer import Balancer, Replica
from llmgw_server.router.kv_index import KvIndex
from llmgw_server.router.policies import Decision, policy_for, registered
from llmgw_server.router.policies.cache_aware import FALLBACK, CacheAware
from llmgw_server.router.policies.least_outstanding import LEAST_OUTSTANDING
from llmgw_server.router.policies.precise import (
    PRECISE_HIT,
    PRECISE_LOAD_OVERRIDE,
    PRECISE_MISS,
    PRECISE_SPREAD,
    Precise,
)
from llmgw_server.router.policies.round_robin import ROUND_ROBIN
from llmgw_server.router.prefix import PromptKey, prompt_key


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint("127.0.0.1", 9000 + i) for i in range(n)]


def prompt(text: str, system: str | None = None) -> PromptKey:
    opening = [] if system is None else [{"role": "system", "content": system}]
    key = prompt_key({"messages": [*opening, {"role": "user", "content": text}]}, True, 256)
    assert key is not None
    return key


# What each name's policy decides with no prompt and equal loads, and what it reads.
EXPECTED: dict[str, tuple[Decision, bool]] = {
    "cache_aware": (FALLBACK, True),
    "precise": (FALLBACK, True),  # no token ids, no events: cache_aware's choice
    "least_outstanding": (LEAST_OUTSTANDING, False),
    "round_robin": (ROUND_ROBIN, False),
}


BALANCING = tuple(registered())  # every policy module of the package


@pytest.mark.parametrize("name", BALANCING)
def test_every_balancing_name_has_its_own_policy(name: str) -> None:
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


def _stored(index: KvIndex, replica: Replica, tokens: list[int], seq: int) -> None:
    blocks = len(tokens) // 4
    event = BlockStored(tuple(range(100 * seq, 100 * seq + blocks)), None, tokens, 4)
    index.apply(replica.endpoint.url, KvBatch("kv", seq, 0.0, None, (event,)), 0.0)


def test_precise_follows_the_engines_events_within_the_load_bound() -> None:
    index = KvIndex()
    balancer = Balancer([Replica(e) for e in endpoints(3)], balancing="precise", shared=index)
    policy = balancer.policy
    assert isinstance(policy, Precise) and not policy.wants_tokens(balancer.replicas)
    a, b, c = balancer.replicas
    tokens = list(range(1, 33))  # 8 blocks of 4
    key = attrs.evolve(prompt("the conversation"), tokens=tuple(tokens))
    # No engine has published yet: cache_aware decides, as cache_aware.
    assert balancer.choose(now=0.0, prompt=key).decision is FALLBACK  # type: ignore[union-attr]
    _stored(index, a, tokens[:16], 0)  # a holds 4 blocks
    _stored(index, b, tokens[:28], 0)  # b holds 7
    _stored(index, c, [99] * 8, 0)  # c holds something else
    assert policy.wants_tokens(balancer.replicas)  # their engines publish: tokenize
    choice = policy.choose(balancer.replicas, key, 0.0)
    assert (choice.replica, choice.decision) == (b, PRECISE_HIT)
    assert choice.matched_bytes == key.size * 28 // 32  # 7 of its 8 blocks, in its bytes
    assert choice.matched_tokens == 28
    # b loaded past the bound (least + load_slack): the holder within it that holds most.
    b.outstanding = 10
    choice = policy.choose(balancer.replicas, key, 0.0)
    assert (choice.replica, choice.decision) == (a, PRECISE_LOAD_OVERRIDE)
    b.outstanding = 0
    # A prompt no engine holds a block of: placed as cache_aware would, counted as a miss.
    other = attrs.evolve(prompt("another one"), tokens=tuple(range(500, 540)))
    assert policy.choose(balancer.replicas, other, 0.0).decision is PRECISE_MISS
    # ... by load: never the busy replica, whatever this router sent there before.
    b.outstanding = 10
    for text in ("x", "y", "z", "w"):
        miss = attrs.evolve(prompt(text), tokens=tuple(range(600, 640)))
        assert policy.choose(balancer.replicas, miss, 0.0).replica is not b
    b.outstanding = 0
    # Chosen: held there speculatively until its events come (2 s).
    policy.chosen(c, other, 10.0)
    assert policy.choose(balancer.replicas, other, 11.0).replica is c
    assert policy.choose(balancer.replicas, other, 12.5).decision is PRECISE_MISS
    # Without token ids (the engine could not tokenize): cache_aware decides.
    assert policy.choose(balancer.replicas, prompt("x"), 0.0).decision is not PRECISE_HIT
    # The whole prompt held: the engine still computes its last token (one block less).
    _stored(index, c, tokens, 1)
    c.outstanding = -5  # the least loaded
    assert policy.choose(balancer.replicas, key, 0.0).matched_tokens == 28
    c.outstanding = 0


def test_precise_lets_a_holder_carry_more_load_the_more_of_the_prompt_it_holds() -> None:
    """Past the load bound a holder keeps the request by its held tokens /
    `held_tokens_per_load`: sending it elsewhere would prefill them all again."""
    index = KvIndex()
    tuning = CacheAwareSection(held_tokens_per_load=4.0)  # a block of 4 tokens: 1 load
    replicas = [Replica(e) for e in endpoints(3)]
    policy = Precise(tuning, index)
    policy.follow(replicas)
    a, b, c = replicas
    tokens = list(range(1, 33))
    key = attrs.evolve(prompt("the conversation"), tokens=tuple(tokens))
    _stored(index, a, tokens[:8], 0)  # a holds 2 blocks: 8 more than the bound
    _stored(index, b, tokens[:28], 0)  # b holds 7: 28 more
    _stored(index, c, [99] * 8, 0)
    for load, chosen, decision in [
        (8, b, PRECISE_HIT),  # the bound: least (0) + load_slack (8)
        (8 + 7, b, PRECISE_HIT),  # ... and its 7 blocks
        (8 + 8, a, PRECISE_LOAD_OVERRIDE),  # past them: the next holder
    ]:
        b.outstanding = load
        choice = policy.choose(replicas, key, 0.0)
        assert (choice.replica, choice.decision) == (chosen, decision), load
    # a carries its 2 blocks past the bound too, then the least loaded non-holder takes it.
    a.outstanding = 8 + 2
    assert policy.choose(replicas, key, 0.0).replica is a
    a.outstanding = 8 + 3
    assert policy.choose(replicas, key, 0.0).replica is c


def test_precise_spreads_a_hot_prefix_requested_one_at_a_time() -> None:
    """Nothing loads the holder of a prefix requested one at a time; its share of the
    requests does, and past `max_share` times the even share the next replica takes it
    (and caches it): the issue's hot-prefix bound, 1.5x the even share at most."""
    index = KvIndex()
    balancer = Balancer([Replica(e) for e in endpoints(8)], balancing="precise", shared=index)
    policy = balancer.policy
    assert isinstance(policy, Precise)
    system = list(range(1, 401))  # the shared system prompt: 100 blocks of 4
    for r in balancer.replicas:
        _stored(index, r, [7, 7, 7, 7], 0)  # every engine publishes: all fed
    counts: dict[Replica, int] = {r: 0 for r in balancer.replicas}
    decisions: list[Decision] = []
    for i in range(48):
        tokens = (*system, 1000 + i, 2000 + i, 3000 + i, 4000 + i)
        key = attrs.evolve(prompt(f"question {i}", "the system prompt"), tokens=tokens)
        now = 0.01 * i  # within the speculation's 2 s: what was sent counts as held
        choice = policy.choose(balancer.replicas, key, now)
        policy.chosen(choice.replica, key, now)
        counts[choice.replica] += 1
        decisions.append(choice.decision)
    assert max(counts.values()) <= 1.5 * 48 / 8, counts
    assert min(counts.values()) >= 1, counts  # every replica took it
    # Once a replica took it, it holds it: only the first request missed; seven spread it.
    assert decisions.count(PRECISE_MISS) == 1, decisions
    assert decisions.count(PRECISE_SPREAD) == 7, decisions


def test_precise_keeps_a_prefix_only_some_requests_share_where_it_is() -> None:
    """Eight groups, each with its own prefix, requested in turn: each group stays on the
    replica its first request went to (no share is past the bound), so that every
    replica caches one group's prefix, not all of them."""
    index = KvIndex()
    balancer = Balancer([Replica(e) for e in endpoints(8)], balancing="precise", shared=index)
    policy = balancer.policy
    assert isinstance(policy, Precise)
    for r in balancer.replicas:
        _stored(index, r, [7, 7, 7, 7], 0)
    homes: dict[int, set[Replica]] = {}
    for i in range(160):
        group = i % 8
        tokens = (*range(10_000 * (group + 1), 10_000 * (group + 1) + 400), 5, 6, 7, i)
        key = attrs.evolve(prompt(f"question {i}", f"group {group}'s prompt"), tokens=tokens)
        choice = policy.choose(balancer.replicas, key, 0.01 * i)
        policy.chosen(choice.replica, key, 0.01 * i)
        homes.setdefault(group, set()).add(choice.replica)
    assert all(len(replicas) == 1 for replicas in homes.values()), homes


def test_only_precise_names_its_index_its_feed_and_its_tokenizer() -> None:
    """No module but policies/precise.py imports router.kv_index, kv_feed or tokenizer
    (which import each other): the router and the wiring serve what precise declares it
    needs (its Needs), as they would any policy's."""
    theirs = {f"llmgw_server.router.{m}" for m in ("kv_index", "kv_feed", "tokenizer")}
    src = Path(llmgw_server.__file__).parent.parent
    importers = set()
    for path in src.rglob("*.py"):
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                named = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                named = {a.name for a in node.names}
            else:
                continue
            if named & theirs:
                importers.add(module)
    assert importers - theirs == {"llmgw_server.router.policies.precise"}
