"""Reading an HTTP/1.1 chunked body as it arrives, strictly, so a proxy can relay it.

The router relays an engine's streamed answer to an HTTP/1.1 client in the
same chunked framing, so it needs no decoding and re-encoding per chunk: it
only has to check the framing and know where the body ends. Everything relayed
has been checked first, and a chunk's data goes out as it arrives (a 300 MiB
chunk is never held whole).

The framing is read strictly (RFC 9112 section 7.1; the lines' grammar is in `h1`): a
chunk-size line is 1 to 16 hex digits, then extensions `;name` or `;name=value` (a
token, or a quoted-string), then CRLF. No whitespace anywhere in it (the grammar's BWS
is for historical senders, and RFC 9112 forbids generating it), no bare LF, no other
control character. Trailer lines are `name:value` with no control character but tab,
each ending in CRLF; they are read and dropped. Anything else is a ChunkedError: a
client behind the router must never read framing that h11, llhttp and Python's
http.client could each split differently.

Bytes are copied only where a line began in one read and ends in the next: an
unfinished line is held (at most _MAX_LINE bytes, appended to, never re-joined), and
a read that holds nothing back is given on as it is.
"""

from __future__ import annotations

from llmgw_http.h1 import CHUNK_SIZE_LINE as _SIZE_LINE
from llmgw_http.h1 import TRAILER_LINE as _TRAILER_LINE

_MAX_LINE = 4096  # a chunk-size line, or all the trailers together

_SIZE, _DATA, _TRAILERS = 0, 1, 2


class ChunkedError(ValueError):
    """The body does not follow the chunked framing."""


