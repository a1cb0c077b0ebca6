"""The mock engine continues an answer that was cut, as vLLM does when a router resumes a
broken stream on another replica: a chat's final assistant message with
continue_final_message, a completion's prompt that ends with the mock's own answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_mock_engine import engine as engine_module
from llmgw_mock_engine.engine import answer_text, main, parse_args

TOKENS = 8
LIMIT = 5  # an original's max_tokens, below TOKENS
CHAT = "/chat/completions"
COMPLETIONS = "/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell a story"}]
PROMPT = "Once upon a time,"
MODELLED = ["--mock-kv-blocks", "64", "--mock-block-size", "4"]

# Where an answer of `total` words is cut: after how many words.
CUTS: dict[str, Callable[[int], int]] = {
    "none": lambda total: 0,
    "first": lambda total: 1,
    "middle": lambda total: total // 2,
    "last": lambda total: total - 1,
}


@asynccontextmanager
async def engine(*flags: str) -> AsyncIterator[httpx.AsyncClient]:
    argv = ["serve", "m", "--port", "0", "--mock-tokens", str(TOKENS), *flags]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(main, parse_args(argv, {}))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
        nursery.cancel_scope.cancel()


@attrs.frozen
class Answer:
    text: str
    finish: str
    usage: dict[str, Any]
    pieces: list[str]  # a stream's, in order (one piece when not streamed)


async def ask(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Answer:
    chat = path == CHAT
    if not body.get("stream"):
        got = await client.post("/v1" + path, json=body)
        assert got.status_code == 200, got.text
        answer = got.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return Answer(text, choice["finish_reason"], answer["usage"], [text])
    asked = {**body, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1" + path, json=asked) as stream:
        assert stream.status_code == 200
        lines = [line async for line in stream.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    *chunks, finish, last = events
    if chat:  # the role first, as vLLM sends it, a continuation's too
        assert chunks.pop(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [
        c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks
    ]
    return Answer("".join(pieces), finish["choices"][0]["finish_reason"], last["usage"], pieces)


def continuing(original: dict[str, Any], done: str) -> dict[str, Any]:
    """The chat request that continues `original`'s answer cut after `done`."""
    return {
        **original,
        "messages": [*original["messages"], {"role": "assistant", "content": done}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }


def first_words(text: str, count: int) -> str:
    return " ".join(text.split(" ")[:count])


@pytest.mark.parametrize("limit", [None, LIMIT])
@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("stream", [False, True])
async def test_a_cut_chat_answer_continues_where_it_was_cut(
    stream: bool, cut: str, limit: int | None
) -> None:
    total = limit or TOKENS
    done = CUTS[cut](total)
    original: dict[str, Any] = {"model": "m", "messages": MESSAGES, "stream": stream}
    if limit:
        original["max_tokens"] = limit
    with trio.fail_after(20):
        async with engine() as client:
            whole = await ask(client, CHAT, original)
            part = first_words(whole.text, done)
            asked = continuing(original, part)
            if limit:
                asked["max_tokens"] = limit - done
            rest = await ask(client, CHAT, asked)
    assert len(whole.text.split()) == total
    assert part + rest.text == whole.text
    if stream:  # each piece as vLLM sends it: a word after its space, C's last word's too
        assert rest.pieces == [
            " " + w if done or i else w for i, w in enumerate(whole.text.split()[done:])
        ]
    assert rest.usage["completion_tokens"] == total - done
    assert rest.usage["prompt_tokens"] == whole.usage["prompt_tokens"] + done
    assert rest.finish == whole.finish


@pytest.mark.parametrize("limit", [None, LIMIT])
@pytest.mark.parametrize("cut", ["first", "middle", "last"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_whose_prompt_ends_with_the_mocks_answer_continues_it(
    stream: bool, cut: str, limit: int | None
) -> None:
    total = limit or TOKENS
    done = CUTS[cut](total)
    original: dict[str, Any] = {"model": "m", "prompt": PROMPT, "stream": stream}
    if limit:
        original["max_tokens"] = limit
    with trio.fail_after(20):
        async with engine() as client:
            whole = await ask(client, COMPLETIONS, original)
            part = first_words(whole.text, done)
            asked = {**original, "prompt": PROMPT + part}  # a completion follows its prompt
            if limit:
                asked["max_tokens"] = limit - done
            rest = await ask(client, COMPLETIONS, asked)
    assert part + rest.text == whole.text
    assert all(piece.startswith(" ") for piece in rest.pieces)
    assert rest.usage["completion_tokens"] == total - done
    assert rest.usage["prompt_tokens"] == whole.usage["prompt_tokens"] + done
    assert rest.finish == whole.finish


@pytest.mark.parametrize("chat", [True, False])
async def test_the_scheduler_model_decodes_only_the_rest(chat: bool) -> None:
    done = 3
    path = CHAT if chat else COMPLETIONS
    original = {
        "model": "m",
        "stream": True,
        **({"messages": MESSAGES} if chat else {"prompt": PROMPT}),
    }
    with trio.fail_after(20):
        async with engine(*MODELLED) as client:
            whole = await ask(client, path, original)
            part = first_words(whole.text, done)
            asked = continuing(original, part) if chat else {**original, "prompt": PROMPT + part}
            rest = await ask(client, path, asked)
            records = (await client.get("/mock/stats")).json()["requests"]
    assert part + rest.text == whole.text
    assert rest.usage["completion_tokens"] == TOKENS - done
    assert [(r["output_tokens"], r["completed"]) for r in records] == [
        (TOKENS, True),
        (TOKENS - done, True),
    ]
    if chat:  # the original's prompt and its answer so far, without another <|assistant|>
        assert rest.usage["prompt_tokens"] == whole.usage["prompt_tokens"] + done


async def test_a_continued_stream_breaks_after_as_many_chunks_as_any() -> None:
    original = {"model": "m", "messages": MESSAGES}
    with trio.fail_after(20):
        async with engine("--mock-break-after-chunks", "3") as client:
            whole = await ask(client, CHAT, original)
            asked = {**continuing(original, first_words(whole.text, 2)), "stream": True}
            lines = []
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", "/v1" + CHAT, json=asked) as stream:
                    async for line in stream.aiter_lines():
                        lines += [line] if line else []
    deltas = [json.loads(line.removeprefix("data: "))["choices"][0]["delta"] for line in lines]
    assert deltas == [{"role": "assistant", "content": ""}] + [
        {"content": " " + w} for w in whole.text.split()[2:4]
    ]


@settings(max_examples=profile_times(1), deadline=None)
@given(
    prompt=st.text(max_size=40).filter(lambda p: not p.endswith(" ")),
    cut=st.integers(1, TOKENS),
    limit=st.none() | st.integers(1, TOKENS + 2),
)
async def test_any_prompt_continues_from_any_cut(prompt: str, cut: int, limit: int | None) -> None:
    # A prompt ending with a space could end with mock words itself: its answer's start
    # could then be read as a longer cut of another prompt's.
    original: dict[str, Any] = {"model": "m", "prompt": prompt}
    if limit:
        original["max_tokens"] = limit
    total = min(TOKENS, limit or TOKENS)
    # A whole answer is continued only without a limit: max_tokens 0 would mean none.
    done = min(cut, total if total == TOKENS else total - 1)
    with trio.fail_after(20):
        async with engine() as client:
            whole = await ask(client, COMPLETIONS, original)
            part = first_words(whole.text, done)
            asked = {**original, "prompt": prompt + part}
            if limit and limit > done:
                asked["max_tokens"] = limit - done
            rest = await ask(client, COMPLETIONS, asked)
    assert whole.text == answer_text(original, total)
    assert part + rest.text == whole.text
    assert rest.usage["completion_tokens"] == total - done
    assert rest.finish == whole.finish


async def test_words_that_are_not_the_mocks_own_answer_are_answered_afresh() -> None:
    # Mock words, but none of these is the start of the mock's answer to what precedes it.
    prompt = "the quick brown fox jumps over a lazy dog"
    chat = continuing({"model": "m", "messages": MESSAGES}, "gpus hum in the rack")
    with trio.fail_after(20):
        async with engine() as client:
            completion = await ask(client, COMPLETIONS, {"model": "m", "prompt": prompt})
            answer = await ask(client, CHAT, chat)
    assert completion.text == answer_text({"prompt": prompt}, TOKENS)
    assert completion.usage["prompt_tokens"] == 9
    # From a seed of the whole conversation, its final message included.
    assert answer.text == answer_text(chat, TOKENS)
    assert answer.usage["completion_tokens"] == TOKENS


def test_the_split_search_looks_at_most_at_as_many_words_as_an_answer_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeds = []

    def counted(body: dict[str, Any], adapters: Any) -> str:
        seeds.append(body)
        return "seed"

    monkeypatch.setattr(engine_module, "_seed_of", counted)
    prompt = " ".join(["the"] * 1_000)  # every word a split point
    engine_module._completion_cut({"prompt": prompt}, (), TOKENS)
    assert 0 < len(seeds) <= TOKENS


@pytest.mark.parametrize("generation_prompt", [{"add_generation_prompt": True}, {}])
async def test_continue_final_message_with_a_generation_prompt_is_refused(
    generation_prompt: dict[str, Any],
) -> None:
    body = {
        "model": "m",
        "messages": [*MESSAGES, {"role": "assistant", "content": ""}],
        "continue_final_message": True,
        **generation_prompt,  # true unless said otherwise, as vLLM's
    }
    with trio.fail_after(20):
        async with engine() as client:
            got = await client.post("/v1" + CHAT, json=body)
    assert got.status_code == 400
    assert "continue_final_message and add_generation_prompt cannot both be true" in got.text
