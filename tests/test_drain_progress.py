"""The CLI's account of a drain, from successive status snapshots (no server needed)."""

from __future__ import annotations

import attrs

from llmgw_core.inventory import ShardState
from llmgw_server.admin_cli import DrainProgress, follow_drain
from llmgw_server.control.documents import ReplicaDoc, StatusDoc, UnplacedDoc
from llmgw_server.control.shards import Phase
from status_docs import model, node, shard, status


def replica(
    rid: str, node: str, state: ShardState, *, serving: bool = False, moving: bool = False
) -> ReplicaDoc:
    draining = state is ShardState.DRAINING
    return ReplicaDoc(
        replica_id=rid,
        model="chat",
        phase=Phase.RETIRING if draining else Phase.LIVE,
        serving=serving,
        kept=not moving,
        moving=moving,
        reason="",
        url="http://10.0.0.1:8000",
        attempt=0,
        failures=0,
        crash_loop=False,
        restart_in_s=None,
        shards=(shard(node, state, retiring=draining),),
    )


def snapshot(*replicas: ReplicaDoc, unplaced: str | None = None) -> StatusDoc:
    why = UnplacedDoc(1, unplaced, None) if unplaced else None
    return status(
        [node("gpu-1", draining=True), node("gpu-2")],
        replicas,
        [model("chat", unplaced=why)],
    )


OLD = replica("chat-1", "gpu-1", ShardState.READY, serving=True)
MOVING = replica("chat-1", "gpu-1", ShardState.READY, serving=True, moving=True)
READY, PENDING, DRAINING = ShardState.READY, ShardState.PENDING, ShardState.DRAINING


def test_each_replica_is_told_once_per_change_until_the_node_is_empty() -> None:
    progress = DrainProgress("gpu-1", snapshot(OLD))
    steps = [
        snapshot(MOVING, replica("chat-2", "gpu-2", PENDING)),
        snapshot(MOVING, replica("chat-2", "gpu-2", PENDING)),  # nothing new
        snapshot(MOVING, replica("chat-2", "gpu-2", READY, serving=True)),
        snapshot(
            replica("chat-1", "gpu-1", DRAINING),
            replica("chat-2", "gpu-2", READY, serving=True),
        ),
        snapshot(replica("chat-2", "gpu-2", READY, serving=True)),
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
            attrs.evolve(snapshot(OLD), nodes=(node("gpu-1"),)),
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
    forced = node("gpu-1", draining=True, drain_forced=True)
    why = "0 of 2 nodes fit: 1 draining (gpu-1); 1 lost (gpu-2)"
    progress = DrainProgress("gpu-1", snapshot(OLD))
    lines, done = progress.update(attrs.evolve(snapshot(MOVING, unplaced=why), nodes=(forced,)))
    assert (lines, done) == (
        [
            "chat-1 (chat): serves on gpu-1 until its replacement serves",
            f"chat: no room for a replacement yet: {why}",
        ],
        False,
    )
