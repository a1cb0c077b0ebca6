"""A broken stream continued on another replica: the request that asks for the rest of
the answer, and the continuation's events rewritten into the client's one stream.
Pure: bodies and bytes in and out.

What is sent (`continued_body`):
- a chat completion: the conversation with the partial assistant message last, and
  `continue_final_message: true`, `add_generation_prompt: false` (vLLM's and SGLang's
  options; the engine renders the message without its end of turn and goes on);
- a completion: the prompt followed by the text sent, or, where the engine gave the
  generated token ids and the prompt was ids too, the ids themselves (no tokenizing the
  text again);
- where the engine gave the prompt's and every generated token's ids (vLLM's
  `return_token_ids`), the ids themselves: a completion's prompt, a chat's
  `kv_transfer_params.prompt_token_ids` (vLLM then renders no template). Text
  tokenized again need not give the ids that were generated (vLLM's tokenizer gives
  `[355, 602, 262]` for a generated `[437, 745]`), and from one differing id on a greedy
  answer goes another way: only the ids continue it token for token;
- in both the output budget (`max_tokens`, `max_completion_tokens`, `min_tokens`) less
  the tokens already sent, `stream_options.include_usage` on (the client's usage is
  made from it), and everything else as the client sent it (`seed` too).

What is refused (`Unsafe`), ending the stream as a broken one ends today: several
choices (`n`, `best_of`), guided decoding (`response_format` of a JSON kind, vLLM's
`guided_*` and `structured_outputs`: the grammar would start again from the seam), an
echo, a `suffix`, prompt logprobs, a batch of prompts, a token-id prompt continued from
text, and (read from the stream: router.kept_stream) a tool call or reasoning being
written.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from llmgw_server.router.kept_stream import IDS, Seam

_GUIDED = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
)  # fmt: skip
_BUDGETS = ("max_tokens", "max_completion_tokens")
_EVENT_END = b"\n\n"
_DATA = b"data:"
_DONE = b"[DONE]"


@attrs.frozen
class Unsafe:
    """Why this request's stream cannot be continued."""

    why: str


@attrs.frozen
class Spent:
    """The answer used its whole output budget before it broke: nothing is left to ask."""


def continued_body(chat: bool, body: dict[str, Any], seam: Seam) -> bytes | Unsafe | Spent:
    """The body that asks another replica for the rest of the answer `seam` holds."""
    why = _unsafe(chat, body)
    if why is not None:
        return Unsafe(why)
    rest: dict[str, Any] = dict(body)
    for key in _BUDGETS:
        value = rest.get(key)
        if type(value) is int:
            if value - seam.tokens <= 0:
                return Spent()
            rest[key] = value - seam.tokens
    least = rest.get("min_tokens")
    if type(least) is int:
        rest["min_tokens"] = max(0, least - seam.tokens)
    rest["stream"] = True
    ids = None
    if seam.prompt_ids is not None and seam.token_ids is not None:
        ids = [*seam.prompt_ids, *seam.token_ids]
        rest["return_token_ids"] = True  # for the next seam, if there is one
    options = rest.get("stream_options")
    rest["stream_options"] = {**(options if isinstance(options, dict) else {}),
                              "include_usage": True}  # fmt: skip
    if chat and ids is not None:
        if rest.get("kv_transfer_params") is not None:
            return Unsafe("kv_transfer_params of the client's own")
        rest["kv_transfer_params"] = {"prompt_token_ids": ids}
    elif chat:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") is True and _assistant_text(last):
            # The client's own prefill: the answer goes on after it.
            assert isinstance(last, dict)
            messages[-1] = {**last, "content": last["content"] + seam.text}
        else:
            messages.append({"role": "assistant", "content": seam.text})
        rest["messages"] = messages
        rest["continue_final_message"] = True
        rest["add_generation_prompt"] = False
    else:
        prompt = body.get("prompt")
        if ids is not None:
            rest["prompt"] = ids
        elif isinstance(prompt, str):
            rest["prompt"] = prompt + seam.text
        elif seam.token_ids is not None and _token_ids(prompt):
            assert isinstance(prompt, list)
            rest["prompt"] = [*prompt, *seam.token_ids]
        else:
            return Unsafe("a token-id prompt whose answer came without token ids")
    return json.dumps(rest, separators=(",", ":")).encode()


