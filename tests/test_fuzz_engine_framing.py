"""Engine answers framed as h11 frames them, or refused (a differential fuzz test).

Hypothesis writes an engine's answer from a grammar with hostile variants in every
place that frames it (interim answers, the status, Content-Length and
Transfer-Encoding, chunk-size lines, the CRLF after a chunk's data, trailers), cut into
random reads. The router's Exchange reads it as the router's relay does (relay_chunks
for a chunked body, whose output is what the client gets, ended with the router's own
last chunk; the decoded body otherwise), and h11's client reads the same bytes:

- nothing h11 refuses is relayed: the Exchange raises UpstreamError (a 502 or an
  aborted stream);
- whatever both accept is the same answer: the same status and body, the length the
  router would relay is the body's, and the relayed chunked framing is itself read
  by h11 to that body;
- an answer written without any hostile variant is accepted (the test is not vacuous).
"""

from __future__ import annotations

import attrs
import h11
import trio
import trio.testing
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.catalog import Endpoint
from llmgw_http.transport import Transport, memory_pair
from llmgw_server.router.upstream import Pool, UpstreamError


@attrs.frozen
class Read:
    status: int
    body: bytes
    length: int | None = None  # the Content-Length the router would relay


def h11_reads(wire: bytes) -> Read | None:
    """What h11's client reads from `wire` and a close; None where it refuses the bytes."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(wire)
    conn.receive_data(b"")
    status, body = 0, b""
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Read(status, body)
            elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return None
    except h11.RemoteProtocolError:
        return None


async def exchange_reads(pieces: list[bytes]) -> Read | None:
    """What the router's Exchange relays; None where it refuses the answer."""
    ours, engine = memory_pair()

    async def connect(host: str, port: int) -> Transport:
        return ours

    pool = Pool(Endpoint("127.0.0.1", 1), 1.0, connect=connect)
    relayed: list[bytes] = []
    result: list[Read | None] = []

    async def send(framed: bytes) -> None:
        relayed.append(bytes(framed))

    async def read() -> None:
        try:
            exchange = await pool.open(b"POST", b"/", [], b"")
        except UpstreamError:
            result.append(None)
            return
        try:
            if exchange.chunked:
                await exchange.relay_chunks(send)
                framed = b"".join(relayed) + b"0\r\n\r\n"
                # The client reads the router's framing: it must be well formed.
                decoded = h11_reads(b"HTTP/1.1 200 \r\ntransfer-encoding: chunked\r\n\r\n" + framed)
                assert decoded is not None, framed
                body = decoded.body
            else:
                body = b"".join([data async for data in exchange.body()])
        except UpstreamError:
            result.append(None)
            return
        finally:
            exchange.release()
        result.append(Read(exchange.status, body, exchange.content_length))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            try:
                for piece in pieces:
                    await engine.send_all(piece)
                    await trio.testing.wait_all_tasks_blocked()
                await engine.send_eof()
            except trio.BrokenResourceError:
                pass  # the router refused the answer and closed the connection
    await engine.aclose()
    pool.close()
    return result[0]


@attrs.define
class Writer:
    """Builds an answer, noting whether any hostile variant went into it."""

    draw: st.DrawFn
    hostile: bool = False

    def pick(self, good: bytes, bad: list[bytes]) -> bytes:
        if self.draw(st.integers(0, 5)) == 0:
            self.hostile = True
            return self.draw(st.sampled_from(bad))
        return good


def chunk_line(w: Writer, size: int) -> bytes:
    digits = w.pick(b"%x" % size, [b"%X" % size, b"00%x" % size, b"0x%x" % size, b"+%x" % size,
                                   b" %x" % size, b"%x " % size, b"%x_" % size, b""])
    ext = w.draw(st.sampled_from([b"", b";a", b";a=b", b';a="q \\" r"', b";a;b=c"]))
    ext = w.pick(ext, [b";", b";a b", b";a=", b";a=b c", b' ;a', b';a="x', b";\x01",
                       b";a\x0bb", b";a\x0c", b";a\rb", b";a\nb", b"\t"])
    end = w.pick(b"\r\n", [b"\n", b"\r", b"\r\r\n", b"\x0b\r\n", b"\n\r\n"])
    return digits + ext + end  # fmt: skip


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, bool]:
    """An engine's answer as bytes, and whether a hostile variant went into it."""
    w = Writer(draw)
    interim = draw(st.integers(0, 7))
    if interim > 5:
        w.hostile = True
    wire = b"HTTP/1.1 100 Continue\r\n\r\n" * interim
    status = w.pick(draw(st.sampled_from([b"200", b"201", b"404", b"429", b"500"])),
                    [b"099", b"000", b"600", b"999", b"20", b"2000", b"-20"])  # fmt: skip
    wire += b"HTTP/1.1 " + status + b" X\r\ncontent-type: text/event-stream\r\n"
    pieces = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=4))
    body = b"".join(pieces)
    framing = draw(st.sampled_from(["chunked", "length", "close"]))
    n = len(body)
    if framing == "length" or (framing == "chunked" and draw(st.integers(0, 5)) == 0):
        values = [b"%d" % n, b"%d, %d" % (n, n), b"+%d" % n, b"%d" % (n + 1), b"1" * 25,
                  b"%d %d" % (n, n), b"0x%x" % n, b"-%d" % n, b""]  # fmt: skip
        wire += b"content-length: " + w.pick(values[0], values[1:]) + b"\r\n"
        if w.draw(st.integers(0, 9)) == 0:
            w.hostile = True
            wire += b"content-length: %d\r\n" % n  # a second one
    if framing == "chunked":
        te = w.pick(b"chunked", [b"gzip", b"chunked, chunked", b"gzip, chunked", b"identity"])
        wire += b"transfer-encoding: " + te + b"\r\n"
    wire += b"\r\n"
    if framing != "chunked":
        return wire + body, w.hostile
    for piece in pieces:
        wire += chunk_line(w, len(piece)) + piece
        wire += w.pick(b"\r\n", [b"\n", b"", b"\r", b"XY", b"\r\r\n"])
    wire += chunk_line(w, 0)
    for _ in range(draw(st.integers(0, 2))):
        wire += w.pick(b"x-t: 1\r\n", [b"x t: 1\r\n", b"x-t: 1\n", b" folded\r\n", b"x-t: \x01\r\n",
                                       b": 1\r\n"])  # fmt: skip
    wire += w.pick(b"\r\n", [b"\n", b"", b"\r"])
    return wire, w.hostile


@settings(max_examples=profile_times(4), deadline=None)
@given(answers(), st.data())
def test_engine_answers_are_relayed_as_h11_reads_them_or_refused(
    answer: tuple[bytes, bool], data: st.DataObject
) -> None:
    wire, hostile = answer
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(wire) - 1)), max_size=5))))
    pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
    theirs = h11_reads(wire)
    ours = trio.run(exchange_reads, pieces)
    h11_says = "refuses" if theirs is None else "reads"
    event(f"h11 {h11_says}, the router {'refuses' if ours is None else 'relays'}")
    if theirs is None:
        assert ours is None, (wire, ours)  # nothing h11 refuses is relayed
        return
    if ours is None:
        assert hostile, wire  # refused only where the answer was written to be hostile
        return
    assert (ours.status, ours.body) == (theirs.status, theirs.body), wire
    if ours.length is not None:
        assert ours.length == len(ours.body), wire
