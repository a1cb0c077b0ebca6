"""The server's end of a websocket, on wsproto's frame layer, for one owning task.

The control port holds one of these per node, 10,000 of them at once, so each
costs what it must and nothing more: no task of its own (the task that owns the
stream reads it), no memory channel, no second HTTP parser for the handshake
(the control port's HTTP server has already parsed the request). Its owner
reads with `receive`, which answers pings and the peer's close as they come;
writes (`send`, `pong`, `close`) may come from any task and go out one at a
time. Reading in the owning task is safe here because what it does with each
message never waits: a slow consumer cannot keep pings unanswered.
"""

from __future__ import annotations

import base64
import hashlib

import trio
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Message, Ping, Pong, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from llmgw_http.server import Request

# Bytes asked of the socket per read. An agent's frames are small (a heartbeat is
# ~40 bytes; a registration a few KiB), and the buffer a read allocates is
# trimmed to what arrived, but a large request briefly costs this much per stream.
RECEIVE_BYTES = 16 * 1024
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class PeerClosed(Exception):
    """The connection ended: the peer closed it (`code`, `reason`), or it broke (1006)."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(f"{code} {reason}".strip())
        self.code = code
        self.reason = reason


def handshake_problem(request: Request) -> str | None:
    """Why `request` is not a websocket upgrade this server accepts, or None."""
    if request.method != b"GET":
        return "a websocket upgrade is a GET request"
    if b"upgrade" not in (request.header(b"connection") or b"").lower():
        return "the Connection header must include Upgrade"
    if request.header(b"sec-websocket-version") != b"13":
        return "only websocket version 13 is spoken here"
    key = request.header(b"sec-websocket-key")
    if not key or len(base64.b64decode(key + b"==", validate=False)) < 16:
        return "the Sec-WebSocket-Key header is missing or malformed"
    return None


def accept_response(request: Request) -> bytes:
    """The 101 answer to an upgrade that `handshake_problem` found nothing wrong with."""
    key = request.header(b"sec-websocket-key") or b""
    token = base64.b64encode(hashlib.sha1(key.strip() + _GUID).digest())
    return (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + token + b"\r\n\r\n"
    )


def refusal(status: int, reason: bytes, body: bytes) -> bytes:
    """A whole HTTP response refusing the upgrade; the connection closes after it."""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )


def head_and_rest(raw: bytes) -> bytes:
    """What the client sent after its request head (it may send its first frame at once)."""
    return raw.partition(b"\r\n\r\n")[2]


class ServerWebSocket:
    """An accepted websocket: the 101 has been sent; `rest` is what followed the head."""

    __slots__ = (
        "_asked",
        "_parts",
        "_size",
        "_stream",
        "_wlock",
        "_ws",
        "closed",
        "max_message_size",
        "pings",
    )

    def __init__(self, stream: trio.abc.Stream, rest: bytes, max_message_size: int) -> None:
        self._stream = stream
        self._ws = Connection(ConnectionType.SERVER, trailing_data=rest)
        self._wlock = trio.StrictFIFOLock()
        self._parts: list[str | bytes] = []
        self._size = 0
        self.max_message_size = max_message_size
        self.closed: PeerClosed | None = None
        self.pings = 0  # pings the peer sent: heartbeats and their acks make them needless
        self._asked: tuple[bytes, trio.Event] | None = None  # `ping`'s payload, and its answer

    async def receive(self) -> str | bytes:
        """The next whole message. Raises PeerClosed when the connection ends (a message
        over `max_message_size` closes it with 1009)."""
        while True:
            for event in self._ws.events():
                if isinstance(event, Message):
                    self._size += len(event.data)
                    if self._size > self.max_message_size:
                        self._parts.clear()
                        reason = f"a message exceeds {self.max_message_size} bytes"
                        await self.close(1009, reason)
                        raise PeerClosed(1009, reason)
                    self._parts.append(event.data)
                    if event.message_finished:
                        assert isinstance(event, TextMessage | BytesMessage)
                        return self._whole(event)
                elif isinstance(event, Ping):
                    self.pings += 1
                    await self._write(event.response())
                elif isinstance(event, Pong) and self._asked is not None:
                    payload, answered = self._asked
                    if bytes(event.payload) == payload:
                        self._asked = None
                        answered.set()
                elif isinstance(event, CloseConnection):
                    await self._peer_closed(event)
            if self.closed is not None:
                raise self.closed
            await self._read()

    async def _read(self) -> None:
        try:
            data = await self._stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.closed = self.closed or PeerClosed(CloseReason.ABNORMAL_CLOSURE)
            raise self.closed
        self._ws.receive_data(bytes(data))

    def _whole(self, last: TextMessage | BytesMessage) -> str | bytes:
        parts, self._parts, self._size = self._parts, [], 0
        if isinstance(last, TextMessage):
            return "".join(parts)  # type: ignore[arg-type]
        assert isinstance(last, BytesMessage)
        return b"".join(parts)  # type: ignore[arg-type]

    async def _peer_closed(self, event: CloseConnection) -> None:
        self.closed = PeerClosed(event.code, event.reason or "")
        if self._ws.state is ConnectionState.REMOTE_CLOSING:
            await self._write(event.response())

    async def send(self, text: str) -> None:
        await self._write(TextMessage(text))

    async def pong(self) -> None:
        """An unsolicited pong: the acknowledgement that tells the peer this end is alive
        (RFC 6455 allows it; a peer's websocket library takes it and answers nothing)."""
        await self._write(Pong(b""))

    async def ping(self, payload: bytes, answered: trio.Event) -> None:
        """Ask the peer for a pong (its websocket library answers, whatever its own loop
        is doing); `answered` is set when the pong is read, by the owner's `receive`: the
        caller waits on the event, never on the socket."""
        self._asked = (payload, answered)
        await self._write(Ping(payload))

    async def close(self, code: int, reason: str) -> None:
        """Send a close frame, wait a moment for the peer's, then close the socket."""
        try:
            with trio.move_on_after(1) as cleanup:
                cleanup.shield = True
                if self._ws.state is ConnectionState.OPEN:
                    await self._write(CloseConnection(code, close_frame_reason(reason)))
                    while self.closed is None:  # what else comes meanwhile is dropped
                        for event in self._ws.events():
                            if isinstance(event, CloseConnection):
                                self.closed = PeerClosed(event.code, event.reason or "")
                        if self.closed is None:
                            await self._read()
        except (PeerClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(self._stream)

    async def _write(self, event: Event) -> None:
        try:
            data = self._ws.send(event)
        except LocalProtocolError:
            raise self.closed or PeerClosed(CloseReason.ABNORMAL_CLOSURE) from None
        # The lock only when another task is writing: its `acquire` yields to the
        # scheduler even when free, a second round trip for every heartbeat's ack.
        try:
            self._wlock.acquire_nowait()
        except trio.WouldBlock:
            await self._wlock.acquire()
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = self.closed or PeerClosed(CloseReason.ABNORMAL_CLOSURE)
            raise self.closed from None
        finally:
            self._wlock.release()


# RFC 6455 5.5: a control frame's payload is at most 125 bytes, two of them the code.
MAX_CLOSE_REASON_BYTES = 123


def close_frame_reason(reason: str) -> str:
    """`reason` cut to what a close frame carries, on a character's boundary (a node's
    name may be any UTF-8)."""
    return reason.encode()[:MAX_CLOSE_REASON_BYTES].decode(errors="ignore")
