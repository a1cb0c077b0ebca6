"""Every annotated example under conf/ loads, so the examples never rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_core.certs import init_ca, issue_node
from llmgw_core.config import load_config

CONF = (Path(__file__).parent.parent / "conf").resolve()


@pytest.fixture(autouse=True)
def certs_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples name certs/... relative to the working directory, as `certs init certs` makes."""
    init_ca(tmp_path / "certs")
    issue_node(tmp_path / "certs", "gpu-node-1")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("path", sorted(CONF.resolve().glob("*.toml")), ids=lambda p: p.name)
def test_example_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.catalog.models


@pytest.mark.parametrize("path", sorted((CONF / "agents").resolve().glob("*.toml")), ids=lambda p: p.name)
def test_example_agent_config_loads(path: Path) -> None:
    from llmgw_agent.config import load_agent_config

    config = load_agent_config(path)
    assert config.name and config.server.startswith("ws")
