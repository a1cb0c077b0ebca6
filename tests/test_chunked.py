"""The chunk scanner against h11's own chunked encoding, split at every byte."""

from __future__ import annotations

import tracemalloc

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_http.chunked import ChunkDecoder, ChunkedError, ChunkScanner


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


def feed_all(scanner: ChunkScanner | ChunkDecoder, wire: bytes, step: int) -> bytes:
    out = []
    for i in range(0, len(wire), step):
        if scanner.done:
            break
        out.append(scanner.feed(wire[i : i + step]))
    return b"".join(out)


# Each of these reached the client before (the scanner stripped LF, VT, FF and spaces
# around the size and relayed any extension up to the first CRLF); h11 refuses most.
SMUGGLED = b"0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged"


@pytest.mark.parametrize(
    "line",
    [
        b"4e;x\n",  # a bare LF ends the line for http.client
        b"5\n",
        b"5\x0b\r\n",
        b"5\x0c\r\n",
        b" 5\r\n",
        b"5 \r\n",
        b"5\t\r\n",
        b"5 ;a\r\n",
        b"5;\r\n",
        b"5;a b\r\n",
        b"5;a=\r\n",
        b"5;a=b c\r\n",
        b'5;a="open\r\n',
        b"5;a\x00\r\n",
        b"5\r\r\n",
        b"5;a\rb\r\n",
        b"12345678901234567\r\n",  # 17 hex digits
    ],
)
@pytest.mark.parametrize("step", [1, 3, 1 << 16])
def test_a_loose_chunk_size_line_is_refused_however_it_is_split(line: bytes, step: int) -> None:
    wire = line + b"hello\r\n" + SMUGGLED
    scanner = ChunkScanner()
    with pytest.raises(ChunkedError):
        out = feed_all(scanner, wire, step)
        # Nothing of the line itself may have been relayed before the error.
        assert not out
    with pytest.raises(ChunkedError):
        feed_all(ChunkDecoder(), wire, step)


@pytest.mark.parametrize(
    "trailers",
    [b"x y: 1\r\n\r\n", b"x: 1\n\r\n", b"x: 1\r\n\n", b"x: a\x0bb\r\n\r\n", b": 1\r\n\r\n"],
)
def test_loose_trailers_are_refused(trailers: bytes) -> None:
    with pytest.raises(ChunkedError):
        feed_all(ChunkScanner(), b"5\r\nhello\r\n0\r\n" + trailers, 1 << 16)


@pytest.mark.parametrize("step", [1, 2, 5, 1 << 16])
def test_extensions_by_the_grammar_are_relayed_as_they_are(step: int) -> None:
    lines = b'5;a;b=c;q="x \\" y"\r\nhello\r\n' + b"0000000000000003;z=1\r\nabc\r\n"
    scanner = ChunkScanner()
    assert feed_all(scanner, lines + b"0;last\r\nx-t: 1\r\n\r\nEXTRA", step) == lines
    assert scanner.done
    decoder = ChunkDecoder()
    assert feed_all(decoder, lines + b"0\r\n\r\n", step) == b"helloabc"


def test_a_big_chunk_goes_out_as_it_arrives() -> None:
    scanner = ChunkScanner()
    assert scanner.feed(b"100000\r\n" + b"a" * 1000) == b"100000\r\n" + b"a" * 1000
    assert scanner.mid_chunk
    assert scanner.feed(b"b" * 2000) == b"b" * 2000
    piece = b"c" * (0x100000 - 3000)
    assert scanner.feed(piece + b"\r") == piece + b"\r"
    assert scanner.feed(b"\n0\r\n\r\n") == b"\n"
    assert scanner.done and not scanner.mid_chunk
    with pytest.raises(ChunkedError, match="CRLF"):
        ChunkScanner().feed(b"3\r\nabc\rX")
    lone = ChunkScanner()
    lone.feed(b"3\r\nabc\r")
    with pytest.raises(ChunkedError, match="CRLF"):
        lone.feed(b"X")


def test_a_300_mib_chunk_streams_through_in_bounded_memory() -> None:
    read = b"x" * 65536
    size = 300 << 20
    scanner = ChunkScanner()
    tracemalloc.start()
    try:
        relayed = len(scanner.feed(b"%x\r\n" % size))
        for _ in range(size // len(read)):
            relayed += len(scanner.feed(read))
        relayed += len(scanner.feed(b"\r\n0\r\n\r\n"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert scanner.done and relayed == len(b"%x\r\n" % size) + size + 2
    assert peak < 1 << 20, peak  # the old scanner held the whole chunk


def sse_wire(total: int, event: int) -> bytes:
    data = b"d" * event
    return (b"%x\r\n%b\r\n" % (len(data), data)) * (total // (event + 8)) + b"0\r\n\r\n"


@pytest.mark.parametrize("step", [1, 7, 4096, 65536])
def test_bytes_copied_are_linear_in_body_and_chunk_size(step: int) -> None:
    """The scanner counts what it copies: at most a small multiple of the body, whatever
    the chunk size and however the reads cut it (the old one re-joined its whole
    unfinished chunk with every read: quadratic in the chunk size)."""
    for total in (1 << 14, 1 << 16) if step < 8 else (1 << 16, 1 << 18, 1 << 20):
        for event in (1, 60, 4000, total):
            wire = sse_wire(total, event)
            scanner = ChunkScanner()
            relayed = feed_all(scanner, wire, step)
            assert scanner.done and relayed + b"0\r\n\r\n" == wire
            # A line cut by a read is held (its bytes copied twice), and given on joined
            # with the rest of its read (at most a read's bytes): at most 4 times the body.
            assert scanner.copied <= 4 * len(wire), (total, event, step)
            if event == total:  # one chunk: its data is never copied, whatever its size
                assert scanner.copied <= 2 * step + 64, (total, step)
