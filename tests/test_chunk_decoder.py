"""The streaming chunk decoder (the router's client side) against h11's chunked encoding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_http.chunked import ChunkDecoder, ChunkedError
from test_chunked import encode


@given(
    st.lists(st.binary(min_size=1, max_size=50), max_size=8),
    st.binary(max_size=5),
    st.data(),
)
def test_the_body_comes_out_whole_however_the_bytes_are_split(
    chunks: list[bytes], extra: bytes, data: st.DataObject
) -> None:
    wire = encode(chunks) + extra
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    decoder = ChunkDecoder()
    out = b""
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        if not decoder.done:
            out += decoder.feed(wire[a:b])
        else:
            decoder.extra += wire[a:b]
    assert decoder.done
    assert out == b"".join(chunks)
    assert decoder.extra == extra


def test_data_comes_out_before_its_chunk_is_complete() -> None:
    decoder = ChunkDecoder()
    assert decoder.feed(b"10\r\nabcd") == b"abcd"
    assert decoder.feed(b"efghijklmnop\r\n0\r\n") == b"efghijklmnop"
    assert not decoder.done
    assert decoder.feed(b"x-trailer: 1\r\n\r\n") == b""
    assert decoder.done


@pytest.mark.parametrize("wire", [b"zz\r\n", b"3\r\nabcXY", b"-1\r\n", b"0x3\r\nabc\r\n"])
def test_broken_framing_is_an_error(wire: bytes) -> None:
    with pytest.raises(ChunkedError):
        ChunkDecoder().feed(wire)
