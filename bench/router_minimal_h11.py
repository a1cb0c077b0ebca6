"""The smallest keep-alive HTTP/1.1 server on h11 and trio: the benchmark's yardstick.

bench/router_bench.py measures its CPU per static request next to llmgw's own
server, to tell how fast the machine is: the issue's reference machine answered
such a request for 0.09 ms. It answers every request with a fixed 16-byte body.

    python bench/router_minimal_h11.py [--port 0]   # prints its URL on stderr
"""

from __future__ import annotations

import argparse
import sys

import h11
import trio

BODY = b'{"status": "ok"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def serve_connection(stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.EndOfMessage):
                out = conn.send(h11.Response(status_code=200, headers=HEADERS)) or b""
                out += conn.send(h11.Data(data=BODY)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return
    except (trio.BrokenResourceError, h11.ProtocolError, OSError):
        pass
    finally:
        await stream.aclose()


async def main(port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    bound = listeners[0].socket.getsockname()[1]
    print(f"minimal h11 server on http://127.0.0.1:{bound}", file=sys.stderr, flush=True)
    await trio.serve_listeners(serve_connection, listeners)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    try:
        trio.run(main, parser.parse_args().port)
    except KeyboardInterrupt:
        pass
