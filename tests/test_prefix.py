"""Prompt keys and the per-replica prefix index: pure, no I/O."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hypothesis_profiles import profile_times
from llmgw_server.router.prefix import MAX_BLOCKS, PrefixIndex, PromptKey, prompt_key, stable_hash

BLOCK = 64


def chat(*messages: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content} for role, content in messages]}


def key_of(body: dict[str, Any], chat_api: bool = True) -> PromptKey:
    key = prompt_key(body, chat_api, BLOCK)
    assert key is not None
    return key


def turns() -> list[dict[str, Any]]:
    system = ("system", "You are terse. " * 20)
    first = ("user", "Here is my long document: " + "lorem ipsum " * 50)
    bodies = [chat(system, first)]
    history = [system, first]
    for i in range(4):
        history += [("assistant", f"answer {i} " * 7), ("user", f"follow-up {i} " * 3)]
        bodies.append(chat(*history))
    return bodies


def test_each_turn_extends_the_last_and_keeps_the_anchor() -> None:
    keys = [key_of(body) for body in turns()]
    for before, after in itertools.pairwise(keys):
        # The previous prompt's every cut, its end included, is a cut of the next one.
        assert after.chain[: len(before.chain)] == before.chain
        assert after.ends[: len(before.ends)] == before.ends
        assert after.anchor_hash == before.anchor_hash
    system_only = key_of(chat(("system", "You are terse. " * 20)))
    assert system_only.anchor_hash != keys[0].anchor_hash  # the first user message is in it


def test_the_anchor_is_the_first_non_system_message() -> None:
    body = chat(("system", "S" * 300), ("developer", "D" * 10), ("user", "hello"), ("user", "x"))
    key = key_of(body)
    rendered = len("system\x1f" + "S" * 300 + "\x1e") + len("developer\x1f" + "D" * 10 + "\x1e")
    assert key.ends[key.anchor] == rendered + len("user\x1fhello\x1e")
    other = key_of(chat(("system", "S" * 300), ("developer", "D" * 10), ("user", "hi!")))
    assert other.anchor_hash != key.anchor_hash
    assert other.chain[:4] == key.chain[:4]  # the shared system prompt's blocks


def test_conversations_with_the_same_system_prompt_differ_in_anchor() -> None:
    a = key_of(chat(("system", "shared " * 100), ("user", "question one")))
    b = key_of(chat(("system", "shared " * 100), ("user", "question two")))
    assert a.anchor_hash != b.anchor_hash
    shared = len("system\x1f" + "shared " * 100 + "\x1e") // BLOCK
    assert a.chain[:shared] == b.chain[:shared]


def test_completion_prompts_anchor_on_their_first_blocks() -> None:
    long = key_of({"prompt": "p" * 10_000}, chat_api=False)
    assert long.ends[long.anchor] == 4 * BLOCK
    assert long.size == 10_000 and long.ends[-1] == 10_000
    short = key_of({"prompt": "p" * 100}, chat_api=False)
    assert short.ends[short.anchor] == 100 == short.size
    batch = key_of({"prompt": ["a", "b"]}, chat_api=False)
    tokens = key_of({"prompt": [1, 2, 3]}, chat_api=False)
    assert batch.size == 3 and tokens.size == len("[1,2,3]")


def test_no_text_no_key() -> None:
    assert prompt_key({"messages": []}, True, BLOCK) is None
    assert prompt_key({"prompt": ""}, False, BLOCK) is None
    assert prompt_key({}, False, BLOCK) is None


def test_only_the_first_max_blocks_are_hashed() -> None:
    key = key_of({"prompt": "x" * (BLOCK * (MAX_BLOCKS + 50))}, chat_api=False)
    assert len(key.chain) == MAX_BLOCKS and key.size == MAX_BLOCKS * BLOCK


def test_hashes_are_the_same_in_every_process() -> None:
    """Rendezvous needs the anchor's hash to agree across router processes (no PYTHONHASHSEED)."""
    code = (
        "from llmgw_server.router.prefix import prompt_key, stable_hash;"
        "k = prompt_key({'messages': [{'role': 'user', 'content': 'héllo wörld ' * 40}]}, True, 64);"
        "print(k.anchor_hash, k.chain[-1], stable_hash('http://10.0.0.1:8000'))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin"},
        ).stdout
        for seed in ("1", "2")
    }
    key = key_of({"messages": [{"role": "user", "content": "héllo wörld " * 40}]})
    here = f"{key.anchor_hash} {key.chain[-1]} {stable_hash('http://10.0.0.1:8000')}\n"
    assert outputs == {here}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(messages=json_values, tools=json_values, prompt=json_values)
def test_any_body_gives_a_key_or_none_and_never_an_error(
    messages: object, tools: object, prompt: object
) -> None:
    for body, chat_api in (
        ({"messages": messages, "tools": tools}, True),
        ({"prompt": prompt}, False),
    ):
        key = prompt_key(body, chat_api, BLOCK)
        if key is not None:
            assert key.chain and len(key.chain) == len(key.ends)
            assert list(key.ends) == sorted(set(key.ends)) and 0 <= key.anchor < len(key.chain)


def test_lone_surrogates_are_hashed() -> None:
    key = prompt_key(chat(("user", "\ud800 broken")), True, BLOCK)
    assert key is not None


