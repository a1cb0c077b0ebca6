"""A broken stream's seam and its continuation, pure (router.kept_stream,
router.continuation): what the client has, the request for the rest, the rest rewritten
into the client's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_server.router import kept_stream
from llmgw_server.router.continuation import (
    Rejoin,
    Spent,
    Unsafe,
    WholeEvents,
    asking_ids,
    continued_body,
    without_ids,
)
from llmgw_server.router.kept_stream import KeepBudget, KeptStream, Seam, blanked
from llmgw_server.router.policies import Choice
from llmgw_server.router.policies.policy import STORED_RESPONSE
from llmgw_server.router.request_plan import Attempts, GiveUp, Send

BASE = {"id": "chatcmpl-1", "created": 1700, "model": "m", "system_fingerprint": "fp"}


def chat_events(pieces: list[str], finish: str | None = None) -> list[bytes]:
    events = [{**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    for piece in pieces:
        events.append({**BASE, "choices": [{"index": 0, "delta": {"content": piece}}]})
    if finish:
        events.append({**BASE, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]


def framed(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for point in [*points, len(data)]:
        out.append(data[last:point])
        last = point
    return [piece for piece in out if piece]


@given(
    pieces=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=12),
    chunked=st.booleans(),
    compact=st.sampled_from([64, 1024, 32 * 1024]),
)
def test_seam_is_the_text_sent_however_the_bytes_came(
    pieces: list[str], cuts: list[int], chunked: bool, compact: int
) -> None:
    old = kept_stream.COMPACT_BYTES
    kept_stream.COMPACT_BYTES = compact
    try:
        budget = KeepBudget(10_000)
        keeper = KeptStream(1_000, budget)
        events = chat_events(pieces)
        if chunked:
            wire = b"".join(framed(e) for e in events)
            for read in split(wire, cuts):
                keeper.feed_framed(read)
        else:
            for read in split(b"".join(events), cuts):
                keeper.feed(read)
        seam = keeper.read()
        assert isinstance(seam, Seam)
        assert seam.text == "".join(pieces)
        assert seam.tokens == len(pieces)
        assert (seam.id, seam.created, seam.model) == ("chatcmpl-1", 1700, "m")
        assert budget.kept == len(pieces)
        keeper.release()
        assert budget.kept == 0
    finally:
        kept_stream.COMPACT_BYTES = old


@given(
    pieces=st.lists(st.text(max_size=6), min_size=1, max_size=80),
    ids=st.booleans(),
    chat=st.booleans(),
    spaced=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=8),
)
def test_skimmed_events_give_what_parsing_each_gives(
    pieces: list[str], ids: bool, chat: bool, spaced: bool, cuts: list[int]
) -> None:
    """Events read past the first (kept_stream's skim) give the text, the token counts
    and ids, and the finish that parsing each event gives: vLLM's compact JSON with and
    without token ids, the mock's spaced JSON, texts with quotes, escapes and empty."""
    old = kept_stream.COMPACT_BYTES
    kept_stream.COMPACT_BYTES = 256
    try:

        def dumps(event: dict[str, Any]) -> str:
            if spaced:
                return json.dumps(event)
            return json.dumps(event, separators=(",", ":"), ensure_ascii=False)

        events: list[dict[str, Any]] = []
        expected_ids: list[int] = []
        for n, piece in enumerate(pieces):
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            choice["logprobs"] = None
            choice["finish_reason"] = "length" if n == len(pieces) - 1 else None
            if ids:
                choice["token_ids"] = [n, n + 1] if piece else [n]
                expected_ids += choice["token_ids"]
            events.append({**BASE, "choices": [choice]})
        events.append({**BASE, "choices": [], "usage": {"prompt_tokens": 3}})
        wire = b"".join(b"data: " + dumps(e).encode() + b"\n\n" for e in events)
        keeper = KeptStream(10**6, KeepBudget(10**6))
        for read in split(wire, cuts):
            keeper.feed(read)
        seam = keeper.read()
        assert isinstance(seam, Seam)
        assert seam.text == "".join(pieces)
        assert seam.finished == "length" and seam.usage_sent
        if ids:
            assert seam.token_ids == expected_ids and seam.tokens == len(expected_ids)
        else:
            assert seam.token_ids is None
            assert seam.tokens == len([p for p in pieces if p])
    finally:
        kept_stream.COMPACT_BYTES = old


def test_a_partial_event_is_not_a_seam() -> None:
    keeper = KeptStream(100, KeepBudget(100))
    data = b"".join(chat_events(["a", "b"]))
    keeper.feed(data[:-5])
    assert keeper.read() == "the client has part of an event"


@pytest.mark.parametrize(
    ("choice", "why"),
    [
        ({"index": 1, "delta": {"content": "x"}}, "more than one choice (n > 1)"),
        ({"index": 0, "delta": {"tool_calls": [{"index": 0}]}}, "a tool call was being written"),
        ({"index": 0, "delta": {"reasoning_content": "hm"}}, "reasoning was being written"),
    ],
)
def test_what_a_stream_shows_may_make_it_unsafe(choice: dict[str, Any], why: str) -> None:
    budget = KeepBudget(100)
    keeper = KeptStream(100, budget)
    for event in chat_events(["a"]):
        keeper.feed(event)
    keeper.feed(b"data: " + json.dumps({**BASE, "choices": [choice]}).encode() + b"\n\n")
    assert keeper.read() == why
    assert budget.kept == 0  # given back at once


def test_an_error_event_or_garbage_is_not_continued() -> None:
    keeper = KeptStream(100, KeepBudget(100))
    keeper.feed(b'data: {"error": {"message": "boom"}}\n\n')
    assert keeper.read() == "the engine sent an error event"
    keeper = KeptStream(100, KeepBudget(100))
    keeper.feed(b"data: {not json\n\n")
    assert keeper.read() == "an event of the answer is not JSON"


def test_the_bounds_per_stream_and_per_process() -> None:
    budget = KeepBudget(5)
    long = KeptStream(3, budget)
    for event in chat_events(["a", "b", "c", "d"]):
        long.feed(event)
    assert long.read() == "the answer is longer than the router keeps"
    assert budget.kept == 0
    first, second = KeptStream(100, budget), KeptStream(100, budget)
    for event in chat_events(["a", "b", "c"]):
        first.feed(event)
    for event in chat_events(["x", "y", "z"]):
        second.feed(event)
    assert isinstance(first.read(), Seam)
    assert second.read() == "the answer is longer than the router keeps"
    first.release()
    second.release()
    assert budget.kept == 0


def test_token_ids_are_kept_where_every_event_has_them() -> None:
    keeper = KeptStream(100, KeepBudget(100))
    for ids, text in (([5, 6], "ab"), ([7], "c")):
        event = {**BASE, "choices": [{"index": 0, "text": text, "token_ids": ids}]}
        keeper.feed(b"data: " + json.dumps(event).encode() + b"\n\n")
    seam = keeper.read()
    assert isinstance(seam, Seam)
    assert (seam.text, seam.token_ids, seam.tokens) == ("abc", [5, 6, 7], 3)


def seam_of(text: str, tokens: int, ids: list[int] | None = None) -> Seam:
    return Seam(id="chatcmpl-1", created=1700, model="m", text=text, tokens=tokens, token_ids=ids)


def test_a_chat_goes_on_from_its_partial_assistant_message() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 10, "seed": 7}  # fmt: skip
    made = continued_body(True, body, seam_of("Hello wor", 3))
    assert isinstance(made, bytes)
    rest = json.loads(made)
    assert rest["messages"][-1] == {"role": "assistant", "content": "Hello wor"}
    assert rest["continue_final_message"] is True and rest["add_generation_prompt"] is False
    assert rest["max_tokens"] == 7 and rest["seed"] == 7
    assert rest["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}]  # the client's untouched


def test_a_clients_own_prefill_goes_on_after_it() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    body = {"model": "m", "messages": messages, "continue_final_message": True,
            "add_generation_prompt": False}  # fmt: skip
    rest = json.loads(continued_body(True, body, seam_of(" one", 1)))  # type: ignore[arg-type]
    assert rest["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert len(rest["messages"]) == 2


def test_a_completion_goes_on_from_its_text_or_its_ids() -> None:
    rest = json.loads(continued_body(False, {"prompt": "Once"}, seam_of(" upon", 1)))  # type: ignore[arg-type]
    assert rest["prompt"] == "Once upon"
    by_ids = continued_body(False, {"prompt": [1, 2]}, seam_of(" upon", 2, [9, 10]))
    assert json.loads(by_ids)["prompt"] == [1, 2, 9, 10]  # type: ignore[arg-type]
    assert continued_body(False, {"prompt": [1, 2]}, seam_of(" upon", 2)) == Unsafe(
        "a token-id prompt whose answer came without token ids"
    )


def test_an_answer_that_used_its_budget_has_nothing_left() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    assert continued_body(True, body, seam_of("abc", 3)) == Spent()


@pytest.mark.parametrize(
    ("chat", "extra", "why"),
    [
        (True, {"n": 2}, "more than one choice (n > 1)"),
        (True, {"response_format": {"type": "json_schema"}}, "guided decoding (response_format)"),
        (True, {"guided_regex": "a+"}, "guided decoding (guided_regex)"),
        (False, {"echo": True}, "echo"),
        (False, {"best_of": 3}, "best_of > 1"),
        (False, {"suffix": "x"}, "a suffix"),
        (False, {"prompt": ["a", "b"]}, "a batch of prompts"),
        (False, {"prompt_logprobs": 1}, "prompt logprobs"),
    ],
)
def test_what_cannot_be_continued_safely(chat: bool, extra: dict[str, Any], why: str) -> None:
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "p"}
    )
    body.update(extra)
    assert continued_body(chat, body, seam_of("x", 1)) == Unsafe(why)


