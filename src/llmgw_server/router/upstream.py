"""HTTP/1.1 to the engines, with keep-alive pools.

A pool opens its connections through a connector (llmgw_http.transport): real TCP,
read and written on the socket directly, unless a test gives it memory streams.

An `Exchange` is one request to one engine. The caller reads the response
head, then the body piece by piece as the engine writes it, and releases the
exchange: a connection that finished cleanly goes back to its pool, any
other is closed (so a cancelled client request closes its upstream at once).

Real engines close idle keep-alive connections without a word (uvicorn after
5 s, llama-server after 5 s and after every stream), so a pooled connection is
reused only while younger than the engine's idle limit and not already closed,
and a request that fails on a reused connection before a single byte of the
answer is sent again on a fresh one: that is the pool's race, not a failure of
the engine. Only what fails on a fresh connection reaches the caller.

The requests are written and the answers parsed by `llmgw_http.h1`, not by h11: the
router sends only requests it built itself, and reads only what it relays (status,
headers, framing), so a small parser of its own in front of the engines costs a fraction
of h11's per-event validation on every request and every chunk. It is stricter than h11
where the framing is concerned (an engine may be buggy or taken over): an answer h11
refuses is never relayed (tests/test_fuzz_engine_framing.py holds it to that).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable

import trio

from llmgw_core.catalog import Endpoint
from llmgw_http import coarse_timeouts
from llmgw_http.chunked import ChunkDecoder, ChunkedError, ChunkScanner
from llmgw_http.h1 import (
    MAX_RESPONSE_HEAD,
    RESPONSE_HEAD_END,
    BadHead,
    Framing,
    keep_alive_timeout,
    parse_response_head,
    request_bytes,
    response_framing,
)
from llmgw_http.transport import Connector, Transport, tcp_connect

_RECV = 65536
_MAX_IDLE = 256
# How soon after the request a silent close must come to be taken for a stale connection.
_STALE_WITHIN_S = 1.0
_MAX_INTERIM = 5  # 1xx answers before the final one; an engine sending more is broken


class UpstreamError(Exception):
    """The engine could not be reached, broke the connection, or spoke garbage."""

    def __init__(
        self,
        message: str,
        *,
        connect: bool = False,
        silent: bool = False,
        timed_out: bool = False,
        broken: bool = False,
        idle: bool = False,
    ) -> None:
        super().__init__(message)
        self.connect = connect  # nothing reached the engine
        self.silent = silent  # the connection closed before the engine sent a byte
        self.timed_out = timed_out  # no answer's head within the first-byte limit
        self.broken = broken  # the engine's bytes break HTTP's framing: never relayed on
        self.idle = idle  # the engine went silent mid-answer for read_idle_timeout_s


class _Conn:
    __slots__ = ("buf", "expired", "idle_since", "transport")

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.buf = b""  # received and not yet parsed
        self.idle_since = 0.0
        self.expired = False  # closed by its first-byte limit

    def cancel(self) -> None:
        """The first-byte limit is up (coarse_timeouts): closing the connection wakes the
        read or write waiting on it at once, with no cancel scope per request."""
        self.expired = True
        self.close()

    def closed_by_peer(self) -> bool:
        return self.transport.closed_by_peer()

    def close(self) -> None:
        self.transport.close()


class Pool:
    """Idle keep-alive connections to one engine."""

    def __init__(
        self,
        endpoint: Endpoint,
        connect_timeout_s: float,
        idle_timeout_s: float = 300.0,
        reuse_idle_s: float = 4.0,
        connect: Connector = tcp_connect,
    ) -> None:
        self.endpoint = endpoint
        self._connect_to = connect  # the seam: tests connect through memory streams
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s  # between reads, once the head has come
        # A connection idle longer than this is not reused; an engine's Keep-Alive
        # header lowers it (never raises it).
        self.reuse_idle_s = reuse_idle_s
        self._host = f"{endpoint.host}:{endpoint.port}".encode()
        self._prefix = endpoint.prefix.encode()
        self._auth = [(b"authorization", b"Bearer " + endpoint.api_key.encode())]
        if not endpoint.api_key:
            self._auth = []
        self._idle: list[_Conn] = []
        # Connections an exchange is using: cut at once where the replica is lost.
        self._busy: set[_Conn] = set()
        self.closed = False
        self.stale_retries = 0  # requests sent again after a reused connection failed

    @property
    def idle_connections(self) -> int:
        """Connections kept for reuse now."""
        return len(self._idle)

    def engine_keep_alive(self, timeout_s: float) -> None:
        """The engine announced its idle limit: stay a second inside it."""
        self.reuse_idle_s = min(self.reuse_idle_s, max(0.0, timeout_s - 1.0))

    async def _connect(self) -> _Conn:
        with trio.move_on_after(self.connect_timeout_s) as scope:
            try:
                transport = await self._connect_to(self.endpoint.host, self.endpoint.port)
            except OSError as exc:
                raise UpstreamError(
                    f"cannot connect to {self.endpoint}: {exc}", connect=True
                ) from None
        if scope.cancelled_caught:
            raise UpstreamError(f"connecting to {self.endpoint} timed out", connect=True)
        return _Conn(transport)

    def _give_back(self, conn: _Conn) -> None:
        if not self.closed and len(self._idle) < _MAX_IDLE and self.reuse_idle_s > 0:
            conn.idle_since = trio.current_time()
            self._idle.append(conn)
        else:
            conn.close()

    def _reusable(self) -> _Conn | None:
        """The most recently used idle connection the engine has not closed, if any."""
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.reuse_idle_s and not conn.closed_by_peer():
                return conn
            conn.close()
        return None

    def _stale(self) -> None:
        """A pooled connection was closed under a request: the older ones were too."""
        self.stale_retries += 1
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def open(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        first_byte_s: float = math.inf,
    ) -> Exchange:
        """Send a request and read the response head; the body is read from the Exchange.

        The head must come within `first_byte_s` of this call (a new connection's
        connecting aside: it has its own limit), else UpstreamError with `timed_out`.
        """
        due = trio.current_time() + first_byte_s
        head = [
            (b"host", self._host),
            *headers,
            *self._auth,
            (b"content-length", str(len(body)).encode()),
        ]
        wire = request_bytes(method, self._prefix + target, head, body)
        conn = self._reusable()
        if conn is not None:
            exchange = await self._on_pooled(conn, method, wire, due, first_byte_s)
            if exchange is not None:
                return exchange
        return await self._on_new(method, wire, due, first_byte_s)

    async def _on_pooled(
        self, conn: _Conn, method: bytes, wire: bytes, due: float, first_byte_s: float
    ) -> Exchange | None:
        """The request on an idle pooled connection: its exchange, or None where the
        engine had closed that connection before it was used (sent again on a new one)."""
        exchange = Exchange(self, conn, method)
        sent_at: float | None = None
        coarse_timeouts.arm(conn, due)
        try:
            unsent = self._send(conn, wire)
            sent_at = trio.current_time()
            await exchange.read_head(unsent)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            exchange.release()
            if conn.expired:
                raise self._no_answer(first_byte_s) from None
            self._stale()  # the engine had closed this idle connection
        except UpstreamError as exc:
            exchange.release()
            if conn.expired:
                raise self._no_answer(first_byte_s) from None
            # A close that answers the request at once is the engine's idle timer;
            # one that comes later may follow work done, and is not sent again.
            late = sent_at is not None and trio.current_time() - sent_at > _STALE_WITHIN_S
            if not exc.silent or late:
                raise
            self._stale()  # closed before a single byte: not a failure of the engine
        except BaseException:  # cancelled (the client went away): close now
            exchange.release()
            raise
        else:
            return exchange
        finally:
            coarse_timeouts.disarm(conn)
        return None

    async def _on_new(
        self, method: bytes, wire: bytes, due: float, first_byte_s: float
    ) -> Exchange:
        """The request on a new connection."""
        conn = await self._connect()
        exchange = Exchange(self, conn, method)
        coarse_timeouts.arm(conn, due)
        try:
            try:
                unsent = self._send(conn, wire)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise UpstreamError(
                    f"sending to {self.endpoint} failed: {exc}", connect=True
                ) from None
            try:
                await exchange.read_head(unsent)
            except UpstreamError:
                if conn.expired:
                    raise self._no_answer(first_byte_s) from None
                raise
        except BaseException:
            exchange.release()
            raise
        finally:
            coarse_timeouts.disarm(conn)
        return exchange

    def _no_answer(self, first_byte_s: float) -> UpstreamError:
        return UpstreamError(
            f"{self.endpoint} sent no answer within {first_byte_s:g} s", timed_out=True
        )

    @staticmethod
    def _send(conn: _Conn, wire: bytes) -> memoryview | None:
        """Writes what the kernel takes at once; the rest (None: nothing) is sent while
        the answer is read (Exchange.read_head)."""
        sent = conn.transport.send_now(wire)
        return None if sent == len(wire) else memoryview(wire)[sent:]

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    def cut(self) -> None:
        """Close the connections in use too: their engine is gone (a lost replica), and a
        stream read from one breaks now rather than after read_idle_timeout_s of silence
        (a router's continuation then takes it elsewhere)."""
        self.close()
        for conn in list(self._busy):
            conn.close()


class Exchange:
    """One request's answer, read from its connection as the caller asks for it."""

    __slots__ = (
        "_conn",
        "_done",
        "_framing",
        "_head_only",
        "_length",
        "_pool",
        "_received",
        "_scanner",
        "content_length",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self, pool: Pool, conn: _Conn, method: bytes = b"POST") -> None:
        pool._busy.add(conn)
        self._pool = pool
        self._conn = conn
        self._head_only = method == b"HEAD"
        self._done = False  # the whole answer was read, and nothing after it
        self._framing: Framing | None = None  # known once the head is read
        self._length = 0
        self.keep_alive = False
        self._received = 0
        self._scanner: ChunkScanner | None = None  # relay_chunks's, once it runs
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # The body's length where the engine's Content-Length frames it: the one the
        # router may relay (never with Transfer-Encoding, never for 204 or 304).
        self.content_length: int | None = None

    async def _receive(self) -> bytes:
        """One read; after the head, an engine that stays silent too long has stalled."""
        transport = self._conn.transport
        try:
            if not self.status:  # the head: the router's first-byte timeout applies
                # Just sent (or the head came in part): the engine's answer cannot be
                # there yet, so the wait comes first, not a read bound to fail.
                data = await transport.receive_some(_RECV, wait_first=True)
            else:
                try:  # a cancel scope only where a wait is due
                    data = transport.receive_now(_RECV)
                except BlockingIOError:
                    idle = self._pool.idle_timeout_s
                    with coarse_timeouts.move_on_after(idle):
                        data = await transport.receive_some(_RECV, wait_first=True)
                        self._received += len(data)
                        return data
                    raise UpstreamError(
                        f"{self._pool.endpoint} sent nothing for {idle:g} s", idle=True
                    ) from None
                else:
                    await trio.lowlevel.cancel_shielded_checkpoint()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError(
                f"{self._pool.endpoint} broke the connection: {exc}", silent=not self._received
            ) from None
        self._received += len(data)
        return data

    async def read_head(self, unsent: memoryview | None = None) -> None:
        """Reads the answer's head, interim answers (1xx) skipped; with `unsent`, the rest
        of the request is sent meanwhile."""
        if unsent is None:
            await self._read_head()
            return
        # The request did not fit the socket's buffer: the engine may answer before it
        # reads it all (a 413 for a body too big), so the rest is sent while the answer
        # is read, and a send that fails (the engine closed after answering) is no error
        # of its own: the answer, or the lack of one, tells.
        failure: BaseException | None = None
        sent_whole = False

        async def send_rest() -> None:
            nonlocal sent_whole
            try:
                await self._conn.transport.send_all(unsent)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            sent_whole = True  # before any answer to it can be read: no checkpoint between

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_rest)
            try:
                await self._read_head()
            except BaseException as exc:  # raised after the nursery, not in a group
                failure = exc
            nursery.cancel_scope.cancel()  # an early answer: the rest is not sent
        if not sent_whole:  # the engine got part of the request: the connection is done
            self.keep_alive = False
        if failure is not None:
            raise failure

    async def _read_head(self) -> None:
        endpoint = self._pool.endpoint
        interim = 0
        while True:
            try:
                status, http11, headers = parse_response_head(await self._head_bytes())
            except BadHead as exc:
                raise UpstreamError(f"{endpoint} answered garbage: {exc}", broken=True) from None
            if not 100 <= status < 200:
                break
            # Informational (100 Continue): the answer follows.
            if status == 101:
                raise UpstreamError(
                    f"{endpoint} answered garbage: an unasked protocol switch", broken=True
                )
            interim += 1
            if interim > _MAX_INTERIM:
                raise UpstreamError(
                    f"{endpoint} answered garbage: more than {_MAX_INTERIM} interim answers",
                    broken=True,
                )
        self._take_head(status, http11, headers)

    async def _head_bytes(self) -> bytes:
        """The next head, up to its blank line; what follows stays in the connection's
        buffer."""
        conn = self._conn
        endpoint = self._pool.endpoint
        buf: bytes | bytearray = conn.buf
        searched = 0  # where the search for the blank line goes on
        while (end := RESPONSE_HEAD_END.search(buf, searched)) is None:
            if len(buf) > MAX_RESPONSE_HEAD:
                raise UpstreamError(
                    f"{endpoint} answered garbage: the head is too long", broken=True
                )
            searched = max(0, len(buf) - 3)
            data = await self._receive()
            if not data:
                if not buf:
                    raise UpstreamError(
                        f"{endpoint} closed the connection without answering",
                        silent=not self._received,
                    )
                raise UpstreamError(
                    f"{endpoint} answered garbage: it closed within the head", broken=True
                )
            if not buf:
                buf = data
            else:  # a head in pieces: appended, never joined again
                if isinstance(buf, bytes):
                    buf = bytearray(buf)
                buf += data
        conn.buf = bytes(buf[end.end() :])
        return bytes(buf[: end.start()])

    def _take_head(self, status: int, http11: bool, headers: list[tuple[bytes, bytes]]) -> None:
        """The answer's head read: its status, headers, whether the connection is kept,
        and how its body is framed."""
        endpoint = self._pool.endpoint
        conn = self._conn
        self.status = status
        self.headers = headers
        self.keep_alive = http11 and not any(
            k == b"connection" and b"close" in v.lower() for k, v in headers
        )
        timeout = keep_alive_timeout(headers)
        if timeout is not None:
            self._pool.engine_keep_alive(timeout)
        try:
            framing = response_framing(status, headers, self._head_only)
            self._framing, self._length, reusable = framing
        except BadHead as exc:
            raise UpstreamError(f"{endpoint} answered garbage: {exc}", broken=True) from None
        if not reusable:
            self.keep_alive = False
        if self._framing == "close":
            self.keep_alive = False
        elif self._framing == "length":
            if not (self._head_only or status in (204, 304)):
                self.content_length = self._length
            if not self._length:
                self._finish(conn.buf)

    def _finish(self, extra: bytes) -> None:
        self._done = not extra  # bytes after the answer: the connection is not reused
        self._conn.buf = b""

    @property
    def chunked(self) -> bool:
        return self._framing == "chunked"

    @property
    def mid_chunk(self) -> bool:
        """Whether relay_chunks gave on part of a chunk, and not the rest of it."""
        return self._scanner is not None and self._scanner.mid_chunk

    async def body(self) -> AsyncIterator[bytes]:
        """The decoded body, as the engine sends it; pieces already received come out joined."""
        conn = self._conn
        endpoint = self._pool.endpoint
        if self._framing == "length":
            left = self._length
            if not left:  # finished with the head
                return
            data, conn.buf = conn.buf, b""
            while left:
                if data:
                    piece, extra = data[:left], data[left:]
                    left -= len(piece)
                    if not left:
                        self._finish(extra)
                    yield piece
                    if not left:
                        return
                data = await self._receive()
                if not data:
                    raise UpstreamError(f"{endpoint} closed the connection mid-answer")
            return
        if self._framing == "close":
            data, conn.buf = conn.buf, b""
            while True:
                if data:
                    yield data
                data = await self._receive()
                if not data:
                    self._done = True
                    return
        decoder = ChunkDecoder()
        data, conn.buf = conn.buf, b""
        while True:
            if data:
                try:
                    piece = decoder.feed(data)
                except ChunkedError as exc:
                    raise UpstreamError(
                        f"{endpoint} answered garbage: {exc}", broken=True
                    ) from None
                if decoder.done:
                    self._finish(decoder.extra)
                if piece:
                    yield piece
                if decoder.done:
                    return
            data = await self._receive()
            if not data:
                raise UpstreamError(f"{endpoint} closed the connection mid-answer")

    async def relay_chunks(
        self,
        send: Callable[[bytes], Awaitable[None]],
        keep: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """A chunked body with its framing, checked and undecoded, the last chunk left out,
        each read's worth given to `send` as it comes (a chunk's data too, as it comes).

        The router relays these as they are to an HTTP/1.1 client: no decoding and
        re-encoding per chunk, and one write per read from the engine. One cancel scope
        times the engine's silence for the whole body, armed again (coarse_timeouts)
        before a read once a tick has passed since the last arming, for a tick more than
        the limit: never early. A client that reads nothing for as long is cut off as gone.
        """
        scanner = self._scanner = ChunkScanner()
        conn = self._conn
        receive = conn.transport.receive_some
        data, conn.buf = conn.buf, b""
        endpoint = self._pool.endpoint
        idle = self._pool.idle_timeout_s
        sending = False
        tick = coarse_timeouts.TICK_S
        armed_at = trio.current_time()
        with coarse_timeouts.move_on_after(idle + tick) as silence:
            while True:
                if data:
                    try:
                        ready = scanner.feed(data)
                    except ChunkedError as exc:
                        raise UpstreamError(
                            f"{endpoint} broke the chunked framing: {exc}", broken=True
                        ) from None
                    if ready:
                        if keep is not None:  # a stream kept for a continuation
                            ready = keep(ready)  # what goes on: the same bytes, or as long
                        sending = True
                        await send(ready)
                        sending = False
                    if scanner.done:
                        self._finish(scanner.extra)
                        return
                # An engine writes an event at a time: after a short read the next one
                # would find nothing, so the wait comes first.
                drained = len(data) < _RECV
                now = trio.current_time()
                if now - armed_at >= tick:
                    coarse_timeouts.arm(silence, now + idle + tick)
                    armed_at = now
                try:
                    data = await receive(_RECV, wait_first=drained)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise UpstreamError(f"{endpoint} broke the connection: {exc}") from None
                if not data:
                    raise UpstreamError(f"{endpoint} closed the connection mid-answer")
        if sending:
            raise trio.BrokenResourceError(f"the client read nothing for {idle:g} s")
        raise UpstreamError(f"{endpoint} sent nothing for {idle:g} s", idle=True)

    async def read_body(self, limit: int) -> bytes:
        conn = self._conn
        length = self._length
        if self._framing == "length" and 0 < length <= min(limit, len(conn.buf)):
            # The whole answer came with its head, as a small one does: no read to wait for.
            body = conn.buf[:length]
            self._finish(conn.buf[length:])
            return body
        parts: list[bytes] = []
        size = 0
        async for data in self.body():
            size += len(data)
            if size > limit:
                raise UpstreamError(f"{self._pool.endpoint} answered more than {limit} bytes")
            parts.append(data)
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def release(self) -> None:
        """Back to the pool if the exchange finished cleanly, otherwise closed."""
        self._pool._busy.discard(self._conn)
        if self._done and self.keep_alive:
            self._pool._give_back(self._conn)
        else:
            self._conn.close()
