"""A TCP relay that can stop forwarding without closing anything: a real partition.

    python tests/tcp_relay.py LISTEN_PORT TARGET_PORT

SIGUSR1 stops forwarding in both directions (bytes wait in the kernel's buffers,
no connection is closed); SIGUSR2 resumes. SIGHUP black-holes the connections
open at that moment, for good: nothing more passes either way, not even a close
(no FIN, no RST, whatever either end does), while new connections are relayed as
before, as when a route or a host vanishes and a new path exists.

Tests in process use `Relay` directly.
"""

from __future__ import annotations

import itertools
import signal
import sys

import trio


class Relay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.flowing = trio.Event()
        self.flowing.set()
        self._ids = itertools.count()
        self._silent_below = 0  # connections numbered below this are black-holed
        self.relayed = 0  # connections accepted so far

    def pause(self) -> None:
        if self.flowing.is_set():
            self.flowing = trio.Event()

    def resume(self) -> None:
        self.flowing.set()

    def black_hole_open_connections(self) -> None:
        self._silent_below = self.relayed

    async def serve(
        self, listen_port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Relay 127.0.0.1:`listen_port` (0: any free port, reported by `started`)."""
        listeners = await trio.open_tcp_listeners(listen_port, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._relay, listeners)
            task_status.started(listeners[0].socket.getsockname()[1])

    async def _gate(self, link: int) -> None:
        if link < self._silent_below:
            await trio.sleep_forever()
        await self.flowing.wait()

    async def _pump(self, link: int, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            while True:
                await self._gate(link)
                data = await source.receive_some(65536)
                await self._gate(link)  # what arrives on a black-holed link goes nowhere
                if not data:
                    break
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await self._gate(link)  # nor does its end
        await sink.aclose()

    async def _relay(self, client: trio.SocketStream) -> None:
        link = next(self._ids)
        self.relayed = link + 1
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            await client.aclose()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, link, client, upstream)
            nursery.start_soon(self._pump, link, upstream, client)


async def main(listen: int, target: int) -> None:
    relay = Relay(target)
    with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(relay.serve, listen)
            print("relaying", flush=True)
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    relay.pause()
                    print("paused", flush=True)
                elif signum == signal.SIGUSR2:
                    relay.resume()
                    print("flowing", flush=True)
                else:
                    relay.black_hole_open_connections()
                    print(f"black-holed {relay.relayed} connections", flush=True)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
