"""One reader and one writer task per websocket, with memory channels between them and
the logic, so a slow consumer never stops the connection's pings (both daemons use them)."""

from __future__ import annotations

import trio
import trio_websocket


async def read_frames(
    ws: trio_websocket.WebSocketConnection,
    inbox: trio.MemorySendChannel[str | bytes],
    on_close: trio.CancelScope | None = None,
) -> None:
    """Feed every frame into `inbox`; close it (and cancel `on_close`) when the peer goes."""
    async with inbox:
        try:
            while True:
                await inbox.send(await ws.get_message())
        except trio_websocket.ConnectionClosed:
            if on_close is not None:
                on_close.cancel()


async def write_frames(
    ws: trio_websocket.WebSocketConnection,
    outbox: trio.MemoryReceiveChannel[str],
    on_close: trio.CancelScope | None = None,
) -> None:
    """Send everything queued in `outbox`, in order."""
    try:
        async for text in outbox:
            await ws.send_message(text)
    except trio_websocket.ConnectionClosed:
        if on_close is not None:
            on_close.cancel()
