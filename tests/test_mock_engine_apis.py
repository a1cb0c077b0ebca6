"""The mock engine serves the Responses API and Anthropic's Messages API as vLLM 0.32.0
answers them (issue 36, item 2), with the real `openai` and `anthropic` clients, directly
and through a router: stored responses under the id the request names (a router's),
`previous_response_id` chains, `GET /v1/responses/{id}`, the streaming events in vLLM's
order, `count_tokens`; a bounded store; and a 404 for a path it lacks that says the mock
engine answered."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from llmgw_mock_engine.responses_api import ResponseStore
from llmgw_server.router.stored import holder_of
from procs import Procs, metric, models_toml

# anthropic is imported by the tests that use it: at the top, each of pytest-xdist's six
# workers imported it to collect this module (1.5 s of CPU), most of them for nothing.
if TYPE_CHECKING:
    import anthropic

RESPONSE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 4,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
MESSAGE_EVENTS = [
    "message_start",
    "content_block_start",
    *["content_block_delta"] * 4,
    "content_block_stop",
    "message_delta",
    "message_stop",
]  # vLLM 0.32.0 sends no `ping` (Anthropic's own API does)


def chat_answer(url: str, messages: Sequence[Mapping[str, object]]) -> str:
    """What the engine answers the same conversation as a chat completion."""
    answer = httpx.post(
        url + "/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=20
    )
    content: str = answer.json()["choices"][0]["message"]["content"]
    return content


def text_of(content: Sequence[object]) -> str:
    import anthropic

    block = content[0]
    assert isinstance(block, anthropic.types.TextBlock), content
    return block.text


def test_responses_are_stored_under_the_request_id_and_chained(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "4")
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    first = client.responses.create(
        model="m", input="Hi", extra_body={"request_id": "resp_given_by_a_router"}
    )
    assert first.id == "resp_given_by_a_router"  # vLLM's response id: the request_id
    assert first.output_text == chat_answer(engine.url, [{"role": "user", "content": "Hi"}])
    assert first.status == "incomplete" and first.incomplete_details is not None
    assert first.usage is not None and first.usage.output_tokens == 4
    second = client.responses.create(model="m", input="And then?", previous_response_id=first.id)
    assert second.id.startswith("resp_") and second.previous_response_id == first.id
    # The follow-up continues the stored conversation: its answer is the chat answer to
    # the first turn, its answer, and the new input.
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.output_text == chat_answer(engine.url, conversation)
    assert client.responses.retrieve(first.id).output_text == first.output_text

    unstored = client.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{unstored.id}' not"):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="Response with id 'resp_nope' not found"):
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    # vLLM 0.32.0 has no DELETE, and cancels only background responses.
    assert httpx.delete(f"{engine.url}/v1/responses/{first.id}").status_code == 405
    cancel = httpx.post(f"{engine.url}/v1/responses/{first.id}/cancel")
    assert cancel.status_code == 400, cancel.text
    assert "Cannot cancel a synchronous response" in cancel.text


def test_a_streamed_response_has_vllms_events_in_order(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "4")
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    events = list(client.responses.create(model="m", input="Hi", stream=True))
    assert [e.type for e in events] == RESPONSE_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == chat_answer(engine.url, [{"role": "user", "content": "Hi"}])
    created, done = events[0], events[-1]
    assert created.type == "response.created" and created.response.status == "in_progress"
    assert done.type == "response.completed" and done.response.output_text == text
    assert done.response.usage is not None and done.response.usage.output_tokens == 4
    # The streamed response is stored as it completed.
    assert client.responses.retrieve(done.response.id).output_text == text


def test_messages_and_count_tokens_as_vllm_answers_them(procs: Procs) -> None:
    import anthropic

    engine = procs.mock("m", "--mock-tokens", "4")
    claude = anthropic.Anthropic(base_url=engine.url, api_key="none", max_retries=0)
    ask: anthropic.types.MessageParam = {"role": "user", "content": "Hi there"}
    message = claude.messages.create(
        model="m", max_tokens=64, messages=[ask], extra_headers={"x-request-id": "abc"}
    )
    assert message.id == "chatcmpl-abc"  # vLLM's: the chat completion's id
    assert text_of(message.content) == chat_answer(engine.url, [ask])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    counted = claude.messages.count_tokens(model="m", messages=[ask])
    assert counted.input_tokens == message.usage.input_tokens > 0

    with claude.messages.stream(model="m", max_tokens=64, messages=[ask]) as stream:
        final = stream.get_final_message()
    # On the wire (the client drops a `ping`): each event named as its data's type.
    wire = httpx.post(
        engine.url + "/v1/messages",
        json={"model": "m", "max_tokens": 64, "messages": [ask], "stream": True},
    )
    named = re.findall(r"^event: (\S+)\ndata: (.*)$", wire.text, re.M)
    assert [name for name, _ in named] == MESSAGE_EVENTS, wire.text
    assert all(json.loads(data)["type"] == name for name, data in named)
    assert text_of(final.content) == text_of(message.content)
    assert final.usage.input_tokens == message.usage.input_tokens
    assert final.usage.output_tokens == 4
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude.messages.create(model="nope", max_tokens=8, messages=[ask])
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "NotFoundError", "message": "the model 'nope' does not exist"},
    }


def test_a_path_the_mock_lacks_is_its_own_404(procs: Procs) -> None:
    engine = procs.mock("m")
    answer = httpx.post(engine.url + "/v1/nowhere", json={"model": "m"})
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == "mock engine: no route /v1/nowhere"


def completion_tokens(router_url: str) -> float:
    page = httpx.get(router_url + "/metrics").text
    return metric(page, "llmgw_tokens_total", model="m", kind="completion")


def test_through_a_router_the_chain_stays_on_the_replica_the_id_names(procs: Procs) -> None:
    import anthropic

    engines = [procs.mock("m", "--mock-tokens", "4") for _ in range(2)]
    router = procs.router(
        '[router]\nbalancing = "round_robin"\n'
        + models_toml({"m": [engines[0].url, engines[1].url]})
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    previous = client.responses.create(model="m", input="Hi")
    assert holder_of(previous.id) is not None  # the router named it, and the engine took it
    for turn in range(3):  # round robin would take every other one elsewhere
        answer = client.responses.create(
            model="m", input=f"turn {turn}", previous_response_id=previous.id
        )
        assert answer.previous_response_id == previous.id and holder_of(answer.id)
        before_read = completion_tokens(router.url)
        assert client.responses.retrieve(answer.id).output_text == answer.output_text
        # Reading a stored response again repeats its usage: counted once, when made.
        assert completion_tokens(router.url) == before_read
        previous = answer
    before_stream = completion_tokens(router.url)
    streamed = list(client.responses.create(model="m", input="Hi", stream=True))
    assert [e.type for e in streamed] == RESPONSE_EVENTS
    assert completion_tokens(router.url) - before_stream == 4
    holders = [
        json.loads(httpx.get(e.url + "/mock/stats").text)["stored_responses"]["stored"]
        for e in engines
    ]
    assert sorted(holders) == [1, 4], holders  # the chain on one replica, one alone

    before_messages = completion_tokens(router.url)
    claude = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0)
    ask: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Hi"}]
    message = claude.messages.create(model="m", max_tokens=8, messages=ask)
    assert message.type == "message" and message.usage.output_tokens == 4
    with claude.messages.stream(model="m", max_tokens=8, messages=ask) as stream:
        assert text_of(stream.get_final_message().content) == text_of(message.content)
    assert claude.messages.count_tokens(model="m", messages=ask).input_tokens > 0
    # The router read each answer's usage where vLLM puts it (the Responses stream's
    # response.completed, the Messages stream's message_delta): 4 tokens each.
    assert completion_tokens(router.url) - before_messages == 2 * 4


def test_the_store_drops_its_oldest_past_its_count_or_its_bytes() -> None:
    def response(number: int, size: int = 10) -> dict[str, object]:
        return {"id": f"resp_{number}", "text": "x" * size}

    store = ResponseStore(max_count=3, max_bytes=10_000)
    assert [store.put(response(n), []) for n in range(5)] == [0, 0, 0, 1, 1]
    assert list(store.held) == ["resp_2", "resp_3", "resp_4"] and store.dropped == 2
    assert store.get("resp_0") is None and store.get("resp_4") is not None
    size = store.bytes // 3
    assert store.bytes == sum(s.size for s in store.held.values())

    by_bytes = ResponseStore(max_count=100, max_bytes=2 * size + size // 2)
    for n in range(4):
        by_bytes.put(response(n), [])
    assert list(by_bytes.held) == ["resp_2", "resp_3"] and by_bytes.bytes <= by_bytes.max_bytes
    big = ResponseStore(max_count=100, max_bytes=1)
    big.put(response(0, 1000), [])  # one over the bound is kept: the latest answer
    big.put(response(1, 1000), [])
    assert list(big.held) == ["resp_1"] and big.dropped == 1


def test_with_the_scheduler_model_they_report_cached_tokens_as_chat_does(procs: Procs) -> None:
    import anthropic

    engine = procs.mock(
        "m", "--mock-tokens", "4", "--mock-kv-blocks", "64", "--mock-block-size", "2"
    )
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    words = "one two three four five six seven eight"
    first, again = (client.responses.create(model="m", input=words) for _ in range(2))
    assert first.usage is not None and again.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    # The prompt's whole blocks, less its last token (which the engine always computes).
    assert again.usage.input_tokens_details.cached_tokens == first.usage.input_tokens - 2
    claude = anthropic.Anthropic(base_url=engine.url, api_key="none", max_retries=0)
    message = claude.messages.create(
        model="m", max_tokens=64, messages=[{"role": "user", "content": words}]
    )
    usage = message.usage  # vLLM's: cached tokens out of input_tokens
    assert usage.cache_read_input_tokens == again.usage.input_tokens_details.cached_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == first.usage.input_tokens
    records = httpx.get(engine.url + "/mock/stats").json()["requests"]
    assert [r["completed"] for r in records] == [True] * 3