def _unsafe(chat: bool, body: dict[str, Any]) -> str | None:
    n = body.get("n")
    if n is not None and n != 1:
        return "more than one choice (n > 1)"
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        return "best_of > 1"
    form = body.get("response_format")
    if isinstance(form, dict) and form.get("type") not in (None, "text"):
        return "guided decoding (response_format)"
    for key in _GUIDED:
        if body.get(key) is not None:
            return f"guided decoding ({key})"
    if body.get("prompt_logprobs") is not None:
        return "prompt logprobs"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        return None
    if body.get("echo"):
        return "echo"
    if body.get("suffix") is not None:
        return "a suffix"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not _token_ids(prompt):
        return "a batch of prompts"
    if not isinstance(prompt, (str, list)):
        return "no prompt"
    return None


def _assistant_text(message: object) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") == "assistant"
        and isinstance(message.get("content"), str)
    )


def _token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(token) is int for token in prompt)


class Rejoin:
    """The continuation's events, as the client's stream goes on: the answer's own id,
    created, model and fingerprint; no second role delta; usage counting the client's
    prompt once and every generated token once (and only where the client asked for it).
    Fed the continuation's body bytes as they come; gives back what to send on."""

    __slots__ = ("_buffer", "_started", "chat", "seam", "sent", "usage_wanted")

    def __init__(self, chat: bool, seam: Seam, usage_wanted: bool) -> None:
        self.chat = chat
        self.seam = seam
        # The tokens sent before the seam: the seam itself goes on counting what this
        # continuation sends (kept for a later seam).
        self.sent = seam.tokens
        self.usage_wanted = usage_wanted
        self._buffer = b""
        self._started = False  # an event with content went out

    def feed(self, data: bytes) -> bytes:
        events = (self._buffer + data).split(_EVENT_END)
        self._buffer = events.pop()
        out = []
        for event in events:
            rewritten = self._event(event)
            if rewritten is not None:
                out.append(rewritten + _EVENT_END)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        payload = None
        for line in event.split(b"\n"):
            if line.startswith(_DATA):
                payload = line[5:].strip()
        if payload is None or payload == _DONE:
            return event
        try:
            parsed = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return event  # the client's parser says what it is; nothing kept of it
        if not isinstance(parsed, dict) or "error" in parsed:
            return event
        seam = self.seam
        for key, value in (("id", seam.id), ("created", seam.created), ("model", seam.model),
                           ("system_fingerprint", seam.fingerprint)):  # fmt: skip
            if key in parsed and value is not None:
                parsed[key] = value
        usage = parsed.get("usage")
        choices = parsed.get("choices")
        if usage is not None:
            if not self.usage_wanted:
                if not choices:
                    return None
                parsed.pop("usage")
            elif isinstance(usage, dict):
                parsed["usage"] = self._usage(usage)
        if self.chat and isinstance(choices, list) and choices and not self._started:
            choice = choices[0]
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict):
                delta.pop("role", None)
                opening = not delta.get("content") and choice.get("finish_reason") is None
                if opening and not any(v for k, v in delta.items() if k != "content"):
                    return None  # the continuation's opening: the client had its own
                self._started = True
        return b"data: " + json.dumps(parsed, separators=(",", ":")).encode()

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        sent = self.sent
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if type(prompt) is not int or type(completion) is not int:
            return usage
        prompt = max(0, prompt - sent)
        completion += sent
        fixed = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}  # fmt: skip
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
            fixed["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }
        return fixed


def without_ids(events: bytes) -> bytes:
    """Whole events, the token ids the router asked for taken out."""
    return IDS.sub(b"", events)


class WholeEvents:
    """A stream's bytes as they come, cut where an event ends: what follows the last
    whole event waits for the next read (an id list split between two reads is then
    taken out whole, and what is kept is what the client has)."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> bytes:
        data = self._buffer + data
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._buffer = data
            return b""
        end += len(_EVENT_END)
        self._buffer = data[end:]
        return data[:end]

    def left(self) -> bytes:
        """What came after the last whole event (a stream that ended without one)."""
        left, self._buffer = self._buffer, b""
        return left


def asking_ids(body: bytes) -> bytes:
    """The request's JSON body with `return_token_ids: true` first (a key the client
    gives again later in the object would win: the caller sends this only where the
    client gave none)."""
    head = body.lstrip()
    if not head.startswith(b"{"):
        return body
    rest = head[1:].lstrip()
    return b'{"return_token_ids":true' + (b"}" if rest.startswith(b"}") else b"," + rest)
