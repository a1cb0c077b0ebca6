"""What the route feed runs over: any connection with two methods (`Connection`).

    async def send(self, text: str) -> None     # one frame, in order
    async def receive(self) -> str              # the next frame

`receive` raises `trio.EndOfChannel` when the peer closed the connection in the
ordinary way; anything else it or `send` raises is an error (trio.BrokenResourceError
from `send` once the peer is gone is the ordinary end too). Its owner closes it: the
hub and the followers never do.

Three carry it: a websocket to the control port (`ws`), a Unix socket between a workers'
parent and each worker (router.worker), and memory channels in one process
(`local_pair`).
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio


class Connection(Protocol):
    async def send(self, text: str) -> None: ...
    async def receive(self) -> str: ...


@attrs.define
class LocalConnection:
    """One end of a connection in one process: memory channels, no socket."""

    outbox: trio.MemorySendChannel[str]
    inbox: trio.MemoryReceiveChannel[str]

    async def send(self, text: str) -> None:
        await self.outbox.send(text)

    async def receive(self) -> str:
        return await self.inbox.receive()

    def close(self) -> None:
        self.outbox.close()
        self.inbox.close()


def local_pair(buffer: int = 16) -> tuple[LocalConnection, LocalConnection]:
    """Two connected ends; closing one makes the other's `receive` raise EndOfChannel."""
    a_send, b_receive = trio.open_memory_channel[str](buffer)
    b_send, a_receive = trio.open_memory_channel[str](buffer)
    return LocalConnection(a_send, a_receive), LocalConnection(b_send, b_receive)
