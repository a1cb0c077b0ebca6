"""What an operator reads: durations rounded for people, no word said twice in a log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llmgw_agent.agent import Agent
from llmgw_agent.config import parse_agent_config
from llmgw_agent.engines import Shard
from llmgw_core.durations import seconds
from llmgw_core.inventory import Inventory, LaunchSpec, ShardState


def test_durations_read_as_tenths_or_whole_seconds() -> None:
    assert [seconds(v) for v in (18.8644, 0.5, 1.0, 0.04, 99.96, 240.4, 1234567.8)] == [
        "18.9 s", "0.5 s", "1 s", "0 s", "100 s", "240 s", "1234568 s",
    ]  # fmt: skip


def test_a_shards_state_is_not_said_twice_in_the_agents_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = parse_agent_config(
        {"name": "n1", "server": "ws://127.0.0.1:1/v1/agent", "insecure": True, "state_dir": str(tmp_path)},
        "<test>",
    )
    agent = Agent(config, Inventory(name="n1"))
    spec = LaunchSpec(
        replica_id="r-1", model_name="m", engine="vllm", hf_model="org/m", args=(), env={},
        tensor_parallel=1, pipeline_parallel=1, rank=0, nodes=("n1",), gpu_indices=(0,),
        head_address="127.0.0.1", port=20001, dist_port=20002, api_key="",
    )  # fmt: skip
    shard = Shard(spec, ShardState.READY)
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    agent.engines.transition(shard, ShardState.DRAINING, "draining on request")
    agent.engines.transition(shard, ShardState.STOPPED, "stopped on request")
    agent.engines.transition(shard, ShardState.STARTING, "pid 42")
    agent.engines.transition(shard, ShardState.READY, "")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("r-1")] == [
        "r-1 rank 0: draining on request",
        "r-1 rank 0: stopped on request",
        "r-1 rank 0: starting pid 42",
        "r-1 rank 0: ready",
    ]
