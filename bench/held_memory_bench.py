#!/usr/bin/env python3
"""What held requests cost a router's memory (issue 34, finding 4): the requests for an
autoscaled model that no replica serves are held with their bodies, within a byte budget.

Starts one router process (one worker) whose model `chat` is autoscaled and at zero
replicas (set in the process itself, as the route feed would), then sends N chat
requests of a given body size, each on its own keep-alive connection, each once the one
before it is held or answered. It reads the router's RSS (VmRSS) from /proc/PID/status
before the first and after the last, and its peak (VmHWM), and counts the answers: held
(still waiting), 503 with Retry-After (past the count or a byte budget).

Run from the repository root:

    .venv/bin/python bench/held_memory_bench.py                    # 100 x 16 MiB, defaults
    .venv/bin/python bench/held_memory_bench.py --models 2         # the process budget binds
    .venv/bin/python bench/held_memory_bench.py -n 16 --mib 8 --budget-mib 64 --model-budget-mib 64
    .venv/bin/python bench/held_memory_bench.py --no-budget        # a tree without the knobs

Where RSS grew past the process's budget plus 10%, the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
_HELD = re.compile(rb'^llmgw_requests_held\{model="[^"]*"\} (\d+)$', re.M)


@attrs.frozen
class Result:
    sent: int
    held: int
    refused: int  # 503 with Retry-After
    other: list[str]  # any other answer's first line
    rss_before: int  # bytes
    rss_after: int
    peak: int
    metrics: bytes  # the router's /metrics page while they are held

    @property
    def growth(self) -> int:
        return self.rss_after - self.rss_before


def _proc_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def metrics_page(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        page = b""
        while data := s.recv(65536):
            page += data
    return page


def _held(port: int) -> int:
    """Requests held now, all models."""
    return sum(int(n) for n in _HELD.findall(metrics_page(port)))


def chat_request(size: int, model: str = "chat") -> bytes:
    """A chat request whose body is `size` bytes (JSON, one message of 'x')."""
    empty = json.dumps({"model": model, "messages": [{"role": "user", "content": ""}]})
    content = "x" * (size - len(empty))
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}]})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body.encode()


def start_router(
    router: dict[str, object], max_body: int, models: tuple[str, ...] = ("chat",)
) -> tuple[subprocess.Popen[str], int]:
    """A router process serving `models` (autoscaled, at zero) with these `[router]`
    keys; it stops when its stdin closes."""
    spec = json.dumps({"router": router, "max_body": max_body, "models": models})
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip().isdigit(), f"the router did not start: {line!r}"
    return child, int(line)


def send_held(
    port: int, pid: int, requests: list[bytes], timeout_s: float = 60.0, warm: bytes = b""
) -> Result:
    """Send each request on its own connection once the one before it is held or
    answered; the connections stay open (the held ones wait) until the end. `warm`, a
    request answered at once, is sent first, before RSS is read: what a first request
    costs the process whatever it is (code paths run once, the read buffers' heap) is
    then not counted as the held requests'."""
    if warm:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(warm)
            assert s.recv(65536).startswith(b"HTTP/1.1 "), "no answer to the warm-up"
    rss_before = _proc_bytes(pid, "VmRSS")
    held = refused = 0
    other: list[str] = []
    conns: list[socket.socket] = []
    for request in requests:
        s = socket.create_connection(("127.0.0.1", port))
        conns.append(s)
        s.sendall(request)
        deadline = time.monotonic() + timeout_s
        while True:
            assert time.monotonic() < deadline, "neither held nor answered"
            if select.select([s], [], [], 0.02)[0]:
                answer = b""
                while b"\r\n\r\n" not in answer:
                    data = s.recv(65536)
                    assert data, answer
                    answer += data
                head = answer.partition(b"\r\n\r\n")[0].lower()
                if head.startswith(b"http/1.1 503") and b"\r\nretry-after: " in head:
                    refused += 1
                else:
                    other.append(head.split(b"\r\n")[0].decode())
                break
            if _held(port) > held:
                held += 1
                break
    time.sleep(0.5)  # what was freed is given back, if it is
    rss_after = _proc_bytes(pid, "VmRSS")
    peak = _proc_bytes(pid, "VmHWM")
    page = metrics_page(port)
    for s in conns:
        s.close()
    return Result(len(requests), held, refused, other, rss_before, rss_after, peak, page)


def _serve(spec: dict[str, Any]) -> None:
    import trio

    from llmgw_core.config import parse_config
    from llmgw_server.router.large_buffers import return_large_buffers
    from llmgw_server.wiring import main

    return_large_buffers()  # as every server process does where it starts (wiring.run)
    config = parse_config(
        {
            "server": {
                "listen": "127.0.0.1:0",
                "access_log": False,
                "max_body_bytes": spec["max_body"],
            },
            "router": spec["router"],
            # Never dialled: the model has no replica while the bench runs.
            "models": [
                {"name": name, "endpoints": ["http://127.0.0.1:9"]} for name in spec["models"]
            ],
        },
        "held_memory_bench",
    )

    async def serve() -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            running = await nursery.start(lambda **kw: main(config, stop=stop, **kw))
            for name in spec["models"]:
                running.router.served.set_endpoints(name, ())
            running.router.served.set_autoscaled(frozenset(spec["models"]))
            print(running.port, flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)
            stop.set()

    trio.run(serve)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=100, help="requests (100)")
    parser.add_argument("--mib", type=float, default=16.0, help="body MiB each (16)")
    parser.add_argument(
        "--models", type=int, default=1, help="autoscaled models, sent to in turn (1)"
    )
    parser.add_argument("--budget-mib", type=int, default=256, help="hold_max_bytes (256)")
    parser.add_argument(
        "--model-budget-mib", type=int, default=128, help="hold_max_bytes_per_model (128)"
    )
    parser.add_argument("--count", type=int, default=256, help="hold_max_per_model (256)")
    parser.add_argument(
        "--no-budget", action="store_true", help="no byte knobs (a tree without them)"
    )
    args = parser.parse_args()
    if args.serve:
        _serve(json.loads(args.serve))
        return 0
    size = int(args.mib * MIB)
    router: dict[str, object] = {"hold_timeout_s": 600.0, "hold_max_per_model": args.count}
    budget = args.budget_mib * MIB
    if not args.no_budget:
        router["hold_max_bytes"] = budget
        router["hold_max_bytes_per_model"] = args.model_budget_mib * MIB
    models = tuple(f"chat{i}" if i else "chat" for i in range(args.models))
    child, port = start_router(router, max(size, 16 * MIB), models)
    bodies = {model: chat_request(size, model) for model in models}
    try:
        result = send_held(
            port, child.pid, [bodies[models[i % len(models)]] for i in range(args.n)]
        )
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    print(
        f"{result.sent} requests of {args.mib:g} MiB for {len(models)} model(s): {result.held} held, {result.refused} "
        f"answered 503 with Retry-After, other answers {result.other or 'none'}\n"
        f"router RSS {result.rss_before / MIB:.0f} MiB -> {result.rss_after / MIB:.0f} MiB "
        f"(+{result.growth / MIB:.0f} MiB; peak {result.peak / MIB:.0f} MiB)"
    )
    if args.no_budget:
        return 0
    bound = budget * 1.1
    verdict = "PASS" if result.growth <= bound else "FAIL"
    print(
        f"{verdict}  RSS growth {result.growth / MIB:.0f} MiB <= budget + 10% ({bound / MIB:.0f} MiB)"
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