def test_the_rest_is_rewritten_into_the_clients_stream() -> None:
    other = {"id": "chatcmpl-2", "created": 1800, "model": "m", "system_fingerprint": "fq"}
    events = [
        {**other, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**other, "choices": [{"index": 0, "delta": {"content": "ld"}}]},
        {**other, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {
            **other,
            "choices": [],
            "usage": {"prompt_tokens": 13, "completion_tokens": 2, "total_tokens": 15},
        },
    ]
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    wire += b"data: [DONE]\n\n"
    seam = Seam(id="chatcmpl-1", created=1700, model="m", fingerprint="fp", text="Hello wor",
                tokens=3)  # fmt: skip
    for wanted in (True, False):
        rejoin = Rejoin(True, seam, wanted)
        out = b"".join(rejoin.feed(piece) for piece in split(wire, [7, 50, 51, 200]))
        got = [e[6:] for e in out.split(b"\n\n") if e]
        assert got[-1] == b"[DONE]"
        parsed = [json.loads(e) for e in got[:-1]]
        assert all((e["id"], e["created"], e["system_fingerprint"]) ==
                   ("chatcmpl-1", 1700, "fp") for e in parsed)  # fmt: skip
        assert parsed[0]["choices"][0]["delta"] == {"content": "ld"}
        if wanted:
            assert parsed[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5,
                                           "total_tokens": 15}  # fmt: skip
        else:
            assert all("usage" not in e for e in parsed)


def test_attempts_go_on_after_a_break_up_to_the_limit() -> None:
    replicas = [object(), object(), object(), object()]

    def choose(tried: Any) -> Choice | None:
        left = [r for r in replicas if r not in tried]
        return Choice(left[0], STORED_RESPONSE) if left else None  # type: ignore[arg-type]

    plan = Attempts(1, max_migrations=2)
    first = plan.next(choose)
    assert isinstance(first, Send)
    plan.answered(200)
    assert plan.broke()
    second = plan.next(choose)
    assert isinstance(second, Send) and second.choice.replica is replicas[1]
    plan.answered(200)
    assert plan.broke()
    third = plan.next(choose)  # the first may serve again; the one that broke may not
    assert isinstance(third, Send) and third.choice.replica is replicas[0]
    plan.answered(200)
    assert not plan.broke()  # two migrations at most
    assert not Attempts(1).broke()  # nothing relayed, nothing to continue
    unanswered = Attempts(1, max_migrations=1)
    unanswered.next(choose)
    unanswered.answered(200)
    assert unanswered.broke()
    assert isinstance(unanswered.next(choose), Send)  # the continuation's one attempt
    unanswered.answered(503)
    assert isinstance(unanswered.next(choose), GiveUp)


def test_the_ids_the_router_asked_for_are_asked_and_taken_out_whole() -> None:
    assert asking_ids(b' {"model":"m"}') == b'{"return_token_ids":true,"model":"m"}'
    assert asking_ids(b"{}") == b'{"return_token_ids":true}'
    assert json.loads(asking_ids(b'{ "a": 1 }')) == {"return_token_ids": True, "a": 1}
    chat = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],'
        b'"prompt_token_ids":[0,6,379],"prompt_text":null}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":" could"},'
        b'"finish_reason":null,"token_ids":[3117]}]}\n\n'
    )
    plain = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":" could"},'
        b'"finish_reason":null}]}\n\n'
    )
    assert without_ids(chat) == plain
    events = WholeEvents()
    out = b"".join(events.feed(piece) for piece in split(chat, [40, 95, 96, 130]))
    assert without_ids(out) == plain and events.left() == b""


def test_ids_written_over_keep_each_event_valid_and_as_long() -> None:
    events = [
        {"id": "c", "choices": [{"index": 0, "text": "", "prompt_token_ids": [0, 5]}]},
        {
            "id": "c",
            "choices": [{"index": 0, "text": " a", "prompt_token_ids": None, "token_ids": [7]}],
        },
        {
            "id": "c",
            "choices": [{"index": 0, "delta": {}}],
            "prompt_token_ids": [1],
            "prompt_text": None,
        },
    ]
    for event in events:
        wire = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        out = blanked(wire)
        assert len(out) == len(wire)
        parsed = json.loads(out[6:])
        assert "token_ids" not in json.dumps(parsed) and "prompt_text" not in parsed
    plain = b'data: {"id":"c","choices":[{"index":0,"text":" a"}]}\n\n'
    assert blanked(plain) is plain
