"""The fleet page's "live" badge shows only once a snapshot is drawn: app.js run by
node against a stub DOM and a stream fed one line at a time (tests/ui_js/badge.js).
The page in a real browser is tests/test_ui.py's."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_badge_says_live_only_after_the_first_snapshot_is_drawn() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's script is run by it here")
    done = subprocess.run(
        [node, str(ROOT / "tests" / "ui_js" / "badge.js"), str(ROOT / "src" / "llmgw_server" / "ui" / "app.js")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    steps = {s["step"]: s["badge"] for s in map(json.loads, done.stdout.splitlines())}
    assert steps == {
        "headers": "connected; waiting for the fleet",  # the stream is open, nothing drawn
        "keepalive": "connected; waiting for the fleet",
        "snapshot": "live",
    }
