"""`make demo`: the router in front of two mock engines, on this machine, no GPU needed."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import trio

from llmgw_core.config import parse_config
from llmgw_server.app import main as serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def demo() -> None:
    port = int(os.environ.get("LLMGW_DEMO_PORT", "8080"))
    engine_ports = [_free_port(), _free_port()]
    engines = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw_core.mock_engine",
                "serve",
                "demo-model",
                "--port",
                str(p),
                "--mock-tokens",
                "24",
                "--mock-tokens-per-second",
                "40",
            ],
            start_new_session=True,
        )
        for p in engine_ports
    ]
    config = parse_config(
        {
            "server": {"listen": f"127.0.0.1:{port}"},
            "router": {"health_interval_s": 1.0},
            "models": [
                {"name": "demo-model", "endpoints": [f"http://127.0.0.1:{p}" for p in engine_ports]}
            ],
        },
        "<demo>",
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, config)
            url = f"http://127.0.0.1:{port}"
            print(
                f"\nllmgw demo: the router is at {url}/v1 in front of two mock engines "
                f"(ports {engine_ports[0]}, {engine_ports[1]}). Try:\n\n"
                f"  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
                '    -d \'{"model": "demo-model", "stream": true, '
                '"messages": [{"role": "user", "content": "hello"}]}\'\n\n'
                f"  curl {url}/metrics\n\nCtrl-C stops it.\n",
                flush=True,
            )
    finally:
        for engine in engines:
            engine.terminate()
            engine.wait(5)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(demo)
