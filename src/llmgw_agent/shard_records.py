"""The agent's state directory: which engines it runs, so a restarted agent finds them.

One JSON file per shard: its launch spec, the engine's PID, start time and launch
id (the marker put in its environment: see `adoption`, so a reused PID is never
mistaken for the engine), its command line, its log and what /dev/shm held before it.
Written when the engine starts, removed when it is stopped or has failed.

A record holds the shard's engine key, so records, and the key files written
beside them for engines that read their key from a file, are readable by the
agent's user only (0600, in a 0700 directory).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs
import cattrs

from llmgw_agent.adoption import Identity
from llmgw_agent.private_files import write_private
from llmgw_core.inventory import LaunchSpec
from llmgw_core.wire import converter

log = logging.getLogger("llmgw.agent.records")


@attrs.frozen
class ShardRecord:
    spec: LaunchSpec
    pid: int
    started: int  # clock ticks after boot, from /proc/PID/stat
    argv: tuple[str, ...]
    log: str
    launch_id: str = ""  # "": written by an agent that set no launch marker
    # What /dev/shm held just before the engine started, to tell what it left there when
    # it dies (see `shm_leftovers`); None: written by an agent that kept no such list.
    shm_before: tuple[str, ...] | None = None

    def identity(self) -> Identity:
        return Identity(self.pid, self.started, self.launch_id)


def _dir(state_dir: Path) -> Path:
    return state_dir / "shards"


def log_path(state_dir: Path, spec: LaunchSpec) -> Path:
    logs = state_dir / "logs"
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    return logs / f"{spec.replica_id}.{spec.rank}.log"


def key_path(state_dir: Path, spec: LaunchSpec) -> Path:
    """Where the shard's engine key is written for an engine that reads it from a file."""
    return _dir(state_dir) / f"{spec.replica_id}.{spec.rank}.key.yaml"


def _path(state_dir: Path, spec: LaunchSpec) -> Path:
    return _dir(state_dir) / f"{spec.replica_id}.{spec.rank}.json"


def save(state_dir: Path, record: ShardRecord) -> None:
    write_private(_path(state_dir, record.spec), json.dumps(converter.unstructure(record)))


def remove(state_dir: Path, spec: LaunchSpec) -> None:
    for path in (_path(state_dir, spec), key_path(state_dir, spec)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def load(state_dir: Path) -> list[ShardRecord]:
    records = []
    for path in sorted(_dir(state_dir).glob("*.json")):
        try:
            records.append(converter.structure(json.loads(path.read_text()), ShardRecord))
        except (OSError, ValueError, cattrs.BaseValidationError) as exc:
            log.error("ignoring the unreadable shard record %s: %s", path, exc)
    return records
