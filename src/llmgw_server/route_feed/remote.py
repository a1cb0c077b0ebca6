"""Following a control plane across the network: a router apart (`llmgw-server router
--control URL`) dials the control port's route feed (`/v1/routes`, a websocket, TLS
unless the URL says http://, offering the ALPN name ROUTER_ALPN so that the port admits
it on the routers' lane), authenticated with the router token, and follows it; it
dials again forever, with jittered backoff and a log line saying why each attempt
failed. What follows is a `Following`: a router's Follower, or a workers' parent's
TableRelay. The dialing itself, and its words, are llmgw_core.dial's.
"""

from __future__ import annotations

import logging
import os
import random
import ssl
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import trio
import trio_websocket

from llmgw_core.agent_lane import ROUTER_ALPN
from llmgw_core.dial import Advice, ConnectFailed, Dialed, Target, describe_rejection, dial
from llmgw_core.ws_frames import Heard, cut_when_silent, read_frames, silence_bound
from llmgw_server.route_feed.connection import Connection
from llmgw_server.route_feed.messages import MAX_FRAME_BYTES, FeedError, RouteTable
from llmgw_server.route_feed.ws import WebSocketFeed

log = logging.getLogger("llmgw.router")

ROUTER_TOKEN_ENV = "LLMGW_ROUTER_TOKEN"
ROUTES_RESOURCE = "/v1/routes"
CONNECT_TIMEOUT_S = 10.0
# A dial costs the control plane little, and a router away from it during a drain is not
# waited for: it comes back within a couple of seconds of the control plane's return.
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 2.0
KEEPALIVE_INTERVAL_S = 5.0  # the control plane is pinged after 10 s of quiet, cut after 20 s


class Following(Protocol):
    """What follows a feed: a router's Follower, or a workers' parent's relay."""

    @property
    def table(self) -> RouteTable | None: ...

    async def follow(self, connection: Connection) -> None: ...


# A router apart is told its settings on the command line.
ROUTER_ADVICE = Advice(
    ca="--ca", no_ca="the system's trust store (no --ca given)", plaintext="use an http:// URL"
)


def feed_target(control: str) -> Target:
    """Where the route feed of the control plane at `control` is: its admin URL
    (https://host:port) or the feed's own (wss://host:port/v1/routes). Raises ValueError."""
    try:
        parts = urlsplit(control)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"--control {control!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https", "ws", "wss"):
        raise ValueError(
            f"--control {control!r} must be the control plane's https:// URL "
            "(http:// when it runs with [agents] insecure = true)"
        )
    if not parts.hostname:
        raise ValueError(f"--control {control!r} has no host")
    secure = parts.scheme in ("https", "wss")
    return Target(parts.hostname, port or (443 if secure else 80), ROUTES_RESOURCE, secure)


def read_router_token(token_file: str | None) -> str:
    """The raw router token: the first line of `token_file`, else $LLMGW_ROUTER_TOKEN.
    Raises ValueError saying what is missing."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the router token from {token_file}: {exc}") from None
        if not token:
            raise ValueError(f"the router token file {token_file} is empty")
        return token
    token = os.environ.get(ROUTER_TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"a router token is required: --token-file PATH or ${ROUTER_TOKEN_ENV} (its digest "
            "is the control plane's [admin] router_token_digest)"
        )
    return token


def client_context(ca: Path | None) -> ssl.SSLContext:
    """Trust the fleet CA (`--ca`), else the system's trust store."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def follow_forever(
    follower: Following,
    where: Target,
    token: str,
    ssl_context: ssl.SSLContext | None,
    ca: Path | None,
) -> None:
    """Follow the control plane, dialing again after every failure, forever."""
    failures = 0
    while True:
        followed, why = await follow_once(follower, where, token, ssl_context, ca)
        failures = 0 if followed else failures + 1
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(failures, 10))
        delay *= random.uniform(0.5, 1.0)  # routers that lost the same control plane spread
        table = follower.table
        held = (
            f"serving the last route table ({len(table.models)} models)"
            if table is not None
            else "no route table yet"
        )
        log.warning(
            "route feed from %s: %s; %s; dialing again in %.1f s", where.where, why, held, delay
        )
        await trio.sleep(delay)


async def follow_once(
    follower: Following,
    where: Target,
    token: str,
    ssl_context: ssl.SSLContext | None,
    ca: Path | None,
) -> tuple[bool, str]:
    """Dial and follow until the feed ends: (whether it was followed, why it ended)."""
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            stream = await dial(where, ssl_context, ca, alpn=ROUTER_ALPN, advice=ROUTER_ADVICE)
    except ConnectFailed as exc:
        return False, str(exc)
    except trio.TooSlowError:
        return False, f"no answer from {where.where} within {CONNECT_TIMEOUT_S:g} s"
    outcome = (False, "")
    try:
        async with trio.open_nursery() as nursery:
            outcome = await _follow_stream(nursery, follower, stream, where, token)
            nursery.cancel_scope.cancel()
    # trio-websocket raises a refusal from its reader task: it comes out of the nursery.
    except* trio_websocket.ConnectionRejected as group:
        first = group.exceptions[0]
        assert isinstance(first, trio_websocket.ConnectionRejected)
        outcome = (False, describe_rejection(first))
    except* (trio_websocket.HandshakeError, OSError, trio.BrokenResourceError) as group:
        outcome = (
            False,
            f"the websocket handshake with {where.where} failed: {group.exceptions[0]!r}",
        )
    finally:
        await trio.aclose_forcefully(stream)
    return outcome


async def _follow_stream(
    nursery: trio.Nursery,
    follower: Following,
    stream: Dialed,
    where: Target,
    token: str,
) -> tuple[bool, str]:
    host = where.host if where.port == (443 if where.secure else 80) else where.where
    ws = None
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        ws = await trio_websocket.wrap_client_stream(
            nursery,
            stream,  # type: ignore[arg-type]  # any stream works; it is typed narrowly
            host,
            where.resource,
            extra_headers=[(b"authorization", f"Bearer {token}".encode())],
            max_message_size=MAX_FRAME_BYTES,
        )
    if ws is None:
        hint = "" if where.secure else " (if the control port runs TLS, dial https://)"
        return False, (
            f"no answer to the websocket handshake from {where.where} within "
            f"{CONNECT_TIMEOUT_S:g} s{hint}"
        )
    log.info("following the route table of %s", where.where)
    inbox_send, inbox_receive = trio.open_memory_channel[str | bytes](64)
    heard = Heard(trio.current_time())
    silent = trio.CancelScope()
    nursery.start_soon(read_frames, ws, inbox_send, None, heard)
    nursery.start_soon(cut_when_silent, ws, heard, silence_bound(KEEPALIVE_INTERVAL_S), silent)
    why = "the control plane closed the route feed"
    with silent:
        try:
            await follower.follow(WebSocketFeed(ws, inbox_receive, "the control plane"))
        except FeedError as exc:
            why = f"a frame from the control plane cannot be used: {exc}"
            with trio.move_on_after(1):
                await ws.aclose(code=1008, reason=str(exc)[:120])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it went away while this router spoke: the close says why
        except Exception as exc:  # a bug here must not stop the router serving
            log.exception("following the route table failed")
            why = f"following failed: {type(exc).__name__}: {exc}"
    if silent.cancelled_caught:
        cut = silence_bound(KEEPALIVE_INTERVAL_S).cut_after_s
        why = f"nothing heard from the control plane for {cut:g} s"
    elif ws.closed is not None and ws.closed.reason:
        why += f" ({ws.closed.reason})"
    with trio.move_on_after(1):
        await ws.aclose()
    return True, why
