"""HTTP/1.1 to the engines: h11 on trio streams, with keep-alive pools.

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
"""

from __future__ import annotations

import select
from collections.abc import AsyncIterator

import h11
import trio

from llmgw_core.catalog import Endpoint
from llmgw_core.chunked import ChunkedError, ChunkScanner

_RECV = 65536
_MAX_IDLE = 256
# How soon after the request a silent close must come to be taken for a stale connection.
_STALE_WITHIN_S = 1.0


class UpstreamError(Exception):
    """The engine could not be reached, broke the connection, or spoke garbage."""

    def __init__(self, message: str, *, connect: bool = False, silent: bool = False) -> None:
        super().__init__(message)
        self.connect = connect  # nothing reached the engine
        self.silent = silent  # the connection closed before the engine sent a byte


class _Conn:
    __slots__ = ("h11", "idle_since", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def closed_by_peer(self) -> bool:
        """An idle connection has nothing to read unless the engine closed it (or broke)."""
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))


def keep_alive_timeout(headers: list[tuple[bytes, bytes]]) -> float | None:
    """The `timeout=N` of a `Keep-Alive` response header, if the engine sent one."""
    for key, value in headers:
        if key == b"keep-alive":
            for part in value.split(b","):
                name, _, number = part.strip().partition(b"=")
                if name.strip().lower() == b"timeout":
                    try:
                        timeout = float(number.strip())
                    except ValueError:
                        return None
                    return timeout if timeout >= 0 else None
    return None


