"""Install and run as a service (issue 11): the wheel built from the sources installs into
a clean virtualenv, both daemons start from it with the command lines of the shipped
systemd units (install path and config directory swapped for temporary ones, working
directory /, a service manager's bare environment), and the units verify.

The wheel is built from a copy of what a fresh clone holds (pyproject.toml, README.md,
src/), so nothing is written into the checkout; pip takes the dependencies from its
configured index, as `pip install` of the wheel does for a user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from procs import free_port

# One worker builds and installs the wheel (a session fixture) and runs every test of it.
pytestmark = pytest.mark.xdist_group("install")

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "conf" / "systemd"
PREFIX = "/opt/llmgw/bin/"  # where the units expect the installed entry points
CONFIG_DIR = "/etc/llmgw/"
SERVICE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8"}  # fmt: skip


def read_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's settings by section; a key given twice keeps both values in order."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(unit: str) -> dict[str, list[str]]:
    return read_unit((UNITS / unit).read_text())["Service"]


def one(settings: dict[str, list[str]], key: str) -> str:
    assert len(settings.get(key, [])) == 1, (key, settings.get(key))
    return settings[key][0]


def rewritten(unit: str, bin_dir: Path, etc: Path) -> str:
    """The unit with its install path and config directory swapped for test ones."""
    text = (UNITS / unit).read_text()
    assert PREFIX in text and CONFIG_DIR in text
    return text.replace(PREFIX, f"{bin_dir}/").replace(CONFIG_DIR, f"{etc}/")


def exec_start(unit: str, bin_dir: Path, etc: Path) -> list[str]:
    return shlex.split(one(read_unit(rewritten(unit, bin_dir, etc))["Service"], "ExecStart"))


# -- the unit files' content (no install needed) -------------------------------------


def test_units_run_the_declared_entry_points() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for unit, program in (("llmgw-server.service", "llmgw-server"),
                          ("llmgw-agent.service", "llmgw-agent")):  # fmt: skip
        argv = shlex.split(one(service(unit), "ExecStart"))
        assert argv[0] == PREFIX + program and program in scripts
        assert argv[1:3] == ["--config", f"{CONFIG_DIR}{program.removeprefix('llmgw-')}.toml"]


@pytest.mark.parametrize(
    "unit", ["llmgw-server.service", "llmgw-agent.service", "llmgw-router.service"]
)
def test_units_restart_on_failure_but_not_on_a_config_error(unit: str) -> None:
    settings = service(unit)
    assert one(settings, "Restart") == "on-failure"
    assert "2" in one(settings, "RestartPreventExitStatus").split()  # a config error exits 2
    assert int(one(settings, "LimitNOFILE")) >= 1 << 20  # 10,000 agent streams and more


@pytest.mark.parametrize(
    "unit", ["llmgw-server.service", "llmgw-agent.service", "llmgw-router.service"]
)
def test_units_are_hardened(unit: str) -> None:
    settings = service(unit)
    assert one(settings, "NoNewPrivileges") == "yes"
    assert one(settings, "ProtectSystem") == "strict"
    assert one(settings, "User") == "llmgw"


def test_the_server_unit_is_sandboxed_tightly() -> None:
    settings = service("llmgw-server.service")
    for key in ("PrivateTmp", "PrivateDevices", "ProtectHome", "RestrictNamespaces"):
        assert one(settings, key) == "yes", key
    assert one(settings, "CapabilityBoundingSet") == ""


def test_the_server_unit_takes_its_socket_from_the_socket_unit() -> None:
    """systemd holds the router's socket across a restart (test_restart_e2e): the socket
    unit listens where the server's default config does, and the service asks for it."""
    from llmgw_core.config import ServerSection

    socket_unit = read_unit((UNITS / "llmgw-server.socket").read_text())["Socket"]
    default = ServerSection().listen
    assert one(socket_unit, "ListenStream") == f"{default.host}:{default.port}"
    unit = read_unit((UNITS / "llmgw-server.service").read_text())["Unit"]
    assert "llmgw-server.socket" in unit["Wants"]
    assert "llmgw-server.socket" in one(unit, "After").split()


def test_the_agent_unit_leaves_engines_alone_on_restart() -> None:
    """systemd's default KillMode (control-group) would kill every engine with the agent,
    and a restarted agent would have nothing to adopt."""
    assert one(service("llmgw-agent.service"), "KillMode") == "process"


