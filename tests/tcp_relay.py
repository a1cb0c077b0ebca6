"""A TCP relay that can stop forwarding without closing anything: a real partition.

    python tests/tcp_relay.py LISTEN_PORT TARGET_PORT

SIGUSR1 stops forwarding in both directions (bytes wait in the kernel's buffers,
no connection is closed); SIGUSR2 resumes.
"""

from __future__ import annotations

import signal
import sys

import trio

flowing = trio.Event()


async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while True:
            await flowing.wait()
            data = await source.receive_some(65536)
            if not data:
                break
            await flowing.wait()
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await sink.aclose()


async def relay(client: trio.SocketStream, target: int) -> None:
    try:
        upstream = await trio.open_tcp_stream("127.0.0.1", target)
    except OSError:
        await client.aclose()
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, client, upstream)
        nursery.start_soon(pump, upstream, client)


async def main(listen: int, target: int) -> None:
    global flowing
    flowing.set()
    with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGUSR2) as signals:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(listen, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, lambda s: relay(s, target), listeners)
            print("relaying", flush=True)
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    flowing = trio.Event()
                    print("paused", flush=True)
                else:
                    flowing.set()
                    print("flowing", flush=True)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
