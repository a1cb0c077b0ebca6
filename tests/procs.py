"""Real processes on free loopback ports, for end-to-end tests."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import warm_start

# Where the processes' logs go: pytest's temporary directory for the session (conftest
# sets it; pytest keeps the last three sessions' and removes older ones), so a test run
# leaves no logs in the system's temporary directory.
LOG_DIR: Path | None = None


# The ports tests hand to the processes they start. Below the kernel's ephemeral range
# (32768 on), so that no outgoing connection of another test takes one between this check
# and the child's own bind (seen under pytest-xdist: a mock engine's port taken by then),
# and below the agents' default engine ports (20000-20999) and the fleets' blocks
# (21000-32699, tests/fleet.py). Under pytest-xdist each worker walks a slice of its own,
# so that two workers never hand out the same port; a slice, not every n-th port, since
# the demo also takes the 101 ports after the one it is given.
PORTS = range(10000, 20000)
_handed_out = 0


def free_port() -> int:
    global _handed_out
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = len(PORTS) // max(workers, 1)
    own = PORTS[worker * size : (worker + 1) * size]
    for _ in range(len(own)):
        port = own[_handed_out % len(own)]
        _handed_out += 1
        with socket.socket() as s:
            # As the servers bind: a port in TIME_WAIT from an earlier test is free to them.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port among this worker's {len(own)}")


def answers(port: int, path: str) -> int | None:
    """The status GET `path` gets on loopback `port`, or None while nothing answers.

    http.client, not httpx: a poll costs a millisecond, where httpx.get builds a client
    and loads the system's CA bundle each time (about 0.2 s of CPU on a busy 2-core
    machine, taken from the very process being waited for)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


class Proc:
    def __init__(self, argv: Sequence[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = list(argv)
        directory = LOG_DIR or Path(tempfile.gettempdir())
        self.log = directory / f"llmgw-test-{port}-{time.monotonic_ns()}.log"
        self._log_file = self.log.open("wb")
        environ = {**os.environ, **(env or {})}
        warm = warm_start.start(self.argv, environ, str(self.log))
        self.popen: subprocess.Popen[bytes] | warm_start.WarmPopen = warm or subprocess.Popen(
            self.argv,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_http(self, path: str, timeout: float = 15.0, status: int = 200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.argv} exited {self.popen.returncode}:\n{self.output()}"
                )
            if answers(self.port, path) == status:
                return
            time.sleep(0.05)
        raise AssertionError(f"{self.url}{path} never answered {status}:\n{self.output()}")

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signum)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        self._log_file.close()


class Procs:
    """Starts processes and stops every one of them at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.all: list[Proc] = []

    def mock(
        self,
        model: str = "m",
        *flags: str,
        port: int | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Proc:
        port = port or free_port()
        proc = Proc(
            [
                sys.executable,
                "-m",
                "llmgw_mock_engine",
                "serve",
                model,
                "--port",
                str(port),
                *flags,
            ],
            port,
            env,
        )
        self.all.append(proc)
        if wait:
            proc.wait_http("/health")
        return proc

    def engine(
        self, argv: Sequence[str], port: int, *, env: dict[str, str] | None = None, timeout: float = 60
    ) -> Proc:
        """Any engine process serving on `port`, once its /health answers 200."""
        proc = Proc(argv, port, env)
        self.all.append(proc)
        proc.wait_http("/health", timeout=timeout)
        return proc

    def router(self, config: str, *, server: str = "", wait: bool = True) -> Proc:
        """A router on a free port; `server` holds more lines for its [server] table."""
        port = free_port()
        path = self.tmp / f"router-{port}.toml"
        path.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\n{server}\n' + config)
        proc = Proc([sys.executable, "-m", "llmgw_server", "--config", str(path)], port)
        self.all.append(proc)
        if wait:
            proc.wait_http("/readyz")
        return proc

    def stop_all(self) -> None:
        for proc in self.all:
            proc.stop()


def models_toml(models: dict[str, Sequence[str]]) -> str:
    return "".join(
        f'\n[[models]]\nname = "{name}"\nendpoints = [{", ".join(repr(u) for u in urls)}]\n'.replace(
            "'", '"'
        )
        for name, urls in models.items()
    )


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text page (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        if (
            base == name
            and all(f'{k}="{v}"' in rest for k, v in labels.items())
            and (want or not rest)
        ):
            return float(value)
    return 0.0