def test_the_agent_unit_lets_engines_reach_the_gpus() -> None:
    settings = service("llmgw-agent.service")
    # device allow-lists (ProtectClock= implies one) hide /dev/nvidia*; PrivateTmp= and
    # RemoveIPC= are undone under engines that outlive the agent; W^X breaks JIT compilers
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
                "PrivateTmp", "RemoveIPC", "DynamicUser", "MemoryDenyWriteExecute",
                "RestrictAddressFamilies", "ProtectKernelLogs", "PrivateNetwork"):  # fmt: skip
        assert key not in settings, key
    assert one(settings, "TasksMax") == "infinity"


def test_the_agent_unit_can_write_the_example_state_dir() -> None:
    """ProtectSystem=strict makes / read-only: the shipped agent config's state_dir must be
    one of the unit's writable paths."""
    example = tomllib.loads((REPO / "conf" / "agents" / "gpu-node-1.toml").read_text())
    settings = service("llmgw-agent.service")
    writable = {f"/var/lib/{d}" for d in settings.get("StateDirectory", [])}
    writable |= {p for v in settings.get("ReadWritePaths", []) for p in v.split()}
    assert example["state_dir"] in writable


# -- the wheel, installed -----------------------------------------------------------


class Installed:
    def __init__(self, wheel: Path, bin_dir: Path) -> None:
        self.wheel = wheel
        self.bin = bin_dir

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]],
            capture_output=True, text=True, timeout=timeout, cwd="/", env=SERVICE_ENV,
        )  # fmt: skip


def _run(argv: list[str], timeout: float) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"


# Session, not module: pytest-xdist (make test) may hand a worker another module's tests
# between two of these, and a module fixture would be made again each time.
@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("install")
    clone = root / "clone"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, clone / name)
    shutil.copytree(
        REPO / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(clone)], 300)
    (wheel,) = dist.glob("llmgw-*.whl")
    venv = root / "venv"
    # Without a pip of its own (ensurepip costs about 6 s of CPU): this pip installs into it.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", str(wheel)], 300)
    return Installed(wheel, venv / "bin")


