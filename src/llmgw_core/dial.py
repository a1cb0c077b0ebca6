"""Dialing the control plane, with every way it can fail said in words for the log.

trio-websocket dials and handshakes TLS itself, and a TLS failure inside it shows
only as `ConnectionTimeout` once the connect timeout has passed (its reader task
swallows the error), a refused connection as a bare `HandshakeError`. So the agent
dials itself (TCP, then the TLS handshake, each failure named: refused, no route,
certificate not trusted, name mismatch, not TLS at all) and hands the stream to
trio-websocket for the websocket handshake, whose refusal (an HTTP status with the
control plane's reason) is named too. The words are `ConnectFailed`'s message.
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import trio
import trio_websocket

from llmgw_core.agent_lane import (
    AGENT_ALPN,
    COME_BACK_PREFIX,
    come_back_s,
    lost_leader_alpn,
    not_leader_url,
)
from llmgw_core.tls_advice import name_mismatch
from llmgw_core.ws_frames import Heard

# What OpenSSL says when the peer's first bytes are not TLS (a plaintext server).
_NOT_TLS = {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"}


class ConnectFailed(Exception):
    """A connection to the control plane that failed; `str()` says why, in words, and
    `come_back_s` when the control plane asked to be dialled again (it was busy)."""

    def __init__(
        self, message: str, come_back_s: float | None = None, leader: str | None = None
    ) -> None:
        super().__init__(message)
        self.come_back_s = come_back_s
        self.leader = leader  # a standby named the leader before any TLS (agent_lane)


@attrs.frozen
class Target:
    host: str
    port: int
    resource: str  # path and query
    secure: bool

    @property
    def where(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def target(url: str) -> Target:
    """The parts of a ws:// or wss:// URL the agent's config has already validated."""
    parts = urlsplit(url)
    secure = parts.scheme == "wss"
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.hostname or "", parts.port or (443 if secure else 80), resource, secure)


@attrs.frozen
class Advice:
    """How a failure's words name the dialing side's own settings: an agent's config file
    or a router apart's command line."""

    ca: str  # the setting that names the fleet CA
    no_ca: str  # what verified the certificate when that setting is not given
    plaintext: str  # what to dial instead when the control port speaks no TLS


AGENT_ADVICE = Advice(ca="[tls] ca", no_ca="[tls] ca", plaintext="dial ws://")