class Pool:
    """Idle keep-alive connections to one engine."""

    def __init__(
        self,
        endpoint: Endpoint,
        connect_timeout_s: float,
        idle_timeout_s: float = 300.0,
        reuse_idle_s: float = 4.0,
    ) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s  # between reads, once the head has come
        # A connection idle longer than this is not reused; an engine's Keep-Alive
        # header lowers it (never raises it).
        self.reuse_idle_s = reuse_idle_s
        self._host = f"{endpoint.host}:{endpoint.port}".encode()
        self._auth = [(b"authorization", b"Bearer " + endpoint.api_key.encode())]
        if not endpoint.api_key:
            self._auth = []
        self._idle: list[_Conn] = []
        self.closed = False
        self.stale_retries = 0  # requests sent again after a reused connection failed

    def engine_keep_alive(self, timeout_s: float) -> None:
        """The engine announced its idle limit: stay a second inside it."""
        self.reuse_idle_s = min(self.reuse_idle_s, max(0.0, timeout_s - 1.0))

    async def _connect(self) -> _Conn:
        with trio.move_on_after(self.connect_timeout_s) as scope:
            try:
                stream = await trio.open_tcp_stream(self.endpoint.host, self.endpoint.port)
            except OSError as exc:
                raise UpstreamError(
                    f"cannot connect to {self.endpoint}: {exc}", connect=True
                ) from None
        if scope.cancelled_caught:
            raise UpstreamError(f"connecting to {self.endpoint} timed out", connect=True)
        return _Conn(stream)

    def _give_back(self, conn: _Conn) -> None:
        if not self.closed and len(self._idle) < _MAX_IDLE and self.reuse_idle_s > 0:
            conn.idle_since = trio.current_time()
            self._idle.append(conn)
        else:
            conn.stream.socket.close()

    def _reusable(self) -> _Conn | None:
        """The most recently used idle connection the engine has not closed, if any."""
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.reuse_idle_s and not conn.closed_by_peer():
                return conn
            conn.stream.socket.close()
        return None

    def _stale(self) -> None:
        """A pooled connection was closed under a request: the older ones were too."""
        self.stale_retries += 1
        for conn in self._idle:
            conn.stream.socket.close()
        self._idle.clear()

    async def open(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Exchange:
        """Send a request and read the response head; the body is read from the Exchange."""
        head = [
            (b"host", self._host),
            *headers,
            *self._auth,
            (b"content-length", str(len(body)).encode()),
        ]
        target = self.endpoint.prefix.encode() + target
        conn = self._reusable()
        if conn is not None:
            exchange = Exchange(self, conn)
            sent_at: float | None = None
            try:
                await self._send(exchange._conn, method, target, head, body)
                sent_at = trio.current_time()
                await exchange.read_head()
            except (trio.BrokenResourceError, OSError, h11.LocalProtocolError):
                exchange.release()  # the engine had closed this idle connection
                self._stale()
            except UpstreamError as exc:
                exchange.release()
                # A close that answers the request at once is the engine's idle timer;
                # one that comes later may follow work done, and is not sent again.
                late = sent_at is not None and trio.current_time() - sent_at > _STALE_WITHIN_S
                if not exc.silent or late:
                    raise
                self._stale()  # closed before a single byte: not a failure of the engine
            except BaseException:  # cancelled (client gone, first-byte timeout): close now
                exchange.release()
                raise
            else:
                return exchange
        exchange = Exchange(self, await self._connect())
        try:
            await self._send(exchange._conn, method, target, head, body)
        except (trio.BrokenResourceError, OSError) as exc:
            exchange.release()
            raise UpstreamError(f"sending to {self.endpoint} failed: {exc}", connect=True) from None
        except BaseException:
            exchange.release()
            raise
        try:
            await exchange.read_head()
        except BaseException:
            exchange.release()
            raise
        return exchange

    @staticmethod
    async def _send(
        conn: _Conn, method: bytes, target: bytes, head: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        c = conn.h11
        data = c.send(h11.Request(method=method, target=target, headers=head))
        assert data is not None
        if body:
            data += c.send(h11.Data(data=body))
        data += c.send(h11.EndOfMessage())
        await conn.stream.send_all(data)

    def close(self) -> None:
        self.closed = True
        for conn in self._idle:
            conn.stream.socket.close()
        self._idle.clear()


class Exchange:
    __slots__ = (
        "_conn",
        "_done",
        "_pool",
        "_raw_done",
        "_received",
        "headers",
        "keep_alive",
        "status",
    )

    def __init__(self, pool: Pool, conn: _Conn) -> None:
        self._pool = pool
        self._conn = conn
        self._done = False
        self._raw_done = False
        self.keep_alive = False
        self._received = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    async def _next_event(self) -> object:
        c = self._conn.h11
        while True:
            try:
                event = c.next_event()
            except h11.RemoteProtocolError as exc:
                # Before a single byte this is an end of file where an answer was due
                # (h11 reports a close in SEND_RESPONSE as a protocol error).
                raise UpstreamError(
                    f"{self._pool.endpoint} answered garbage: {exc}", silent=not self._received
                ) from None
            if event is h11.NEED_DATA:
                try:
                    data = await self._receive()
                except (trio.BrokenResourceError, OSError) as exc:
                    raise UpstreamError(
                        f"{self._pool.endpoint} broke the connection: {exc}",
                        silent=not self._received,
                    ) from None
                self._received += len(data)
                c.receive_data(data)
                continue
            return event

    async def _receive(self) -> bytes:
        """One read; after the head, an engine that stays silent too long has stalled."""
        if not self.status:  # the head: the router's first-byte timeout applies
            return bytes(await self._conn.stream.receive_some(_RECV))
        idle = self._pool.idle_timeout_s
        with trio.move_on_after(idle):
            return bytes(await self._conn.stream.receive_some(_RECV))
        raise UpstreamError(f"{self._pool.endpoint} sent nothing for {idle:g} s")

    async def read_head(self) -> None:
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = list(event.headers)
                self.keep_alive = event.http_version == b"1.1" and not any(
                    k == b"connection" and b"close" in v.lower() for k, v in self.headers
                )
                timeout = keep_alive_timeout(self.headers)
                if timeout is not None:
                    self._pool.engine_keep_alive(timeout)
                return
            if isinstance(event, h11.ConnectionClosed):
                raise UpstreamError(
                    f"{self._pool.endpoint} closed the connection without answering",
                    silent=not self._received,
                )
            # InformationalResponse (1xx): keep reading.

    @property
    def chunked(self) -> bool:
        return any(k == b"transfer-encoding" and v.lower() == b"chunked" for k, v in self.headers)

    async def body(self) -> AsyncIterator[bytes]:
        """The decoded body, as the engine sends it; pieces already received come out joined."""
        c = self._conn.h11
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                parts = [bytes(event.data)]
                while True:  # one write downstream for everything already here
                    try:
                        event = c.next_event()
                    except h11.RemoteProtocolError as exc:
                        raise UpstreamError(
                            f"{self._pool.endpoint} answered garbage: {exc}"
                        ) from None
                    if not isinstance(event, h11.Data):
                        break
                    parts.append(bytes(event.data))
                yield b"".join(parts)
                if event is h11.NEED_DATA:
                    continue
            if isinstance(event, h11.EndOfMessage):
                self._done = True
                return
            if event is not h11.NEED_DATA and not isinstance(event, h11.Data):
                raise UpstreamError(f"{self._pool.endpoint} closed the connection mid-answer")

    async def raw_chunks(self) -> AsyncIterator[bytes]:
        """A chunked body's whole chunks with their framing, undecoded, the last chunk left out.

        The router relays these as they are to an HTTP/1.1 client: no decoding
        and re-encoding per chunk, and one write per read from the engine.
        """
        scanner = ChunkScanner()
        data, _ = self._conn.h11.trailing_data
        endpoint = self._pool.endpoint
        while True:
            if data:
                try:
                    ready = scanner.feed(bytes(data))
                except ChunkedError as exc:
                    raise UpstreamError(f"{endpoint} broke the chunked framing: {exc}") from None
                if ready:
                    yield ready
                if scanner.done:
                    # The h11 state is past; a fresh one serves the next request.
                    self._raw_done = not scanner.extra
                    return
            try:
                data = await self._receive()
            except (trio.BrokenResourceError, OSError) as exc:
                raise UpstreamError(f"{endpoint} broke the connection: {exc}") from None
            if not data:
                raise UpstreamError(f"{endpoint} closed the connection mid-answer")

    async def read_body(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for data in self.body():
            size += len(data)
            if size > limit:
                raise UpstreamError(f"{self._pool.endpoint} answered more than {limit} bytes")
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool if the exchange finished cleanly, otherwise closed."""
        conn = self._conn
        if self._done and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            self._pool._give_back(conn)
        elif self._raw_done and self.keep_alive and conn.h11.our_state is h11.DONE:
            conn.h11 = h11.Connection(h11.CLIENT)
            self._pool._give_back(conn)
        else:
            conn.stream.socket.close()