def test_the_wheel_declares_the_entry_points_and_python(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = wheel.namelist()
        info = next(n.rsplit("/", 1)[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        metadata = wheel.read(f"{info}/METADATA").decode()
    for script in ("llmgw-server", "llmgw-agent", "llmgw-mock-engine"):
        assert f"{script} = " in entry_points
    assert "Requires-Python: >=3.11" in metadata.splitlines()
    assert "llmgw_server/control/reconciler.py" in names
    assert not any("tests/" in n or "__pycache__" in n for n in names)


def test_the_installed_commands_run_from_the_wheel_not_the_checkout(installed: Installed) -> None:
    done = installed.run("python", "-c", "import llmgw_server, llmgw_agent; "
                         "print(llmgw_server.__file__); print(llmgw_agent.__file__)")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for line in done.stdout.split():
        assert line.startswith(str(installed.bin.parent)) and "site-packages" in line
    for command in ("llmgw-server", "llmgw-agent", "llmgw-mock-engine"):
        done = installed.run(command, "--help")
        assert done.returncode == 0, (command, done.stderr)
        assert "usage:" in done.stdout


def test_check_config_of_the_shipped_examples(installed: Installed) -> None:
    done = installed.run("llmgw-server", "check-config", str(REPO / "conf" / "router.toml"))
    assert done.returncode == 0, done.stderr


def test_config_errors_exit_2_in_one_line(installed: Installed) -> None:
    """What RestartPreventExitStatus=2 relies on; the shipped agent example as it is."""
    done = installed.run("llmgw-agent", "--config", str(REPO / "conf" / "agents" / "gpu-node-1.toml"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"llmgw-agent: config error: {REPO}/conf/agents/gpu-node-1.toml: server: "
        "'wss://<control-plane-host>:8081/v1/agent': '<control-plane-host>' is not a host "
        "name or IP address"
    ]
    done = installed.run("llmgw-server", "--config", "/nonexistent/server.toml")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


class Daemon:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.popen = subprocess.Popen(
            argv, cwd="/", env=SERVICE_ENV, stdout=self._out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._out.close()
        return self.popen.returncode


def wait_for(check: Callable[[], Any], daemons: list[Daemon], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in daemons:
            if d.popen.poll() is not None:
                raise AssertionError(f"{d.popen.args!r} exited {d.popen.returncode}:\n{d.output()}")
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.1)
    logs = "\n".join(f"--- {d.popen.args!r}\n{d.output()}" for d in daemons)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


@pytest.fixture
def etc(tmp_path: Path, installed: Installed) -> Iterator[Path]:
    """An /etc/llmgw: configs with relative paths only, certificates made by the installed
    `llmgw-server certs`; engines left by the agent are ended at teardown."""
    etc = tmp_path / "etc" / "llmgw"
    for argv in (("certs", "init", str(etc / "certs")), ("certs", "issue", "node-1", str(etc / "certs"))):
        done = installed.run("llmgw-server", *argv)
        assert done.returncode == 0, done.stderr
    port, control = free_port(), free_port()
    (etc / "server.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ncontrol_listen = "127.0.0.1:{control}"\n'
        "shutdown_grace_s = 2\n"
        '[agents]\nca = "certs/ca.crt"\ncert = "certs/server.crt"\nkey = "certs/server.key"\n'
        "[control]\nsettle_after_start_s = 0\n"
        '[[models]]\nname = "tiny"\n[models.profile]\nengine = "mock"\nmodel = "org/tiny"\n'
    )
    shutil.copy(REPO / "conf" / "sim" / "node-2xl4.toml", etc / "node-2xl4.toml")
    (etc / "agent.toml").write_text(
        f'name = "node-1"\nserver = "wss://127.0.0.1:{control}/v1/agent"\n'
        'state_dir = "state"\ninventory_file = "node-2xl4.toml"\nbind_host = "127.0.0.1"\n'
        "stop_grace_s = 3\n"
        '[tls]\nca = "certs/ca.crt"\ncert = "certs/nodes/node-1.crt"\n'
        'key = "certs/nodes/node-1.key"\n'
    )
    yield etc
    for record in (etc / "state" / "shards").glob("*.json"):
        pid = json.loads(record.read_text())["pid"]
        # An agent that stops leaves its engines to the next one: end them here. Each
        # engine leads its own process group. (Never /usr/bin/kill -KILL -PID: procps-ng
        # 4.0.2 takes that for kill -1, every process.)
        if isinstance(pid, int) and pid > 1:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def test_both_daemons_start_with_the_units_command_lines(
    tmp_path: Path, installed: Installed, etc: Path
) -> None:
    server_toml = tomllib.loads((etc / "server.toml").read_text())
    url = f"http://{server_toml['server']['listen']}"
    server = Daemon(exec_start("llmgw-server.service", installed.bin, etc), tmp_path / "server.log")
    agent: Daemon | None = None
    try:
        wait_for(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200, [server],
                 "the server's /healthz")  # fmt: skip
        agent = Daemon(exec_start("llmgw-agent.service", installed.bin, etc), tmp_path / "agent.log")

        def answered() -> bool:
            response = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            return response.status_code == 200 and bool(response.json()["choices"])

        # the agent registered over mTLS, the control plane placed the model on it, the
        # agent started the mock engine from the wheel, and the router reaches it
        wait_for(answered, [server, agent], "a chat completion through the router")
        assert "config error" not in server.output() + agent.output()
    finally:
        codes = (agent.stop() if agent else 0, server.stop())
    assert codes == (0, 0), f"exit codes {codes}:\n{server.output()}\n{agent and agent.output()}"


@pytest.mark.parametrize(
    "unit", ["llmgw-server.service", "llmgw-agent.service", "llmgw-router.service"]
)
def test_units_verify(tmp_path: Path, installed: Installed, unit: str) -> None:
    """`systemd-analyze verify` with ExecStart at the installed entry point. It exits 0
    on an unknown key or a bad value and only says so: anything it says about the unit
    fails the test (a broken copy shows that it is heard)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze is not installed (apt-get install systemd): the units' "
            "content is checked by the tests above, their syntax is not"
        )

    def complaints(text: str, name: str) -> list[str]:
        path = tmp_path / name
        path.write_text(text)
        done = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        said = [line for line in (done.stdout + done.stderr).splitlines() if name in line]
        return said if said or done.returncode == 0 else [f"exit {done.returncode}: {done.stderr}"]

    text = rewritten(unit, installed.bin, tmp_path)
    assert complaints(text, unit) == []
    broken = text.replace("Restart=on-failure", "Restart=on-falure")
    assert complaints(broken, f"broken-{unit}"), "systemd-analyze let a bad value pass"