class ChunkScanner:
    """Gives back each read's checked framing and data, for a relay in chunked framing.

    The terminating zero-size chunk and the trailers are not given back: the caller ends
    its own answer with `0\\r\\n\\r\\n`. `copied` counts the bytes this scanner copied.
    """

    __slots__ = ("_held", "_left", "_state", "_trailers", "copied", "done", "extra")

    def __init__(self) -> None:
        self._state = _SIZE
        self._left = 0  # in _DATA: the current chunk's bytes still to come, its CRLF included
        self._held = bytearray()  # a line begun in an earlier read: not relayed until checked
        self._trailers = 0  # trailer bytes read
        self.copied = 0
        self.done = False  # the last chunk and its trailers have been seen
        self.extra = b""  # bytes after the end of the body (a well-behaved peer sends none)

    @property
    def mid_chunk(self) -> bool:
        """Whether what was given back so far ends inside a chunk (its data or its CRLF)."""
        return self._state == _DATA

    def feed(self, data: bytes) -> bytes:
        """Take received bytes; return those that may be relayed, framing included."""
        return self._scan(data, None)

    def _scan(self, data: bytes, pieces: list[bytes] | None) -> bytes:
        """The state machine: with `pieces`, the chunks' data is appended there as well."""
        n = len(data)
        pos = 0
        prefix = b""  # a line held from an earlier read, completed by this one and relayed
        start = 0  # where the bytes relayed after `prefix` begin
        # Where the bytes that are not relayed begin (the last chunk, the trailers).
        cut = 0 if self._state == _TRAILERS else n
        if self._held:
            pos = self._complete_held(data)
            if pos < 0:
                return b""
            if self._state == _DATA:
                prefix = bytes(self._held)
                self.copied += len(prefix)
                start = pos
            else:
                cut = 0
            self._held.clear()
        size_line = _SIZE_LINE.fullmatch
        while pos < n and not self.done:
            state = self._state
            if state == _DATA:
                left = self._left
                stop = pos + left
                if stop > n:
                    stop = n
                # The CRLF that closes the chunk's data, where it lies in this read.
                cr = pos + left - 2
                if (pos <= cr < stop and data[cr] != 13) or (
                    pos <= cr + 1 < stop and data[cr + 1] != 10
                ):
                    raise ChunkedError("a chunk's data does not end with CRLF")
                if pieces is not None and cr > pos:
                    pieces.append(data[pos : min(cr, stop)])
                self._left = left - (stop - pos)
                pos = stop
                if not self._left:
                    self._state = _SIZE
                continue
            lf = data.find(b"\n", pos, pos + _MAX_LINE)
            if lf < 0:  # the line ends in a later read
                if state == _SIZE:
                    if n - pos >= _MAX_LINE:
                        raise ChunkedError("a chunk-size line is too long")
                    cut = pos
                self._hold(data[pos:])
                break
            if state == _TRAILERS:
                self._trailer(data, pos, lf + 1)
                if self.done:
                    self.extra = data[lf + 1 :]
                pos = lf + 1
                continue
            match = size_line(data, pos, lf + 1)
            if match is None:
                raise _bad_size_line(data, pos, lf + 1)
            size = int(match.group(1), 16)
            pos = lf + 1
            if not size:
                cut = match.start()
                self._state = _TRAILERS
                continue
            end = pos + size + 2
            if end <= n:  # the whole chunk is in this read: the common case
                if data[end - 2] != 13 or data[end - 1] != 10:
                    raise ChunkedError("a chunk's data does not end with CRLF")
                if pieces is not None:
                    pieces.append(data[pos : end - 2])
                pos = end
                continue
            self._left = size + 2
            self._state = _DATA
        if prefix:
            self.copied += len(prefix) + cut - start
            return prefix + data[start:cut]
        if cut < n:
            self.copied += cut
            return data[:cut]
        return data

    def _complete_held(self, data: bytes) -> int:
        """Completes the held line with the start of `data`: where `data` goes on after
        it, or -1 when this read does not end the line either (it is held too)."""
        lf = data.find(b"\n")
        if lf < 0:
            self._hold(data)
            return -1
        held = self._held
        held += data[: lf + 1]
        self.copied += 2 * (lf + 1)  # the slice, and its append
        if len(held) > _MAX_LINE:
            raise ChunkedError("a chunk-size line is too long")
        if self._state == _SIZE:
            size = _chunk_size(held, 0, len(held))
            if size:
                self._left = size + 2
                self._state = _DATA
            else:
                self._state = _TRAILERS
        else:
            self._trailers -= len(held) - lf - 1  # counted again as a whole line
            self._trailer(held, 0, len(held))
            if self.done:
                self.extra = data[lf + 1 :]
        return lf + 1

    def _hold(self, piece: bytes) -> None:
        self._held += piece
        self.copied += len(piece)
        if self._state == _TRAILERS:
            self._trailers += len(piece)
            if self._trailers > _MAX_LINE:
                raise ChunkedError("the trailers are too long")
        elif len(self._held) >= _MAX_LINE:
            raise ChunkedError("a chunk-size line is too long")

    def _trailer(self, buf: bytes | bytearray, start: int, end: int) -> None:
        """One line of the trailer section: a field, or the blank line that ends the body."""
        if end - start == 2 and buf[start] == 13:
            self.done = True
            return
        self._trailers += end - start
        if self._trailers > _MAX_LINE:
            raise ChunkedError("the trailers are too long")
        if _TRAILER_LINE.fullmatch(buf, start, end) is None:
            raise ChunkedError(f"bad trailer line {bytes(buf[start:end])[:40]!r}")


class ChunkDecoder:
    """Decodes a chunked body as it arrives: the data out, the framing and trailers dropped.

    Data is given back as soon as it is received, also from the middle of a chunk, so a
    large chunk is never held whole. The framing is checked as ChunkScanner checks it.
    """

    __slots__ = ("_scanner",)

    def __init__(self) -> None:
        self._scanner = ChunkScanner()

    @property
    def done(self) -> bool:
        return self._scanner.done

    @property
    def extra(self) -> bytes:
        return self._scanner.extra

    @extra.setter
    def extra(self, value: bytes) -> None:
        self._scanner.extra = value

    def feed(self, data: bytes) -> bytes:
        pieces: list[bytes] = []
        self._scanner._scan(data, pieces)
        return b"".join(pieces) if len(pieces) != 1 else pieces[0]


def _chunk_size(buf: bytes | bytearray, start: int, end: int) -> int:
    """The size in the chunk-size line buf[start:end] (its CRLF included)."""
    match = _SIZE_LINE.fullmatch(buf, start, end)
    if match is None:
        raise _bad_size_line(buf, start, end)
    return int(match.group(1), 16)


def _bad_size_line(buf: bytes | bytearray, start: int, end: int) -> ChunkedError:
    return ChunkedError(f"bad chunk-size line {bytes(buf[start:end])[:40]!r}")
