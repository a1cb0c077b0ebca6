"""The chunk scanner against h11's own chunked encoding, split at every byte."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_core.chunked import ChunkedError, ChunkScanner


def encode(chunks: list[bytes]) -> bytes:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn.next_event()
    conn.next_event()
    out = b""
    conn.send(h11.Response(status_code=200, headers=[]))
    for c in chunks:
        out += conn.send(h11.Data(data=c)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


@given(st.lists(st.binary(min_size=1, max_size=50), max_size=8), st.data())
def test_whole_chunks_come_out_in_order_however_the_bytes_are_split(
    chunks: list[bytes], data: st.DataObject
) -> None:
    body = encode(chunks)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=6)))
    scanner = ChunkScanner()
    out = b""
    last = 0
    for cut in [*cuts, len(body)]:
        out += scanner.feed(body[last:cut])
        last = cut
    assert scanner.done and scanner.extra == b""
    assert out + b"0\r\n\r\n" == body


def test_trailers_and_extensions() -> None:
    scanner = ChunkScanner()
    assert scanner.feed(b"5;ext=1\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n") == b"5;ext=1\r\nhello\r\n"
    assert scanner.done


@pytest.mark.parametrize(
    "bad",
    [
        b"zz\r\nhello\r\n",
        b"5\r\nhelloXX",
        b"-5\r\nhello\r\n",
        b"1" * 5000,
        b"0x5\r\nhello\r\n",
        b"1_0\r\n",
        b"5 5\r\n",
    ],
)
def test_bad_framing_raises(bad: bytes) -> None:
    with pytest.raises(ChunkedError):
        ChunkScanner().feed(bad)
