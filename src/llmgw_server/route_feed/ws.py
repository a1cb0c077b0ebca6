"""The route feed over a websocket: the connection `follower` and `hub`
follow and serve (`send`/`receive` of text frames), on either end of `/v1/routes`."""

from __future__ import annotations

import trio
import trio_websocket

from llmgw_server.route_feed.messages import FeedError


class WebSocketFeed:
    """Frames from a websocket's reader task (`inbox`), written to `ws`; `peer` names the
    other end in errors ("the follower", "the control plane")."""

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        inbox: trio.MemoryReceiveChannel[str | bytes],
        peer: str,
    ) -> None:
        self.ws = ws
        self.inbox = inbox
        self.peer = peer

    async def send(self, text: str) -> None:
        try:
            await self.ws.send_message(text)
        except trio_websocket.ConnectionClosed:
            raise trio.BrokenResourceError(f"{self.peer} went away") from None

    async def receive(self) -> str:
        frame = await self.inbox.receive()
        if isinstance(frame, bytes):
            raise FeedError("binary frames are not part of the route feed; send JSON text")
        return frame