def describe_os_error(exc: OSError, where: str) -> str:
    """A failed TCP connect, in words."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the control plane's host name ({where}): {exc.strerror}"
    codes = _errnos(exc)
    if errno.ECONNREFUSED in codes:
        return (
            f"connection refused by {where}: nothing listens there (is the server running, "
            "and is this its control_listen port?)"
        )
    if codes & {errno.EHOSTUNREACH, errno.ENETUNREACH}:
        return f"no route to {where}"
    if errno.ETIMEDOUT in codes:
        return f"no answer from {where} (connect timed out)"
    detail = next((e.strerror for e in _leaves(exc) if e.strerror), None) or str(exc)
    return f"cannot connect to {where}: {detail}"


def describe_tls_error(
    exc: BaseException, where: str, ca: Path | None, advice: Advice = AGENT_ADVICE
) -> str:
    """A failed TLS handshake (the `ssl` error, or what broke the connection), in words."""
    trust = f"{advice.ca} ({ca})" if ca else advice.no_ca
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message or exc.reason or str(exc)
        mismatch = name_mismatch(exc)
        if mismatch is not None:
            return mismatch
        return (
            f"the control plane's certificate at {where} is not trusted ({why}): {trust} "
            "must be the fleet CA that signed the server's certificate"
        )
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        if reason in _NOT_TLS:
            return (
                f"{where} does not speak TLS ({reason.lower().replace('_', ' ')}): the server "
                f"may run with [agents] insecure = true (then {advice.plaintext}) or this is "
                "not its control port"
            )
        if "ALERT" in reason:
            return (
                f"the control plane at {where} refused this agent's certificate during the TLS "
                f"handshake ({reason.lower().replace('_', ' ')}): [tls] cert must be issued by "
                "the fleet CA the server trusts ([agents] ca); the server's log says more"
            )
        return f"the TLS handshake with {where} failed: {reason or exc}"
    if isinstance(exc, OSError | trio.BrokenResourceError | trio.ClosedResourceError):
        return f"{where} closed the connection during the TLS handshake"
    return f"the TLS handshake with {where} failed: {exc}"


def describe_rejection(exc: trio_websocket.ConnectionRejected) -> str:
    """The control plane answered the websocket handshake with an HTTP error."""
    body = (exc.body or b"").decode("utf-8", errors="replace").strip()
    reason = " ".join(body.split())[:300] or "no reason given"
    return f"refused by the control plane: HTTP {exc.status_code}: {reason}"


def retry_after(exc: trio_websocket.ConnectionRejected) -> float | None:
    """The seconds a refusal's `Retry-After` asks for (the plaintext port's 503), within
    MAX_COME_BACK_S; None without one (or with an HTTP date, which no control plane sends)."""
    for name, value in exc.headers or ():
        if bytes(name).lower() == b"retry-after":
            return come_back_s(COME_BACK_PREFIX + bytes(value).strip())
    return None


async def dial(
    where: Target,
    ssl_context: ssl.SSLContext | None,
    ca: Path | None = None,
    local_address: str | None = None,
    stage: list[str] | None = None,
    *,
    alpn: bytes | tuple[bytes, ...] | None = AGENT_ALPN,
    advice: Advice = AGENT_ADVICE,
) -> Dialed:
    """A TCP connection (from `local_address` when given), with the TLS handshake done
    when `ssl_context` is given, offering `alpn`. Raises ConnectFailed, its words naming
    the settings as `advice` says; the caller bounds the time, and learns from `stage`
    (appended to) how far it got."""
    stage = [] if stage is None else stage
    stage.append("the TCP connect")
    try:
        tcp = await trio.open_tcp_stream(where.host, where.port, local_address=local_address)
    except OSError as exc:
        raise ConnectFailed(describe_os_error(exc, where.where)) from None
    if ssl_context is None:
        return tcp
    if alpn is not None:
        # Named in the ClientHello, so that the control port admits agents (AGENT_ALPN)
        # and routers apart (ROUTER_ALPN) in lanes of their own (a storm of agents cannot
        # crowd operators out, nor anonymous peers routers); the server selects no ALPN.
        offered = (alpn,) if isinstance(alpn, bytes) else alpn
        ssl_context.set_alpn_protocols([name.decode() for name in offered])
    first = _FirstBytes(tcp)
    tls = trio.SSLStream(first, ssl_context, server_hostname=where.host, https_compatible=True)
    stage.append("the TLS handshake")
    try:
        await tls.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        said = first.first or first.unread()
        wait = come_back_s(said)
        leader = not_leader_url(said)
        await trio.aclose_forcefully(tcp)
        if leader is not None:
            raise ConnectFailed(
                f"the control plane at {where.where} stands by: the leader is {leader}",
                leader=leader,
            ) from None
        if wait is not None:
            raise ConnectFailed(
                f"the control plane at {where.where} is busy: it asks to be dialled again "
                f"in {wait:g} s",
                come_back_s=wait,
            ) from None
        why = describe_tls_error(exc.__cause__ or exc, where.where, ca, advice)
        raise ConnectFailed(why) from None
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return tls


class _FirstBytes(trio.abc.Stream):
    """The TCP stream under the dialer's TLS, keeping the first bytes the server sent: a
    busy control port writes when to come back in place of its first TLS record
    (agent_lane.come_back_line), which OpenSSL can only call a broken record."""

    def __init__(self, tcp: trio.SocketStream) -> None:
        self.tcp = tcp
        self.socket = tcp.socket
        self.first = b""

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = bytes(await self.tcp.receive_some(max_bytes))
        if len(self.first) < _FIRST_BYTES:
            self.first += data[: _FIRST_BYTES - len(self.first)]
        return data

    def unread(self) -> bytes:
        """What the server sent that was never read: a port that refused at once may have
        reset before the hello was sent, and sending it failed first (the bytes that came
        before a reset are still there to read)."""
        sock = self.tcp.socket
        try:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as raw:
                return raw.recv(_FIRST_BYTES, socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except OSError:
            return b""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.tcp.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.tcp.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.tcp.aclose()


_FIRST_BYTES = 256  # a come-back line or a leader's URL fits

Dialed = trio.SocketStream | trio.SSLStream[_FirstBytes]


class _Watched(trio.abc.Stream):
    """The dialed stream, remembering why reading from it broke: trio-websocket's reader
    ends quietly on a broken stream and its opening handshake would then wait forever.
    Every byte that arrives is noted in `heard`: the control plane's acknowledgements
    (pongs, which trio-websocket drops unseen) prove it alive as well as its frames."""

    def __init__(self, stream: Dialed, heard: Heard | None = None) -> None:
        self.stream = stream
        self.heard = heard
        self.broken: BaseException | None = None
        self.broke = trio.Event()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data = bytes(await self.stream.receive_some(max_bytes))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.broken = exc.__cause__ or exc
            self.broke.set()
            raise
        if not data:
            self.broke.set()
        elif self.heard is not None:
            self.heard.now()
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.stream.aclose()


def _closed_early(where: Target, broken: BaseException | None, ca: Path | None) -> str:
    """The connection ended before the websocket handshake was answered."""
    if isinstance(broken, ssl.SSLError):
        return describe_tls_error(broken, where.where, ca)
    if where.secure:
        # With TLS 1.3 the server checks the client's certificate after the client has
        # finished its handshake: a refusal shows as a reset on the first read.
        return (
            f"{where.where} closed the connection right after the TLS handshake: the control "
            "plane most likely refused this agent's certificate ([tls] cert must be issued by "
            "the fleet CA the server trusts); the server's log says why"
        )
    return (
        f"{where.where} closed the connection without answering the websocket handshake: "
        "if the server runs TLS ([agents] insecure = false), dial wss:// with [tls]"
    )


@asynccontextmanager
async def open_agent_stream(
    url: str,
    ssl_context: ssl.SSLContext | None,
    *,
    ca: Path | None = None,
    connect_timeout_s: float,
    disconnect_timeout_s: float,
    max_message_size: int,
    heard: Heard | None = None,
    local_address: str | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
    lost_epoch: int | None = None,
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A websocket to the control plane, closed (within `disconnect_timeout_s`) on exit;
    whatever arrives on it is noted in `heard`. Raises ConnectFailed, alone or in an
    exception group, when it cannot be opened. `local_address`: the source address
    (the fleet bench gives each simulated node its own, as real nodes have);
    `lost_epoch`: the agent has just lost its leader, and the newest epoch it has seen is
    that (its hello says so: a control plane then names only a newer leader, agent_lane)."""
    where = target(url)
    alpn = AGENT_ALPN if lost_epoch is None else (AGENT_ALPN, lost_leader_alpn(lost_epoch))
    default_port = 443 if where.secure else 80
    host_header = where.host if where.port == default_port else where.where
    stream: _Watched | None = None
    stage: list[str] = []  # how far the dial got, for a timeout's words
    ws: trio_websocket.WebSocketConnection | None = None
    rejected: trio_websocket.ConnectionRejected | None = None
    try:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(connect_timeout_s) as connecting:
                dialed = await dial(where, ssl_context, ca, local_address, stage, alpn=alpn)
                stream = _Watched(dialed, heard)
                stage.append("the websocket handshake")
                async with trio.open_nursery() as handshake:
                    handshake.start_soon(_cancel_when_set, stream.broke, handshake.cancel_scope)
                    ws = await trio_websocket.wrap_client_stream(
                        nursery,
                        stream,  # type: ignore[arg-type]  # any stream works; it is typed narrowly
                        host_header,
                        where.resource,
                        extra_headers=list(headers),
                        max_message_size=max_message_size,
                    )
                    handshake.cancel_scope.cancel()
            if ws is None:
                if stream is not None:
                    await trio.aclose_forcefully(stream.stream)
                if connecting.cancelled_caught:
                    during = stage[-1] if stage else "the TCP connect"
                    raise ConnectFailed(
                        f"no answer from the control plane at {where.where} within "
                        f"{connect_timeout_s:g} s (timeout, during {during})"
                    )
                assert stream is not None
                raise ConnectFailed(_closed_early(where, stream.broken, ca))
            try:
                yield ws
            finally:
                try:
                    with trio.move_on_after(disconnect_timeout_s):
                        await ws.aclose()
                finally:
                    nursery.cancel_scope.cancel()
    except* trio_websocket.ConnectionRejected as group:
        first = group.exceptions[0]
        assert isinstance(first, trio_websocket.ConnectionRejected)
        rejected = first
    if rejected is not None:
        raise ConnectFailed(describe_rejection(rejected), come_back_s=retry_after(rejected))


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _errnos(exc: BaseException) -> set[int]:
    return {e.errno for e in _leaves(exc) if e.errno is not None}


def _leaves(exc: BaseException) -> list[OSError]:
    """The OSErrors in an exception, its cause and any group (trio's connect attempts)."""
    found: list[OSError] = []
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        elif isinstance(e, OSError):
            found.append(e)
        if e.__cause__ is not None:
            stack.append(e.__cause__)
    return found
