"""The CLI's account of a drain, from successive status snapshots (no server needed)."""

from __future__ import annotations

from typing import Any

from llmgw_server.admin_cli import DrainProgress, follow_drain


def replica(
    rid: str, node: str, state: str, *, serving: bool = False, moving: bool = False
) -> dict[str, Any]:
    return {
        "replica_id": rid,
        "model": "chat",
        "phase": "retiring" if state == "draining" else "live",
        "serving": serving,
        "moving": moving,
        "shards": [{"node": node, "state": state, "retiring": state == "draining"}],
    }


def snapshot(*replicas: dict[str, Any], unplaced: str | None = None) -> dict[str, Any]:
    why = {"waiting": None, "explanation": unplaced, "count": 1} if unplaced else None
    return {
        "nodes": [{"name": "gpu-1", "draining": True}, {"name": "gpu-2", "draining": False}],
        "replicas": list(replicas),
        "models": [{"name": "chat", "unplaced": why}],
    }


OLD = replica("chat-1", "gpu-1", "ready", serving=True)
MOVING = replica("chat-1", "gpu-1", "ready", serving=True, moving=True)


def test_each_replica_is_told_once_per_change_until_the_node_is_empty() -> None:
    progress = DrainProgress("gpu-1", snapshot(OLD))
    steps = [
        snapshot(MOVING, replica("chat-2", "gpu-2", "pending")),
        snapshot(MOVING, replica("chat-2", "gpu-2", "pending")),  # nothing new
        snapshot(MOVING, replica("chat-2", "gpu-2", "ready", serving=True)),
        snapshot(
            replica("chat-1", "gpu-1", "draining"),
            replica("chat-2", "gpu-2", "ready", serving=True),
        ),
        snapshot(replica("chat-2", "gpu-2", "ready", serving=True)),
    ]
    told = [progress.update(s) for s in steps]
    assert told == [
        (
            [
                "chat-1 (chat): serves on gpu-1 until its replacement serves",
                "chat-2 (chat): replacement on gpu-2: live (pending)",
            ],
            False,
        ),
        ([], False),
        (["chat-2 (chat): replacement on gpu-2: serves"], False),
        (
            ["chat-1 (chat): leaving gpu-1: no new requests, stopping once those in flight end"],
            False,
        ),
        (["chat-1 (chat): stopped, off gpu-1"], True),
    ]


def test_a_replacement_with_no_room_is_explained_and_an_undrain_ends_the_watch() -> None:
    out: list[str] = []
    snapshots = iter(
        [
            snapshot(MOVING, unplaced="0 of 2 nodes fit: 1 draining (gpu-1); 1 cordoned (gpu-2)"),
            {**snapshot(OLD), "nodes": [{"name": "gpu-1", "draining": False}]},
        ]
    )
    code = follow_drain("gpu-1", snapshot(OLD), lambda: next(snapshots), poll_s=0, out=out.append)
    assert code == 1
    assert out == [
        "chat-1 (chat): serves on gpu-1 until its replacement serves",
        "chat: no room for a replacement yet: 0 of 2 nodes fit: 1 draining (gpu-1); "
        "1 cordoned (gpu-2); it serves on from gpu-1 meanwhile "
        "(`drain --force` stops it without one)",
        "gpu-1: no longer draining; stopped following",
    ]


def test_a_forced_drain_tells_no_room_without_the_hint_to_force() -> None:
    forced = {"name": "gpu-1", "draining": True, "drain_forced": True}
    why = "0 of 2 nodes fit: 1 draining (gpu-1); 1 lost (gpu-2)"
    progress = DrainProgress("gpu-1", snapshot(OLD))
    lines, done = progress.update({**snapshot(MOVING, unplaced=why), "nodes": [forced]})
    assert (lines, done) == (
        [
            "chat-1 (chat): serves on gpu-1 until its replacement serves",
            f"chat: no room for a replacement yet: {why}",
        ],
        False,
    )
