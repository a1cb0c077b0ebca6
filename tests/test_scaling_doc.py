"""docs/scaling.md says what the code does: the protocol version it states is the wire's,
it covers autoscaling, and its local-fleet recipe runs the files `demo --keep` leaves."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw_core.wire import PROTOCOL
from llmgw_server.demo import NODES

ROOT = Path(__file__).parents[1]
TEXT = (ROOT / "docs" / "scaling.md").read_text()


def _section(title: str) -> str:
    assert f"\n## {title}\n" in TEXT, title
    return TEXT.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_protocol_it_states_is_the_wires() -> None:
    stated = re.findall(r"current protocol is (\d+)", TEXT)
    assert stated == [str(PROTOCOL)]


def test_it_covers_autoscaling_and_links_where_the_rest_lives() -> None:
    text = _section("Autoscaling a model's replicas")
    assert "[models.autoscale]" in text and "min = 0" in text
    assert "starts at 0 replicas" in text
    assert "(../README.md#operating-it)" in text and "(control-plane.md#" in text
    readme = (ROOT / "README.md").read_text()
    assert "\n## Operating it\n" in readme and "**Autoscaling.**" in readme


def test_the_local_fleet_recipe_starts_the_files_the_demo_keeps() -> None:
    text = _section("A local fleet on one machine")
    assert ".venv/bin/python -m llmgw_server.demo --keep ~/llmgw-fleet" in text
    started = re.findall(
        r"^\.venv/bin/python -m (llmgw_\w+) --config ~/llmgw-fleet/(\S+)$", text, re.M
    )
    assert started == [("llmgw_server", "server.toml")] + [
        ("llmgw_agent", f"{name}.toml") for name, _ in NODES
    ]
