"""The fleet page on the control port: its static files under /ui (no token: they hold no
fleet data) and the stream it follows, GET /v1/admin/stream (a read like status).

The stream is NDJSON over one long response: a line with the status as soon as it
opens, then a line whenever the fleet changed, never closer together than
`COALESCE_S` (a 10,000-node fleet's registrations and failures arrive as one line a
half-second, not one per event), and a keep-alive line when nothing changed for
`KEEPALIVE_S`. A browser's fetch() sends the admin token in its Authorization header,
which an EventSource could not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import trio

from llmgw_core.traffic import TrafficStore
from llmgw_http.server import Request, Responder
from llmgw_server.control.documents import to_json
from llmgw_server.control_shell.fleet_feed import FleetFeed

COALESCE_S = 0.5
KEEPALIVE_S = 15.0
SEND_TIMEOUT_S = 30.0  # a reader that takes no line for this long is cut off
# The routers' traffic goes to the page at most this often (they report every 5 s); each
# line carries every model's hour and its replicas' 5 minutes (see llmgw_core.traffic).
TRAFFIC_EVERY_S = 5.0

# Defence in depth behind the page's own escaping: no inline script, nothing from elsewhere.
_SECURITY = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]

_ASSETS = {
    b"/ui": ("index.html", b"text/html; charset=utf-8"),
    b"/ui/": ("index.html", b"text/html; charset=utf-8"),
    b"/ui/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    b"/ui/style.css": ("style.css", b"text/css; charset=utf-8"),
}


def is_page(path: bytes) -> bool:
    return path == b"/ui" or path.startswith(b"/ui/")


def _read(name: str) -> bytes:
    return (resources.files("llmgw_server") / "ui" / name).read_bytes()


async def page(request: Request, responder: Responder) -> None:
    """One of the page's files; they carry no fleet data and need no token."""
    found = _ASSETS.get(request.path)
    if found is None:
        await responder.error(404, "no such file of the fleet page (it is at /ui)")
        return
    if request.method not in (b"GET", b"HEAD"):
        await responder.error(405, "the fleet page takes GET")
        return
    name, content_type = found
    await responder.whole(200, _read(name), [(b"content-type", content_type), *_SECURITY])


async def stream(
    feed: FleetFeed,
    snapshot: Callable[[], dict[str, Any]],
    responder: Responder,
    history: Callable[[int], tuple[int, dict[str, Any]]] | None = None,
    traffic: TrafficStore | None = None,
    wall_clock: Callable[[], float] = time.time,
) -> None:
    """Follow the fleet until the client goes away (which cancels this handler).
    `history(seq)` gives the charts' points recorded after cursor `seq` (0: all kept) and
    the new cursor: the first line carries every point kept, later ones the new points.
    `traffic`: the routers' reports, sent whole (a line of its own when only they
    changed) at most every TRAFFIC_EVERY_S."""
    await responder.start(
        200,
        [
            (b"content-type", b"application/x-ndjson"),
            (b"cache-control", b"no-store"),
            (b"x-content-type-options", b"nosniff"),
        ],
    )
    version = -1
    seq = 0
    traffic_seen, traffic_at, quiet_since = -1, -TRAFFIC_EVERY_S, trio.current_time()
    while True:
        sent_at = trio.current_time()
        fresh_traffic = (
            traffic is not None
            and traffic.version != traffic_seen
            and sent_at - traffic_at >= TRAFFIC_EVERY_S
        )
        line: dict[str, Any]
        if feed.version != version:
            version = feed.version
            recent = [to_json(r) for r in feed.recent]
            line = {"status": snapshot(), "recent": recent, "version": version}
            if history is not None:
                first = seq == 0
                seq, points = history(seq)
                if points or first:
                    line["history"] = {"full": first, "models": points}
        elif fresh_traffic:
            line = {"version": version}
        elif sent_at - quiet_since >= KEEPALIVE_S or traffic is None:
            line = {"keepalive": True, "version": version}
        else:
            line = {}
        if fresh_traffic and traffic is not None:
            traffic_seen, traffic_at = traffic.version, sent_at
            line["traffic"] = traffic.view(wall_clock())
        if not line:
            with trio.move_on_after(TRAFFIC_EVERY_S):
                await feed.wait_past(version)
            continue
        quiet_since = sent_at
        with trio.move_on_after(SEND_TIMEOUT_S) as sending:
            await responder.send(json.dumps(line, separators=(",", ":")).encode() + b"\n")
        if sending.cancelled_caught:
            await responder.abort()
            return
        await trio.sleep_until(sent_at + COALESCE_S)
        with trio.move_on_after(KEEPALIVE_S if traffic is None else TRAFFIC_EVERY_S):
            await feed.wait_past(version)
