"""A restart of the server (SIGTERM, then the same command again, as systemd's
`systemctl restart` and Restart= do) is not an outage: no request fails, and none
waits longer than the restart takes. Real processes: the server with its control plane,
handed its listening socket as systemd's llmgw-server.socket does (LISTEN_FDS; this test
holds the socket, as systemd would), and an agent with simulated GPUs running mock
engines, with a long reconnect backoff."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import attrs

from fleet import Fleet, wait_until
from llmgw_agent.agent import RESTART_JITTER_S
from procs import answers

MODEL = (
    '\n[[models]]\nname = "chat"\nreplicas = 2\n[models.profile]\nengine = "vllm"\n'
    'model = "org/chat"\ntensor_parallel = 1\ngpu_memory_gib = 20\n'
)
# Streams of 16 tokens at 40 a second: some are in flight at every moment.
SLOW = 'LLMGW_MOCK_TPS = "40"'
PROBE_EVERY_S = 0.05
STREAMS = 4
# The longest any request may wait across the restart is the restart itself (from SIGTERM:
# the old process drains its streams in flight, 0.4 s here, and the new one starts, about
# a second of Python's imports on an idle machine, several on a busy one) and then the
# agent, told that the control plane stops, back within RESTART_JITTER_S (0.5 s) of the new
# control port, and registered: this much past the restart. On its backoff instead (up to
# a minute here) it comes back far later; without the socket a connection is refused;
# without the hold a request meets 503.
AGENT_BACK_S = RESTART_JITTER_S + 2.5

# Execs the server with the socket at descriptor 3 and the variables sd_listen_fds(3)
# reads, its own pid included, as systemd does (exec keeps the pid).
ACTIVATE = (
    "import os, sys\n"
    "os.dup2(int(sys.argv[1]), 3)\n"
    "os.environ.update(LISTEN_FDS='1', LISTEN_PID=str(os.getpid()))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'llmgw_server', *sys.argv[2:]])\n"
)


@attrs.define
class Outcome:
    started: float
    ended: float
    error: str | None


@attrs.define
class Traffic:
    port: int
    outcomes: list[Outcome] = attrs.field(factory=list)
    stop: threading.Event = attrs.field(factory=threading.Event)

    def request(self, stream: bool) -> None:
        started = time.monotonic()
        error = None
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        # A new connection each time, as the probes of the report: none kept across the
        # restart (a keep-alive closed as it is reused is the client's to retry).
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(
                "POST", "/v1/chat/completions", json.dumps(body),
                {"content-type": "application/json"},
            )
            response = connection.getresponse()
            text = response.read()
            if response.status != 200:
                error = f"{response.status} {text[:200]!r}"
            elif stream and b"data: [DONE]" not in text:
                error = f"a stream without its end: {text[-200:]!r}"
        except (OSError, http.client.HTTPException) as exc:
            error = repr(exc)
        finally:
            connection.close()
        self.outcomes.append(Outcome(started, time.monotonic(), error))

    def streaming(self) -> None:
        while not self.stop.is_set():
            self.request(stream=True)

    def probing(self, pool: ThreadPoolExecutor) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            pool.submit(self.request, False)
            next_at += PROBE_EVERY_S
            self.stop.wait(max(next_at - time.monotonic(), 0))


class ActivatedServer:
    """`llmgw-server --config X` handed `sock` as systemd hands a socket unit's."""

    def __init__(self, sock: socket.socket, config: Path, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-c", ACTIVATE, str(sock.fileno()), "--config", str(config)],
                pass_fds=(sock.fileno(),),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def control_port_listening(log: Path, deadline: float) -> float:
    """When the restarted server's control port listens (its second such line)."""
    while time.monotonic() < deadline:
        if log.read_text().count("control plane listening on") >= 2:
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"the restarted server never listened:\n{log.read_text()}")


@contextmanager
def traffic_on(port: int) -> Iterator[Traffic]:
    traffic = Traffic(port)
    with ThreadPoolExecutor(max_workers=256) as pool:
        threads = [threading.Thread(target=traffic.streaming) for _ in range(STREAMS)]
        threads.append(threading.Thread(target=traffic.probing, args=(pool,)))
        for thread in threads:
            thread.start()
        try:
            yield traffic
        finally:
            traffic.stop.set()
            for thread in threads:
                thread.join(60)


def test_a_restart_fails_no_request_and_delays_none_past_the_bound(fleet: Fleet) -> None:
    config = fleet.server_config(MODEL)
    log = fleet.procs.tmp / "server.log"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", fleet.port))
    sock.listen(4096)
    servers = [ActivatedServer(sock, config, log)]
    try:
        wait_until(lambda: answers(fleet.port, "/healthz") == 200, what="the server")
        # A backoff of up to a minute (the default's, 2 s doubling to 60 s, after a few
        # failures): told of the restart, the agent comes back within half a second anyway.
        agent = fleet.agent(
            "gpu-1", "node-2xl4.toml", env=SLOW, reconnect="base_s = 60.0\ncap_s = 60.0"
        )
        wait_until(lambda: len(fleet.serving("chat")) == 2, what="two replicas", timeout=30)
        wait_until(lambda: answers(fleet.port, "/readyz") == 200, what="the router to follow")
        with traffic_on(fleet.port) as traffic:
            wait_until(lambda: len(traffic.outcomes) >= 20, what="traffic before the restart")
            old = servers[0].popen
            stopped_at = time.monotonic()
            os.kill(old.pid, signal.SIGTERM)
            assert old.wait(20) == 0
            restarted_at = time.monotonic()
            servers.append(ActivatedServer(sock, config, log))
            listening_at = control_port_listening(log, deadline=restarted_at + 30)
            # Until the agent is back on the new control plane, and a while of traffic after.
            try:
                wait_until(lambda: len(fleet.serving("chat")) == 2, what="both replicas back")
            except AssertionError as exc:  # once in CI (6 workers): what each side said
                agent_tail = "\n".join(agent.output().splitlines()[-30:])
                server_tail = "\n".join(log.read_text().splitlines()[-30:])
                raise AssertionError(
                    f"{exc}\nthe agent:\n{agent_tail}\nthe control plane:\n{server_tail}"
                ) from None
            back = len(traffic.outcomes)
            wait_until(lambda: len(traffic.outcomes) >= back + 20, what="traffic after")
        outcomes = traffic.outcomes
        failed = [o.error for o in outcomes if o.error is not None]
        assert failed == [], f"{len(failed)} of {len(outcomes)} failed: {failed[:5]}\n{log.read_text()}"
        across = [o for o in outcomes if o.ended >= restarted_at]
        assert across, "no request crossed the restart"
        slowest = max(o.ended - o.started for o in outcomes)
        restart_s = listening_at - stopped_at
        print(
            f"{len(outcomes)} requests, {len(across)} ended after the restart, slowest "
            f"{slowest:.2f} s, restart (SIGTERM to the new control port) {restart_s:.2f} s"
        )
        assert slowest <= restart_s + AGENT_BACK_S, (slowest, restart_s, log.read_text())
        output = log.read_text()
        assert "serving on 1 sockets from systemd" in output
        assert "closing 1 agent streams: the control plane is stopping" in output
    finally:
        for server in servers:
            server.stop()
        sock.close()
