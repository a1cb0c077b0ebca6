"""The router's reading of an engine's /tokenize answer (precise routing): a hostile or
buggy engine's answer gives no token ids and one rate-limited warning, never a traceback."""

from __future__ import annotations

import array
import json
import logging
from typing import cast

import attrs
import pytest

from llmgw_core.catalog import Endpoint
from llmgw_server.router.metrics import RouterMetrics
from llmgw_server.router.prefix import PromptKey, prompt_key
from llmgw_server.router.tokenizer import ID_BYTES, SLACK_IDS, Tokenizer, most_ids
from llmgw_server.router.upstream import Pool


@attrs.frozen
class _Pool:
    endpoint: Endpoint


POOL = cast(Pool, _Pool(Endpoint("127.0.0.1", 9)))


async def test_an_answer_is_read_into_uint32s() -> None:
    ids = Tokenizer()._read(
        POOL, 200, b'{"count": 3, "max_model_len": 8, "tokens": [0, 7, 4294967295]}'
    )
    assert isinstance(ids, array.array) and ids.typecode == "I"
    assert list(ids) == [0, 7, 2**32 - 1]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1, 2, 3]",
        b'{"token_ids": [1]}',
        b'{"tokens": "1 2 3"}',
        b'{"tokens": [1, -1]}',
        b'{"tokens": [1, 4294967296]}',
        b'{"tokens": [1, 2.5]}',
        b'{"tokens": [1, "2"]}',
        b'{"tokens": [[1]]}',
        b'{"tokens": [1, 2' + b", 3" * 1000,
        b'{"tokens": [' + b"9" * 5000 + b"]}",
        b"[" * 100_000,
    ],
)
async def test_a_bad_answer_gives_no_ids_and_one_warning(
    body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = Tokenizer()
    with caplog.at_level(logging.WARNING, logger="llmgw.tokenizer"):
        assert tokenizer._read(POOL, 200, body) is None
        assert tokenizer._read(POOL, 200, body) is None  # within the rate limit's period
    assert [r.getMessage() for r in caplog.records] == [
        "cannot tokenize through http://127.0.0.1:9 (its answer holds no list of token ids): "
        "routing without token ids"
    ]


async def test_an_error_status_gives_no_ids() -> None:
    assert Tokenizer()._read(POOL, 404, b'{"tokens": [1]}') is None


async def test_the_request_carries_what_the_clients_json_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # json.loads lets a lone surrogate and a 100-digit int through; the request to the
    # engine must still be JSON that reads back to the same messages and tools.
    sent: list[bytes] = []

    async def ask(pool: Pool, request: bytes, most: int) -> None:
        sent.append(request)

    tokenizer = Tokenizer()
    monkeypatch.setattr(tokenizer, "_ask", ask)
    for text in ('"caf\\u00e9 \\u2603"', '"a lone \\ud800 surrogate"'):
        body = json.loads(
            f'{{"messages": [{{"role": "user", "content": {text}}}], '
            f'"tools": [{{"n": {"9" * 100}}}], "max_tokens": 5}}'
        )
        key = prompt_key(body, chat=True, block_bytes=64)
        assert key is not None
        assert await tokenizer.tokens(POOL, "m", body, True, key) is None
        assert json.loads(sent[-1]) == {
            "model": "m",
            "messages": body["messages"],
            "tools": body["tools"],
            "add_generation_prompt": True,
        }


def _chat(text: str) -> tuple[dict[str, object], PromptKey]:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    key = prompt_key(body, chat=True, block_bytes=64)
    assert key is not None
    return body, key


def test_an_answer_may_hold_as_many_ids_as_its_prompts_bytes_and_64() -> None:
    body, key = _chat("caf\u00e9 " * 10)
    assert most_ids(body, key) == len(key.text) + SLACK_IDS
    assert len(key.text) == len("user\x1f") + 60 + 1  # UTF-8 bytes: an e-acute is two
    body["chat_template"] = "{{ messages }}\u2603"
    assert most_ids(body, key) == len(key.text) + len("{{ messages }}") + 3 + SLACK_IDS


async def test_more_ids_than_the_prompt_allows_are_refused_counted_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = RouterMetrics()
    tokenizer = Tokenizer(refused=metrics.tokenize_refused)
    answer = json.dumps({"tokens": list(range(11))}).encode()
    with caplog.at_level(logging.WARNING, logger="llmgw.tokenizer"):
        assert tokenizer._read(POOL, 200, answer, 10) is None
        assert tokenizer._read(POOL, 200, answer, 10) is None
        ids = tokenizer._read(POOL, 200, answer, 11)
    assert ids is not None and len(ids) == 11
    assert tokenizer.refused == {"http://127.0.0.1:9": 2}
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "the /tokenize answer of http://127.0.0.1:9 holds 11 ids, more than 10: its prompt's "
        "bytes allow no more (prompt text, chat template, 64 more); routing without token ids "
        "(said once; llmgw_tokenize_refused_total counts them)"
    ]
    rendered = metrics.render({}, {}).decode()
    assert 'llmgw_tokenize_refused_total{endpoint="http://127.0.0.1:9"} 2' in rendered


@attrs.define
class _Exchange:
    """An engine's answer whose head says how long it is; its body is never to be read."""

    content_length: int
    status: int = 200
    read: bool = False
    released: bool = False

    async def read_body(self, limit: int) -> bytes:
        self.read = True
        return b'{"tokens": [' + b"1," * (self.content_length // 2 - 8) + b"1]}"

    def release(self) -> None:
        self.released = True


@attrs.define
class _AnsweringPool:
    endpoint: Endpoint
    answer: _Exchange

    async def open(self, *args: object) -> _Exchange:
        return self.answer


async def test_an_answer_longer_than_its_prompt_allows_is_refused_unread() -> None:
    """4M ids (8 MB) for a short prompt: its Content-Length says enough, nothing is read
    or decoded (that cost 0.46 s of the router's CPU a request)."""
    body, key = _chat("hello")
    most = most_ids(body, key)
    exchange = _Exchange(content_length=8_000_000)
    pool = cast(Pool, _AnsweringPool(Endpoint("127.0.0.1", 9), exchange))
    tokenizer = Tokenizer()
    assert await tokenizer.tokens(pool, "m", body, True, key) is None
    assert not exchange.read and exchange.released
    assert tokenizer.refused == {"http://127.0.0.1:9": 1}
    # One that fits is read (and then refused only if it holds too many ids).
    fits = _Exchange(content_length=most * ID_BYTES)
    pool = cast(Pool, _AnsweringPool(Endpoint("127.0.0.1", 9), fits))
    assert await tokenizer.tokens(pool, "m", body, True, key) is None
    assert fits.read and tokenizer.refused == {"http://127.0.0.1:9": 2}
