"""The agent's checks before launch: every reason a profile cannot run here, said plainly."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from llmgw_agent.validate import problems
from llmgw_core.catalog import LoraAdapter
from llmgw_core.inventory import EngineInfo, Gpu, Inventory, LaunchSpec
from procs import free_port

NODE = Inventory(
    name="gpu-1",
    gpus=tuple(Gpu(i, f"GPU-{i}", "NVIDIA L4", 23034, 22500) for i in range(2)),
    engines=(EngineInfo("vllm", True, "0.9"), EngineInfo("sglang", False, "python3 not found")),
)


def spec(**kw: Any) -> LaunchSpec:
    base: dict[str, Any] = dict(
        replica_id="r-1",
        model_name="m",
        engine="vllm",
        hf_model="org/m",
        args=(),
        env={},
        tensor_parallel=1,
        pipeline_parallel=1,
        rank=0,
        nodes=("gpu-1",),
        gpu_indices=(0,),
        head_address="127.0.0.1",
        port=free_port(),
        dist_port=0,
    )
    base.update(kw)
    return LaunchSpec(**base)


def test_a_fitting_spec_has_no_problems() -> None:
    assert problems(spec(), NODE, set(), "127.0.0.1") == []


def test_every_problem_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        found = problems(
            spec(
                engine="sglang",
                tensor_parallel=2,
                gpu_indices=(1, 5),
                hf_model="/nonexistent/weights",
                port=port,
            ),
            NODE,
            {1},
            "127.0.0.1",
        )
    text = "\n".join(found)
    assert "the sglang engine cannot run here: python3 not found" in text
    assert "GPUs [5] do not exist here (this node has [0, 1])" in text
    assert "GPUs [1] are in use by another shard" in text
    assert "the model path /nonexistent/weights does not exist" in text
    assert f"port {port} is already in use" in text


def test_parallel_sizes_must_match_the_gpus_and_nodes() -> None:
    assert problems(spec(tensor_parallel=2), NODE, set(), "127.0.0.1") == [
        "1 GPUs given where the parallel sizes need 2"
    ]
    multi = spec(pipeline_parallel=3, nodes=("gpu-1", "gpu-2"), rank=1)
    assert any(
        "2 nodes cannot hold pipeline_parallel=3" in p
        for p in problems(multi, NODE, set(), "127.0.0.1")
    )
    assert (
        problems(spec(engine="llamacpp"), NODE, set(), "127.0.0.1")[0]
        == "no llamacpp engine is configured on this node"
    )


def test_a_profile_key_option_that_would_replace_the_engine_key_is_refused() -> None:
    clash = spec(args=("--max-model-len", "4096", "--api-key=mine"), api_key="k-given")
    assert problems(clash, NODE, set(), "127.0.0.1") == [
        "the profile's args set --api-key, which would replace the engine key llmgw gives "
        "each replica (the router could no longer reach it): remove them"
    ]
    # Without a key from the control plane, the profile's own key is the user's choice.
    assert problems(spec(args=("--api-key", "mine")), NODE, set(), "127.0.0.1") == []
    sglang = Inventory(name="gpu-1", gpus=NODE.gpus, engines=(EngineInfo("sglang", True, "0.5.23"),))
    config = spec(engine="sglang", args=("--config", "my.yaml"), api_key="k-given")
    assert ["--config" in p for p in problems(config, sglang, set(), "127.0.0.1")] == [True]


def test_a_llamacpp_model_that_is_no_hugging_face_repo_must_exist_here() -> None:
    llama = Inventory(name="gpu-1", gpus=NODE.gpus, engines=(EngineInfo("llamacpp", True, "0.5.0"),))
    missing = spec(engine="llamacpp", hf_model="models/absent.gguf")
    assert problems(missing, llama, set(), "127.0.0.1") == [
        "the model path models/absent.gguf does not exist on this node"
    ]
    repo = spec(engine="llamacpp", hf_model="ggml-org/gemma-3-270m-GGUF:Q8_0")
    assert problems(repo, llama, set(), "127.0.0.1") == []


def test_a_context_length_given_twice_is_refused() -> None:
    twice = spec(args=("--max_model_len=8192",), max_model_len=2048)
    assert problems(twice, NODE, set(), "127.0.0.1") == [
        "the profile's args set --max_model_len=8192, the context length that max_model_len "
        "(2048) already sets: give it once"
    ]
    assert problems(spec(max_model_len=2048), NODE, set(), "127.0.0.1") == []


def test_a_spec_with_no_positive_context_length_is_refused_at_decoding() -> None:
    with pytest.raises(ValueError, match="max_model_len 0 is not a positive length"):
        spec(max_model_len=0)


def test_lora_adapters_are_checked_as_the_catalog_does_with_their_paths_here(tmp_path: Path) -> None:
    here = LoraAdapter("m-sql", str(tmp_path))
    assert problems(spec(lora=(here, LoraAdapter("m-hub", "org/m-lora"))), NODE, set(), "127.0.0.1") == []
    absent = LoraAdapter("m-gone", str(tmp_path / "absent"))
    assert problems(spec(lora=(here, absent)), NODE, set(), "127.0.0.1") == [
        f"the LoRA adapter path {tmp_path / 'absent'} does not exist on this node"
    ]
    twice = spec(lora=(here,), args=("--lora-modules", "x=/y"))
    assert problems(twice, NODE, set(), "127.0.0.1") == [
        "the profile's args set --lora-modules, which the LoRA adapters llmgw passes already "
        "set: give them once"
    ]
    llama = Inventory(name="gpu-1", gpus=NODE.gpus, engines=(EngineInfo("llamacpp", True, "0.5.0"),))
    (refused,) = problems(spec(engine="llamacpp", hf_model="org/m", lora=(here,)), llama, set(), "127.0.0.1")
    assert refused.startswith("llamacpp cannot serve LoRA adapters under their names: llama-server's --lora")


def test_a_spec_with_lora_that_cannot_describe_adapters_is_refused_at_decoding() -> None:
    with pytest.raises(ValueError, match="max_lora_rank 0 is not a positive rank"):
        spec(max_lora_rank=0)
    with pytest.raises(ValueError, match="must be distinct and not empty"):
        spec(lora=(LoraAdapter("a", "/x"), LoraAdapter("a", "/y")))
