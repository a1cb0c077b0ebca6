"""Finding whole chunks in an HTTP/1.1 chunked body, so a proxy can relay them undecoded.

The router relays an engine's streamed answer to an HTTP/1.1 client in the
same chunked framing, so it needs no decoding and re-encoding per chunk: it
only has to know where whole chunks end (to forward nothing half-written) and
where the body ends.
"""

from __future__ import annotations

import re

_MAX_LINE = 4096
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")  # what h11 accepts too: no 0x, _, signs or spaces


class ChunkedError(ValueError):
    """The body does not follow the chunked framing."""


class ChunkScanner:
    def __init__(self) -> None:
        self._buf = b""
        self.done = False  # the last chunk and its trailers have been seen
        self.extra = b""  # bytes after the end of the body (a well-behaved peer sends none)

    def feed(self, data: bytes) -> bytes:
        """Take received bytes; return the whole data chunks they complete, framing included.

        The terminating zero-size chunk is not returned: the caller ends its own
        response with one.
        """
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        while True:
            header = _size_line(buf, pos)
            if header is None:
                break
            size, line_end = header
            if size == 0:
                end = buf.find(b"\r\n\r\n", line_end)
                if end < 0:
                    if n - line_end > _MAX_LINE:
                        raise ChunkedError("the trailers are too long")
                    break
                self.done = True
                self.extra = buf[end + 4 :]
                self._buf = b""
                return buf[:pos]
            end = line_end + 2 + size + 2
            if end > n:
                break
            if buf[end - 2 : end] != b"\r\n":
                raise ChunkedError("a chunk does not end with CRLF")
            pos = end
        self._buf = buf[pos:]
        return buf[:pos]


class ChunkDecoder:
    """Decodes a chunked body as it arrives: the data out, the framing and trailers dropped.

    Data is given back as soon as it is received, also from the middle of a chunk, so a
    large chunk is never held whole.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # data bytes of the current chunk still to come
        self._crlf = False  # the CRLF that closes a chunk's data is due
        self._trailers_from = -1  # >= 0: the last chunk was seen, trailers are being read
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        pos = 0
        n = len(buf)
        out: list[bytes] = []
        while not self.done:
            if self._left:
                take = min(self._left, n - pos)
                if take:
                    out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if n - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ChunkedError("a chunk does not end with CRLF")
                pos += 2
                self._crlf = False
            if self._trailers_from >= 0:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > _MAX_LINE:
                        raise ChunkedError("the trailers are too long")
                    break
                self.done = True
                self.extra = buf[end + 4 :]
                pos = n
                break
            header = _size_line(buf, pos)
            if header is None:
                break
            size, line_end = header
            if size == 0:
                # The CRLF ending the size line may be the blank line that ends the body.
                self._trailers_from = pos = line_end
                continue
            pos = line_end + 2
            self._left = size
        self._buf = buf[pos:] if not self.done else b""
        return b"".join(out) if len(out) != 1 else out[0]


def _size_line(buf: bytes, pos: int) -> tuple[int, int] | None:
    """The chunk size in the line at `pos` and where that line ends (its CRLF); None
    while the line is incomplete. Raises ChunkedError for a bad or overlong line."""
    line_end = buf.find(b"\r\n", pos, pos + _MAX_LINE)
    if line_end < 0:
        if len(buf) - pos >= _MAX_LINE:
            raise ChunkedError("a chunk header line is too long")
        return None
    head = buf[pos:line_end]
    semi = head.find(b";")
    size_text = (head if semi < 0 else head[:semi]).strip()
    if not _HEX.fullmatch(size_text):
        raise ChunkedError(f"bad chunk size {size_text[:20]!r}")
    return int(size_text, 16), line_end
