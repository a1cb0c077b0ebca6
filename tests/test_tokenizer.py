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
from llmgw_server.router.prefix import prompt_key
from llmgw_server.router.tokenizer import Tokenizer
from llmgw_server.router.upstream import Pool


@attrs.frozen
class _Pool:
    endpoint: Endpoint


POOL = cast(Pool, _Pool(Endpoint("127.0.0.1", 9)))


async def test_an_answer_is_read_into_uint32s() -> None:
    ids = Tokenizer()._read(POOL, 200, b'{"count": 3, "max_model_len": 8, "tokens": [0, 7, 4294967295]}')
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


async def test_the_request_carries_what_the_clients_json_held(monkeypatch: pytest.MonkeyPatch) -> None:
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
