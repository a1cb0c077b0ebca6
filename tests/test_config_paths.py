"""Relative paths in every config are taken from the config file's directory, never from
the working directory (a service manager starts daemons in /), and an agent config for a
real node cannot advertise an address its router cannot reach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from llmgw_agent.config import AgentConfig, load_agent_config, parse_agent_config
from llmgw_agent.inventory_probe import take_inventory
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.config import load_config
from llmgw_core.tomlshape import ConfigError

SIM = Path(__file__).parent.parent / "conf" / "sim" / "node-2xl4.toml"

SERVER = """
[server]
listen = "127.0.0.1:0"
control_listen = "127.0.0.1:0"
[agents]
ca = "tls/ca.crt"
cert = "tls/server.crt"
key = "tls/server.key"
[[models]]
name = "m"
[models.profile]
engine = "mock"
model = "org/m"
"""


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """/etc/llmgw-like: configs and tls/ in one directory; the working directory elsewhere
    (and holding a decoy tls/ that a cwd-relative reading would pick up)."""
    etc = tmp_path / "etc"
    init_ca(etc / "tls")
    issue_node(etc / "tls", "n1")
    (etc / "server.toml").write_text(SERVER)
    work = tmp_path / "work"
    (work / "tls").mkdir(parents=True)
    monkeypatch.chdir(work)
    return etc


def test_server_tls_paths_are_taken_from_the_config_files_directory(layout: Path) -> None:
    config = load_config(layout / "server.toml")
    assert config.agents.ca == layout / "tls" / "ca.crt"
    assert config.agents.cert == layout / "tls" / "server.crt"
    assert config.agents.key == layout / "tls" / "server.key"


def test_a_relative_config_path_still_anchors_in_its_own_directory(
    layout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config etc/server.toml` from the parent: the paths are absolute afterwards, so a
    later change of directory cannot move them."""
    monkeypatch.chdir(layout.parent)
    config = load_config(Path("etc") / "server.toml")
    assert config.agents.ca == layout / "tls" / "ca.crt"
    assert config.agents.ca is not None and config.agents.ca.is_absolute()


def test_a_missing_file_is_named_by_the_path_it_was_looked_for_at(layout: Path) -> None:
    (layout / "tls" / "ca.crt").unlink()
    with pytest.raises(ConfigError) as caught:
        load_config(layout / "server.toml")
    assert str(caught.value) == (
        f"{layout / 'server.toml'}: agents.ca: {layout / 'tls' / 'ca.crt'} does not exist "
        "(`llmgw-server certs init DIR` makes the CA and the control plane's certificate, "
        "`llmgw-server certs issue NODE DIR` a node's)"
    )
    (layout / "tls" / "ca.crt").mkdir()  # there, but not a file
    with pytest.raises(ConfigError) as caught:
        load_config(layout / "server.toml")
    assert str(caught.value).endswith(f"agents.ca: {layout / 'tls' / 'ca.crt'} is not a file")


def test_absolute_and_home_paths_are_kept(layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(layout))
    text = SERVER.replace('"tls/ca.crt"', f'"{layout}/tls/ca.crt"').replace(
        '"tls/server.crt"', '"~/tls/server.crt"'
    )
    (layout / "server.toml").write_text(text)
    config = load_config(layout / "server.toml")
    assert config.agents.ca == layout / "tls" / "ca.crt"
    assert config.agents.cert == layout / "tls" / "server.crt"


def test_a_home_path_of_no_such_user_is_a_config_error(layout: Path) -> None:
    text = SERVER.replace('"tls/ca.crt"', '"~no-such-user-llmgw/ca.crt"')
    (layout / "server.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"agents\.ca: '~no-such-user-llmgw/ca.crt'"):
        load_config(layout / "server.toml")


def _agent(layout: Path, body: str) -> Path:
    path = layout / "agent.toml"
    path.write_text(
        'name = "n1"\nserver = "wss://127.0.0.1:8081/v1/agent"\n'
        f"{body}\n"
        '[tls]\nca = "tls/ca.crt"\ncert = "tls/nodes/n1.crt"\nkey = "tls/nodes/n1.key"\n'
    )
    return path


def test_agent_paths_are_taken_from_the_config_files_directory(layout: Path) -> None:
    (layout / "sim").mkdir()
    (layout / "sim" / "inv.toml").write_text(SIM.read_text())
    path = _agent(
        layout,
        'state_dir = "state"\ninventory_file = "sim/inv.toml"\n'
        '[engines.llamacpp]\ncommand = ["bin/llama-server", "--verbose"]\n'
        '[engines.vllm]\ncommand = ["vllm"]\n'
        '[engines.sglang]\ncommand = ["/usr/bin/python3", "-m", "sglang.launch_server"]\n',
    )
    config = load_agent_config(path)
    assert config.state_dir == layout / "state"
    assert config.inventory_file == layout / "sim" / "inv.toml"
    assert (config.tls.ca, config.tls.cert, config.tls.key) == (
        layout / "tls" / "ca.crt",
        layout / "tls" / "nodes" / "n1.crt",
        layout / "tls" / "nodes" / "n1.key",
    )
    # a program given as a path is the config's; a bare name is looked up on PATH
    assert config.engines["llamacpp"].command == (str(layout / "bin" / "llama-server"), "--verbose")
    assert config.engines["vllm"].command == ("vllm",)
    assert config.engines["sglang"].command == ("/usr/bin/python3", "-m", "sglang.launch_server")
    # and the inventory is read from there, whatever the working directory
    assert len(take_inventory(config).gpus) == 2


def test_agent_state_dir_default_is_absolute(layout: Path) -> None:
    config = load_agent_config(_agent(layout, ""))
    assert config.state_dir == Path("/var/lib/llmgw-agent")


def test_a_missing_inventory_file_is_an_error_of_the_agent_config_and_its_key(
    layout: Path,
) -> None:
    path = _agent(layout, 'inventory_file = "nope.toml"\n')
    # Said as written and as resolved: from the config's directory, not the working one.
    expected = f"{path}: inventory_file: nope.toml: no such file (resolved to {layout / 'nope.toml'})"
    with pytest.raises(ConfigError) as raised:
        load_agent_config(path)
    assert str(raised.value) == expected
    # The agent's start says it so, before probing anything (exit 2, one line).
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "--config", str(path)],
        cwd="/", capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (2, f"llmgw-agent: config error: {expected}\n")
    # An absolute path needs no resolving; a directory is no inventory.
    absent = layout / "absent.toml"
    with pytest.raises(ConfigError) as raised:
        load_agent_config(_agent(layout, f'inventory_file = "{absent}"\n'))
    assert str(raised.value) == f"{path}: inventory_file: {absent}: no such file"
    with pytest.raises(ConfigError) as raised:
        load_agent_config(_agent(layout, 'inventory_file = "tls"\n'))
    assert str(raised.value) == f"{path}: inventory_file: tls: is not a file (resolved to {layout / 'tls'})"


