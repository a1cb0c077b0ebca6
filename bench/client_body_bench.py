"""What a client's request body costs the router: CPU for bodies sent in small writes, and
RSS under unauthenticated uploads (issue 17, finding 5).

Starts one router process (one worker, no engine: a body that is read ends in 404 for its
unknown model) and measures its CPU time from /proc/PID/stat and its RSS from
/proc/PID/status:

  cpu: one request per body size (4 and 16 MiB by default), the body in 1 KiB writes;
       the router's user+system CPU seconds for each.
  chunks: one chunked body of 1-byte chunks, sent for up to 5 s; the router's CPU.
  rss: with an API key configured, N connections without a key each send a head with
       Content-Length 16 MiB and then 16 MiB - 1 bytes of body; RSS before and after.

Run: .venv/bin/python bench/client_body_bench.py [cpu|chunks|rss|both]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MIB = 1024 * 1024
_KEY_TOML = '[auth]\napi_keys = ["sha256:0000000000000000000000000000000000000000000000000000000000000000"]\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_router(tmp: Path, extra: str = "") -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    config = tmp / "router.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = 1\naccess_log = false\n'
        f'body_timeout_s = 600.0\n{extra}\n[[models]]\nname = "m"\nendpoints = ["http://127.0.0.1:9"]\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_server", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the router did not start")


def _head(length: int, key: bool = True) -> bytes:
    auth = b"authorization: Bearer nope\r\n" if key else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"%bcontent-length: %d\r\n\r\n" % (auth, length)
    )


def upload(port: int, size: int, write: int, key: bool = True) -> bytes:
    """Send a head and `size` body bytes in writes of `write` bytes; what the router answered."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head(size, key))
        piece = b"x" * write
        try:
            for _ in range(size // write):
                sock.sendall(piece)
            sock.sendall(b"x" * (size % write))
        except OSError:
            pass  # the router answered and closed before the whole body
        sock.settimeout(30)
        try:
            return sock.recv(200).split(b"\r\n", 1)[0]
        except OSError as exc:
            return repr(exc).encode()


def cpu(sizes: tuple[int, ...] = (4, 16)) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_router(Path(tmp))
        try:
            time.sleep(1)
            for mib in sizes:
                before = _cpu_s(proc.pid)
                answer = upload(port, mib * MIB, 1024)
                print(
                    f"{mib} MiB body in 1 KiB writes: router CPU {_cpu_s(proc.pid) - before:.2f} s"
                    f" ({answer.decode(errors='replace')})"
                )
        finally:
            proc.terminate()
            proc.wait()


def tiny_chunks(seconds: float = 5.0) -> None:
    """One body in 1-byte chunks, sent as fast as the router reads it for `seconds`."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_router(Path(tmp))
        try:
            time.sleep(1)
            before = _cpu_s(proc.pid)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                deadline = time.monotonic() + seconds
                sent = 0
                try:
                    while time.monotonic() < deadline:
                        sock.sendall(b"1\r\nx\r\n" * 1000)
                        sent += 1000
                except OSError:
                    pass  # refused
                sock.settimeout(5)
                try:
                    answer = sock.recv(200).split(b"\r\n", 1)[0]
                except OSError as exc:
                    answer = repr(exc).encode()
            print(
                f"1-byte chunks for up to {seconds:g} s ({sent} sent): router CPU "
                f"{_cpu_s(proc.pid) - before:.2f} s ({answer.decode(errors='replace')})"
            )
        finally:
            proc.terminate()
            proc.wait()


def rss(connections: int = 30) -> float:
    """RSS growth in MiB under `connections` keyless 16 MiB uploads (one byte short), with
    every connection still open when RSS is read."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_router(Path(tmp), "max_body_bytes = 16777216\n" + _KEY_TOML)
        try:
            time.sleep(1)
            before = _rss_mib(proc.pid)
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
            body = b"x" * (16 * MIB - 1)

            def send(sock: socket.socket) -> None:
                try:
                    sock.sendall(_head(16 * MIB, key=False) + body)
                except OSError:
                    pass  # refused and closed before the whole body

            threads = [threading.Thread(target=send, args=(s,)) for s in socks]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            time.sleep(1)
            after = _rss_mib(proc.pid)
            answers = set()
            for sock in socks:
                sock.settimeout(1)
                try:
                    answers.add(sock.recv(100).split(b"\r\n", 1)[0])
                except OSError as exc:
                    answers.add(type(exc).__name__.encode())
                sock.close()
            print(
                f"{connections} keyless 16 MiB uploads: RSS {before:.0f} -> {after:.0f} MiB"
                f" (+{after - before:.0f}); answers: {sorted(answers)}"
            )
            return after - before
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "both"
    if what in ("cpu", "both"):
        cpu()
    if what in ("chunks", "both"):
        tiny_chunks()
    if what in ("rss", "both"):
        rss()
