"""Every annotated example under conf/ loads, so the examples never rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_core.config import load_config

CONF = Path(__file__).parent.parent / "conf"


@pytest.mark.parametrize("path", sorted(CONF.glob("*.toml")), ids=lambda p: p.name)
def test_example_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.catalog.models


@pytest.mark.parametrize("path", sorted((CONF / "agents").glob("*.toml")), ids=lambda p: p.name)
def test_example_agent_config_loads(path: Path) -> None:
    from llmgw_agent.config import load_agent_config

    config = load_agent_config(path)
    assert config.name and config.server.startswith("ws")
