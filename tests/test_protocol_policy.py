"""The agent protocol's version policy: the control plane takes its version and one behind."""

from __future__ import annotations

from llmgw_core.wire import PROTOCOL, accepts


def test_the_control_plane_accepts_agents_at_its_version_and_one_behind() -> None:
    assert accepts(PROTOCOL) is None
    assert accepts(PROTOCOL - 1) is None  # a rolling upgrade: control plane first


def test_newer_and_older_agents_are_refused_with_what_to_upgrade() -> None:
    newer = accepts(PROTOCOL + 1)
    assert newer is not None
    assert newer.startswith(f"protocol version {PROTOCOL + 1} is not supported")
    assert newer.endswith("upgrade the control plane before its agents")
    older = accepts(PROTOCOL - 2)
    assert older is not None and older.endswith("upgrade the agent")
    assert f"speaks {PROTOCOL - 1} and {PROTOCOL}" in older
