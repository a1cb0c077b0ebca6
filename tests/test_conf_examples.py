"""Every annotated example under conf/ loads, so the examples never rot.

The examples name certs/... relative to their own directory; they are loaded from a
copy of conf/ with certificates made there, from another working directory, so that a
path that only works from the checkout's root fails here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmgw_agent.config import load_agent_config
from llmgw_agent.inventory_probe import read_simulated
from llmgw_core.certs import init_ca, issue_node
from llmgw_core.config import load_config
from llmgw_core.tomlshape import ConfigError

CONF = (Path(__file__).parent.parent / "conf").resolve()
AGENT_EXAMPLE = "agents/gpu-node-1.toml"


@pytest.fixture
def conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of conf/ with the certificates its examples name, and a working directory
    that is neither conf/ nor the checkout's root."""
    copy = tmp_path / "etc" / "llmgw"
    shutil.copytree(CONF, copy, ignore=shutil.ignore_patterns("certs"))
    for folder in (copy, copy / "agents"):
        init_ca(folder / "certs")
        issue_node(folder / "certs", "gpu-node-1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return copy


@pytest.mark.parametrize("name", sorted(p.name for p in CONF.glob("*.toml")))
def test_example_config_loads(conf: Path, name: str) -> None:
    config = load_config(conf / name)
    assert config.catalog.models
    if config.agents.ca is not None:
        assert config.agents.ca == conf / "certs" / "ca.crt"


def _edited(conf: Path, **values: str) -> Path:
    """The agent example with its placeholders replaced, as an operator would."""
    path = conf / AGENT_EXAMPLE
    text = path.read_text()
    for placeholder, value in values.items():
        assert f"<{placeholder}>" in text
        text = text.replace(f"<{placeholder}>", value)
    path.write_text(text)
    return path


def test_the_agent_example_refuses_to_run_until_its_placeholders_are_replaced(conf: Path) -> None:
    path = conf / AGENT_EXAMPLE
    with pytest.raises(ConfigError) as shipped:
        load_agent_config(path)
    assert str(shipped.value) == (
        f"{path}: server: 'wss://<control-plane-host>:8081/v1/agent': "
        "'<control-plane-host>' is not a host name or IP address"
    )
    _edited(conf, **{"control-plane-host": "10.0.0.1"})
    with pytest.raises(ConfigError, match=r"advertise_host: '<this-node-address>' is not a host"):
        load_agent_config(path)


def test_the_edited_agent_example_is_a_real_node(conf: Path) -> None:
    path = _edited(conf, **{"control-plane-host": "10.0.0.1", "this-node-address": "10.0.0.11"})
    config = load_agent_config(path)
    assert config.name == "gpu-node-1"
    assert config.server == "wss://10.0.0.1:8081/v1/agent"
    assert config.advertise_host == "10.0.0.11"
    assert config.bind_host == "10.0.0.11"  # engines listen where routers reach them only
    assert config.inventory_file is None  # the GPUs come from NVML, never from a simulation
    certs = conf / "agents" / "certs"
    assert (config.tls.ca, config.tls.cert, config.tls.key) == (
        certs / "ca.crt",
        certs / "nodes" / "gpu-node-1.crt",
        certs / "nodes" / "gpu-node-1.key",
    )


def test_the_agent_example_loopback_trap_is_refused(conf: Path) -> None:
    """What the example used to ship: a real node advertising 127.0.0.1 to a remote router."""
    path = _edited(conf, **{"control-plane-host": "10.0.0.1", "this-node-address": "127.0.0.1"})
    with pytest.raises(ConfigError, match=r"advertise_host: '127.0.0.1' is a loopback address"):
        load_agent_config(path)


def test_the_agent_examples_commented_simulation_points_at_a_shipped_inventory(conf: Path) -> None:
    path = _edited(conf, **{"control-plane-host": "10.0.0.1", "this-node-address": "10.0.0.11"})
    line = '# inventory_file = "../sim/node-8xh100.toml"'
    assert line in path.read_text()
    path.write_text(path.read_text().replace(line, line.removeprefix("# ")))
    config = load_agent_config(path)
    assert config.inventory_file == conf / "agents" / ".." / "sim" / "node-8xh100.toml"
    assert len(read_simulated(config.inventory_file).gpus) == 8


@pytest.mark.parametrize("name", sorted(p.name for p in (CONF / "sim").glob("*.toml")))
def test_simulated_inventories_load(name: str) -> None:
    assert read_simulated(CONF / "sim" / name).gpus
