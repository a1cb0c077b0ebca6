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