def test_depth_continuation_and_repeats() -> None:
    index = PrefixIndex(capacity=1000, ttl_s=60)
    keys = [key_of(body) for body in turns()]
    index.record(keys[0], now=0)
    assert index.depth(keys[0], now=1) == len(keys[0].chain)
    assert not index.continues(keys[0], len(keys[0].chain), now=1)  # a repeat, not a next turn
    depth = index.depth(keys[1], now=1)
    assert depth == len(keys[0].chain)
    assert index.continues(keys[1], depth, now=1)
    other = key_of(chat(("system", "You are terse. " * 20), ("user", "another question")))
    shared = index.depth(other, now=1)
    assert 0 < shared < len(other.chain) and not index.continues(other, shared, now=1)
    assert index.conversations(now=1) == 1


def test_a_completion_conversation_continues_where_a_shared_header_does_not() -> None:
    index = PrefixIndex(capacity=1000, ttl_s=60)
    header = "You are a helpful assistant. " * 20  # 580 bytes: ends inside the 10th block
    first = key_of({"prompt": header + "Q: one?"}, chat_api=False)
    index.record(first, now=0)
    # The next turn carries the whole first prompt (ending mid-block) and more.
    turn = key_of({"prompt": header + "Q: one?\nA: yes.\nQ: and two?"}, chat_api=False)
    depth = index.depth(turn, now=1)
    assert turn.ends[depth - 1] < first.size  # its end is not a cut of the longer prompt
    assert index.continues(turn, depth, now=1)
    # Another question after the same header shares all but its last bytes: not a turn.
    other = key_of({"prompt": header + "Q: seven?"}, chat_api=False)
    assert not index.continues(other, index.depth(other, now=1), now=1)
    # Nor is the same prompt again.
    assert not index.continues(first, index.depth(first, now=1), now=1)


def test_a_lora_adapter_and_its_base_share_no_prefix_but_each_continues_its_own() -> None:
    """An adapter is routed to its base model's replicas, whose prefix index it shares;
    the engine caches their prompts apart (the adapter is part of vLLM's block hash)."""
    index = PrefixIndex(capacity=1000, ttl_s=60)
    bodies = turns()
    base = [key_of({**body, "model": "m"}) for body in bodies[:2]]
    adapter = [key_of({**body, "model": "m-sql"}) for body in bodies[:2]]
    assert not set(base[0].chain) & set(adapter[0].chain)
    assert base[0].ends == adapter[0].ends  # the same cuts of the same text
    index.record(base[0], now=0)
    assert index.depth(adapter[0], now=1) == 0 and index.depth(adapter[1], now=1) == 0
    depth = index.depth(base[1], now=1)  # the base's next turn continues its first
    assert depth == len(base[0].chain) and index.continues(base[1], depth, now=1)
    index.record(adapter[0], now=1)
    depth = index.depth(adapter[1], now=2)
    assert depth == len(adapter[0].chain) and index.continues(adapter[1], depth, now=2)
    # A prompt shorter than a block continues from the model's own origin too.
    short = key_of({"prompt": "Q: one?", "model": "m-sql"}, chat_api=False)
    index.record(short, now=2)
    turn = key_of({"prompt": "Q: one?\nA: yes.\nQ: two?", "model": "m-sql"}, chat_api=False)
    assert index.continues(turn, index.depth(turn, now=3), now=3)


def test_entries_older_than_the_ttl_are_forgotten() -> None:
    index = PrefixIndex(capacity=1000, ttl_s=10)
    first, second = (key_of(body) for body in turns()[:2])
    index.record(first, now=0)
    assert index.depth(second, now=10) == len(first.chain)
    assert index.depth(second, now=10.5) == 0
    index.record(key_of(chat(("user", "else"))), now=11)  # recording sweeps the expired out
    assert len(index) == 1 and index.conversations(now=11) == 1


class IndexMachine(RuleBasedStateMachine):
    """The index never holds more than its bound, and what it answers stays prefix-closed."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 40
        self.index = PrefixIndex(capacity=self.capacity, ttl_s=30)
        self.now = 0.0
        self.recorded: list[PromptKey] = []

    @rule(
        texts=st.lists(
            st.sampled_from(["a" * 70, "b" * 130, "c" * 10, "d" * 300]), min_size=1, max_size=6
        )
    )
    def record(self, texts: list[str]) -> None:
        key = key_of(chat(*(("user", t) for t in texts)))
        self.index.record(key, self.now)
        self.recorded.append(key)
        if len(key.chain) <= self.capacity:
            assert self.index.depth(key, self.now) == len(key.chain)

    @rule(seconds=st.floats(0, 20))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: self.recorded)
    @rule(pick=st.integers(0, 10**6))
    def depth_is_prefix_closed(self, pick: int) -> None:
        key = self.recorded[pick % len(self.recorded)]
        depth = self.index.depth(key, self.now)
        held = [self.index._held(h, self.now) for h in key.chain]
        assert held == [True] * depth + [False] * (len(held) - depth)

    @invariant()
    def bounded(self) -> None:
        assert len(self.index) <= self.capacity
        assert len(self.index._anchors) <= self.capacity
        assert len(self.index._ends) <= self.capacity


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=profile_times(0.6), stateful_step_count=30, deadline=None)
