"""The agent stream's wire format: round trips, and bad frames that only ever raise WireError."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec, ShardReport, ShardState
from llmgw_core.wire import (
    PROTOCOL,
    Ack,
    DownMessage,
    Drain,
    Heartbeat,
    Mark,
    Pace,
    Register,
    ShardUpdate,
    Start,
    Stop,
    UpMessage,
    Welcome,
    WireError,
    decode_down,
    decode_up,
    encode,
)

SPEC = LaunchSpec(
    replica_id="qwen-1",
    model_name="qwen",
    engine="vllm",
    hf_model="Qwen/Qwen2.5-72B",
    args=("--max-model-len", "32768"),
    env={"HF_HOME": "/data"},
    tensor_parallel=4,
    pipeline_parallel=2,
    rank=1,
    nodes=("gpu-1", "gpu-2"),
    gpu_indices=(0, 1, 2, 3),
    head_address="10.0.0.1",
    port=20001,
    dist_port=20002,
)
INVENTORY = Inventory(
    name="gpu-2",
    address="10.0.0.2",
    labels={"pool": "prod"},
    fabric={"ib_domain": "pod-a"},
    cpus=64,
    memory_mib=512000,
    gpus=tuple(Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559, 81000) for i in range(8)),
    engines=(EngineInfo("vllm", True, "0.9.1"), EngineInfo("sglang", False)),
)

UP = [
    Register(PROTOCOL, "0.1.0", INVENTORY, (ShardReport(SPEC, ShardState.READY),), cordoned=True),
    Heartbeat(7),
    ShardUpdate(ShardReport(SPEC, ShardState.FAILED, "exited 1"), ("Traceback", "CUDA OOM")),
    Ack(3, ok=False, error="port 20001 is taken"),
]
DOWN = [
    Welcome(PROTOCOL, 5.0),
    Start(1, SPEC),
    Drain(2, "qwen-1", 1),
    Stop(3, "qwen-1", 1),
    Mark(4, True, False),
]


EPOCH_7 = [
    Welcome(PROTOCOL, 5.0, epoch=7),
    Pace(10.0, epoch=7),
    Start(1, SPEC, epoch=7),
    Drain(2, "qwen-1", 1, epoch=7),
    Stop(3, "qwen-1", 1, epoch=7),
    Mark(4, True, False, epoch=7),
]


@pytest.mark.parametrize("message", EPOCH_7, ids=lambda m: type(m).__name__)
def test_every_message_down_carries_its_leaders_epoch(message: DownMessage) -> None:
    frame = encode(message)
    assert json.loads(frame)["epoch"] == 7
    assert decode_down(frame) == message
    # From a control plane of protocol 2 (no epoch): epoch 0, never fenced.
    older = {k: v for k, v in json.loads(frame).items() if k != "epoch"}
    assert decode_down(json.dumps(older)) == attrs.evolve(message, epoch=0)


def test_keys_a_version_does_not_know_are_skipped() -> None:
    """How an agent of protocol 2 takes a welcome of protocol 3 (its converter is this one,
    which forbids no extra key), and this one a later version's."""
    data = json.loads(encode(Welcome(2, 5.0, epoch=7)))
    data["a_later_key"] = {"x": 1}
    assert decode_down(json.dumps(data)) == Welcome(2, 5.0, epoch=7)


def test_a_negative_epoch_is_a_bad_frame() -> None:
    data = json.loads(encode(Mark(4, True, False, epoch=7)))
    data["epoch"] = -1
    with pytest.raises(WireError, match="'mark' frame is malformed"):
        decode_down(json.dumps(data))


@pytest.mark.parametrize("message", UP, ids=lambda m: type(m).__name__)
def test_up_round_trip(message: UpMessage) -> None:
    assert decode_up(encode(message)) == message


@pytest.mark.parametrize("message", DOWN, ids=lambda m: type(m).__name__)
def test_down_round_trip(message: DownMessage) -> None:
    assert decode_down(encode(message)) == message


def test_a_down_message_is_not_accepted_upstream() -> None:
    with pytest.raises(WireError, match="unknown message type 'start'"):
        decode_up(encode(Start(1, SPEC)))


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"seq": 1}', "unknown message type None"),
        ('{"type": "heartbeat"}', "required field missing @ frame.seq"),
        ('{"type": "heartbeat", "seq": "x"}', "expected int @ frame.seq"),
        (b"\x00\x01", "binary frames"),
        ('{"type": "heartbeat", "seq": 1, "pad": "' + "x" * 1100000 + '"}', "exceeds"),
    ],
)
def test_bad_frames_say_why(frame: str | bytes, reason: str) -> None:
    with pytest.raises(WireError, match=reason):
        decode_up(frame)


@settings(max_examples=profile_times(3))
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_arbitrary_frames_decode_or_raise_wire_error(frame: str | bytes) -> None:
    try:
        decode_up(frame)
    except WireError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=profile_times(3))
@given(
    st.sampled_from(["register", "heartbeat", "shard_update", "ack"]),
    st.dictionaries(
        st.sampled_from(
            [
                "protocol",
                "seq",
                "inventory",
                "report",
                "shards",
                "command_id",
                "ok",
                "spec",
                "state",
            ]
        ),
        json_values,
        max_size=6,
    ),
)
def test_arbitrary_json_with_a_real_tag_decodes_or_raises_wire_error(
    tag: str, fields: dict[str, object]
) -> None:
    try:
        decode_up(json.dumps({**fields, "type": tag}))
    except WireError:
        pass
