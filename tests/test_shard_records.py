"""The agent's shard records: they hold engine keys, so only the agent's user reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmgw_agent import shard_records as records
from llmgw_core.inventory import LaunchSpec


def spec(**kw: Any) -> LaunchSpec:
    base: dict[str, Any] = dict(
        replica_id="r-1", model_name="m", engine="sglang", hf_model="org/m", args=(), env={},
        tensor_parallel=1, pipeline_parallel=1, rank=0, nodes=("gpu-1",), gpu_indices=(0,),
        head_address="127.0.0.1", port=20001, dist_port=20002, api_key="k-a81f",
    )  # fmt: skip
    base.update(kw)
    return LaunchSpec(**base)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_record_keeps_the_key_and_only_its_owner_reads_it(tmp_path: Path) -> None:
    record = records.ShardRecord(spec(), 4242, 1234, ("sglang", "--config", "x"), "/log")
    leftover = tmp_path / "shards" / "r-1.0.tmp"  # from a crash, world-readable
    leftover.parent.mkdir()
    leftover.write_text("{}")
    leftover.chmod(0o644)
    records.save(tmp_path, record)
    (path,) = (tmp_path / "shards").glob("*.json")
    assert mode(path) == 0o600
    assert records.load(tmp_path) == [record]
    assert records.load(tmp_path)[0].spec.api_key == "k-a81f"
    assert mode(records.log_path(tmp_path / "fresh", spec()).parent) == 0o700


def test_removing_a_record_removes_its_key_file(tmp_path: Path) -> None:
    s = spec()
    records.save(tmp_path, records.ShardRecord(s, 1, 1, ("x",), "/log"))
    key_file = records.key_path(tmp_path, s)
    assert key_file.parent == tmp_path / "shards" and mode(key_file.parent) == 0o700
    key_file.write_text("api_key: x\n")
    other = spec(replica_id="r-2")
    records.save(tmp_path, records.ShardRecord(other, 2, 2, ("x",), "/log"))
    records.remove(tmp_path, s)
    assert not key_file.exists()
    assert [r.spec for r in records.load(tmp_path)] == [other]
    records.remove(tmp_path, s)  # twice: nothing left to remove, no error


def test_a_record_keeps_what_dev_shm_held_before_the_launch(tmp_path: Path) -> None:
    """To tell what the engine left there; an older agent's record has no such list."""
    s = spec()
    records.save(tmp_path, records.ShardRecord(s, 1, 1, ("x",), "/log", "id", ("a", "sem.b")))
    (loaded,) = records.load(tmp_path)
    assert loaded.shm_before == ("a", "sem.b")
    path = next((tmp_path / "shards").glob("*.json"))
    data = json.loads(path.read_text())
    del data["shm_before"]
    path.write_text(json.dumps(data))
    (older,) = records.load(tmp_path)
    assert older.shm_before is None and older.launch_id == "id"