def test_server_check_config_from_another_directory(layout: Path) -> None:
    """The command line, as a service manager runs it: the working directory is /."""
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_server", "check-config", str(layout / "server.toml")],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# -- advertise_host ----------------------------------------------------------------


def _parse(**values: object) -> AgentConfig:
    data: dict[str, object] = {"name": "n1", "insecure": True, **values}
    return parse_agent_config(data, "<agent>")


def test_a_local_control_plane_needs_no_advertise_host() -> None:
    for server in ("ws://127.0.0.1:8081/v1/agent", "ws://localhost:8081/v1/agent",
                   "ws://[::1]:8081/v1/agent"):  # fmt: skip
        config = _parse(server=server)
        assert config.advertise_host == "127.0.0.1"


def test_a_remote_control_plane_needs_this_nodes_address() -> None:
    with pytest.raises(ConfigError, match=r"^<agent>: advertise_host: is required"):
        _parse(server="ws://10.0.0.1:8081/v1/agent")
    with pytest.raises(ConfigError, match=r"advertise_host: is required"):
        _parse(server="ws://control.example:8081/v1/agent")
    config = _parse(server="ws://10.0.0.1:8081/v1/agent", advertise_host="node-7.example")
    assert config.advertise_host == "node-7.example"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_a_remote_control_plane_refuses_a_loopback_advertise_host(host: str) -> None:
    with pytest.raises(ConfigError, match=r"is a loopback address, but the control plane is at"):
        _parse(server="ws://10.0.0.1:8081/v1/agent", advertise_host=host)


@pytest.mark.parametrize(
    "host", ["<this-node-address>", "10.0.0.11:8000", "http://10.0.0.11", "a b", "node_é", "-x"]
)
def test_an_advertise_host_that_is_no_host_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=r"advertise_host: .* is not a host name or IP address"):
        _parse(server="ws://10.0.0.1:8081/v1/agent", advertise_host=host)


@pytest.mark.parametrize("host", ["10.0.0.11", "fd00::11", "gpu-node-1", "gpu-1.dc.example"])
def test_real_advertise_hosts_are_taken(host: str) -> None:
    config = _parse(server="ws://10.0.0.1:8081/v1/agent", advertise_host=host)
    assert config.advertise_host == host


def test_a_server_url_with_a_placeholder_host_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"server: .*'<cp>' is not a host name or IP address"):
        _parse(server="ws://<cp>:8081/v1/agent")


def _load_as_another_user(path: Path) -> str:
    """What load_config says to a user who is not the key's owner (nobody, when these
    tests run as root, who reads every file)."""
    if os.geteuid() != 0:
        try:
            load_config(path)
        except ConfigError as exc:
            return str(exc)
        return "loaded"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                load_config(path)
                said = "loaded"
            except ConfigError as exc:
                said = str(exc)
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def test_a_key_the_daemons_user_cannot_read_is_a_config_error() -> None:
    """certs init makes keys 0600 for whoever ran it: a service's own user may not read
    them, which is one line (exit 2, not restarted) rather than a traceback at start."""
    etc = Path(tempfile.mkdtemp(prefix="llmgw-paths-"))
    try:
        etc.chmod(0o755)
        init_ca(etc / "tls")
        (etc / "server.toml").write_text(SERVER)
        for path in (etc / "server.toml", etc / "tls" / "ca.crt", etc / "tls" / "server.crt"):
            path.chmod(0o644)
        (etc / "tls").chmod(0o755)
        (etc / "tls" / "server.key").chmod(0o600 if os.geteuid() == 0 else 0)
        assert _load_as_another_user(etc / "server.toml") == (
            f"{etc / 'server.toml'}: agents.key: {etc / 'tls' / 'server.key'} cannot be read: "
            "Permission denied"
        )
        (etc / "tls" / "server.key").chmod(0o644)
        assert _load_as_another_user(etc / "server.toml") == "loaded"
    finally:
        shutil.rmtree(etc)
