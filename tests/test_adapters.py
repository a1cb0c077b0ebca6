"""Exact argument construction for every engine."""

from __future__ import annotations

from llmgw_agent.adapters import EngineLaunch, build_command


def launch(**kw: object) -> EngineLaunch:
    base: dict[str, object] = dict(
        engine="vllm", model="Qwen/Qwen2.5-72B-Instruct", served_name="qwen", host="0.0.0.0",
        port=20001, gpu_indices=(2, 3), tensor_parallel=2, args=("--max-model-len", "32768"),
    )
    base.update(kw)
    return EngineLaunch(**base)  # type: ignore[arg-type]


def test_vllm_single_node() -> None:
    cmd = build_command(["vllm"], launch())
    assert cmd.argv == (
        "vllm", "serve", "Qwen/Qwen2.5-72B-Instruct", "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen", "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "1", "--max-model-len", "32768",
    )
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_vllm_multi_node_head_and_worker() -> None:
    common = dict(pipeline_parallel=2, nnodes=2, master_addr="10.0.0.7", master_port=29500, args=())
    head = build_command(["/opt/vllm/bin/vllm"], launch(node_rank=0, **common))
    worker = build_command(["/opt/vllm/bin/vllm"], launch(node_rank=1, **common))
    tail = ("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.7", "--master-port", "29500")
    assert head.argv[-8:] == tail and "--headless" not in head.argv
    assert worker.argv[-9:-1] == ("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "29500")
    assert worker.argv[-1] == "--headless"
    assert "--pipeline-parallel-size" in head.argv and head.argv[head.argv.index("--pipeline-parallel-size") + 1] == "2"


def test_sglang() -> None:
    cmd = build_command(
        ["python3", "-m", "sglang.launch_server"],
        launch(engine="sglang", nnodes=2, node_rank=1, master_addr="10.0.0.7", master_port=5000, args=()),
    )
    assert cmd.argv == (
        "python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001", "--served-model-name", "qwen", "--tp", "2",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.7:5000",
    )


def test_llamacpp() -> None:
    cmd = build_command(
        ["llama-server"],
        launch(engine="llamacpp", model="/models/llama-8b.gguf", tensor_parallel=1, gpu_indices=(0,), args=("-c", "8192")),
    )
    assert cmd.argv == (
        "llama-server", "-m", "/models/llama-8b.gguf", "--host", "0.0.0.0", "--port", "20001",
        "--alias", "qwen", "-ngl", "999", "-c", "8192",
    )
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_mock_takes_the_vllm_line_and_env_passes_through() -> None:
    cmd = build_command(["python", "-m", "llmgw_core.mock_engine"], launch(engine="mock", env=(("LLMGW_MOCK_TOKENS", "3"),)))
    assert cmd.argv[3:5] == ("serve", "Qwen/Qwen2.5-72B-Instruct")
    assert cmd.env["LLMGW_MOCK_TOKENS"] == "3"
