"""Engine adapters: the exact command line and environment each engine is started with.

Pure functions of what to launch; the supervisor runs what they return.

The flags are those of the engine versions llmgw is tested against: vLLM 0.34.0
(`vllm serve`), SGLang 0.5.23 (`sglang.launch_server`), llama.cpp 0c1e570
(`llama-server`, as vendored by llama-cpp-python 0.3.36).

An engine key (`api_key`) never goes on the command line, where every user of the
node can read it (/proc/PID/cmdline is world-readable): vLLM and llama.cpp read it
from their environment, SGLang from a config file only the agent's user can read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence

import attrs

from llmgw_core.catalog import LoraAdapter
from llmgw_core.engines import CONTEXT_FLAGS, LORA_RANK_FLAG


@attrs.frozen
class EngineLaunch:
    """One shard of one replica, as this node starts it."""

    engine: str  # vllm | sglang | llamacpp | mock
    model: str  # the weights: a Hugging Face id or a local path
    served_name: str  # the name clients use
    host: str
    port: int
    gpu_indices: tuple[int, ...]
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    # The key the engine must require on every request (empty: none).
    api_key: str = attrs.field(default="", repr=False)
    # Where an engine that reads its key only from a file gets that file (SGLang).
    key_file: str = ""
    max_model_len: int | None = None  # the context length; None: the engine's default
    # LoRA adapters served under their own names, and their highest rank (None: the
    # engine's default); engines other than vLLM (and the mock) are refused them earlier.
    lora: tuple[LoraAdapter, ...] = ()
    max_lora_rank: int | None = None
    # Where the head publishes its KV-cache events (ZMQ) and answers replays, on every
    # address of the node; 0: it publishes none.
    kv_events_port: int = 0
    kv_replay_port: int = 0

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def serves_http(self) -> bool:
        """Only the head shard serves the OpenAI API; the other ranks are headless workers."""
        return self.is_head or self.engine == "sglang"


@attrs.frozen
class Command:
    argv: tuple[str, ...]
    env: dict[str, str] = attrs.field(repr=False)
    # Files to write, readable by the agent's user only, before the engine starts.
    files: tuple[tuple[str, str], ...] = attrs.field(default=(), repr=False)


def _gpu_env(launch: EngineLaunch) -> dict[str, str]:
    env = dict(launch.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in launch.gpu_indices)
    return env


def given(args: Sequence[str], names: Collection[str]) -> bool:
    """Whether `args` set one of the options `names` (as `--name value` or `--name=value`)."""
    return any(a in names or a.split("=", 1)[0] in names for a in args if a.startswith("-"))


def _context(launch: EngineLaunch) -> list[str]:
    """The flag that sets the profile's context length (CONTEXT_FLAGS), if it has one."""
    if launch.max_model_len is None:
        return []
    return [CONTEXT_FLAGS[launch.engine][0], str(launch.max_model_len)]


def _vllm_lora(launch: EngineLaunch) -> list[str]:
    """vLLM 0.32.0's static adapters: --enable-lora (vllm/engine/arg_utils.py:1572),
    --lora-modules name=path ... (one flag, nargs +: vllm/entrypoints/launchers/
    cli_args.py:38-69, read as name=path when it holds no comma, :55; its entries are
    served under their names and listed in /v1/models with the base as parent,
    vllm/entrypoints/openai/models/serving.py:149-160), --max-lora-rank (arg_utils.py:1578)."""
    if not launch.lora:
        return []
    argv = ["--enable-lora", "--lora-modules", *(f"{a.name}={a.path}" for a in launch.lora)]
    if launch.max_lora_rank is not None:
        argv += [LORA_RANK_FLAG, str(launch.max_lora_rank)]
    return argv


def _vllm_kv_events(launch: EngineLaunch) -> list[str]:
    """vLLM 0.32.0's --kv-events-config (vllm/config/kv_events.py): a wildcard endpoint is
    bound (an explicit host would be connected to), the replay endpoint always bound."""
    if not launch.kv_events_port or not launch.is_head:
        return []
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{launch.kv_events_port}",
        "replay_endpoint": f"tcp://*:{launch.kv_replay_port}",
    }
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def vllm(prefix: Sequence[str], launch: EngineLaunch) -> Command:
    # Every flag below is in vLLM 0.34.0's serve parser: vllm/engine/arg_utils.py
    # (--served-model-name :1038, --pipeline-parallel-size :1186, --master-addr,
    # --master-port, --nnodes, --node-rank :1190-1193, --tensor-parallel-size :1224),
    # vllm/entrypoints/common/cli_args.py (--host :294, --port :296, --headless :446).
    argv = [
        *prefix,
        "serve",
        launch.model,
        "--host",
        launch.host,
        "--port",
        str(launch.port),
        "--served-model-name",
        launch.served_name,
        "--tensor-parallel-size",
        str(launch.tensor_parallel),
        "--pipeline-parallel-size",
        str(launch.pipeline_parallel),
        *_context(launch),  # --max-model-len: vllm/engine/arg_utils.py
        *_vllm_lora(launch),
        *_vllm_kv_events(launch),
    ]
    if launch.nnodes > 1:
        argv += [
            "--nnodes",
            str(launch.nnodes),
            "--node-rank",
            str(launch.node_rank),
            "--master-addr",
            launch.master_addr,
            "--master-port",
            str(launch.master_port),
        ]
        if not launch.is_head:
            argv.append("--headless")
    argv += launch.args
    env = _gpu_env(launch)
    if launch.api_key:
        # vLLM 0.34.0 vllm/envs.py:879 reads VLLM_API_KEY; the API server requires it
        # (vllm/entrypoints/serve/middleware/register.py:33) on /v1 paths, not /health.
        env["VLLM_API_KEY"] = launch.api_key
    return Command(tuple(argv), env)


def sglang(prefix: Sequence[str], launch: EngineLaunch) -> Command:
    # SGLang 0.5.23 makes each flag from a field name (sglang/srt/arg_groups/arg_utils.py:290):
    # --model-path (fields/model.py:51), --host, --port, --served-model-name
    # (fields/serving.py:65,66,168), --dist-init-addr, --nnodes, --node-rank, --tp-size,
    # --pp-size (fields/parallel.py:32,43,44,45,59); an IPv6 address must be bracketed
    # (sglang/srt/utils/network.py:600).
    argv = [
        *prefix,
        "--model-path",
        launch.model,
        "--host",
        launch.host,
        "--port",
        str(launch.port),
        "--served-model-name",
        launch.served_name,
        "--tp-size",
        str(launch.tensor_parallel),
    ]
    if launch.pipeline_parallel > 1:
        argv += ["--pp-size", str(launch.pipeline_parallel)]
    argv += _context(launch)  # --context-length
    if launch.nnodes > 1:
        argv += [
            "--nnodes",
            str(launch.nnodes),
            "--node-rank",
            str(launch.node_rank),
            "--dist-init-addr",
            _host_port(launch.master_addr, launch.master_port),
        ]
    files: tuple[tuple[str, str], ...] = ()
    if launch.api_key:
        # SGLang 0.5.23 reads its key from --api-key only (fields/serving.py:160; no
        # environment variable). Its --config YAML file (sglang/srt/server_args.py:402,683,
        # merged in-process by sglang/srt/utils/server_args_config_parser.py, which makes
        # `--KEY` of each YAML key as spelt: hence `api-key`) keeps the key off the command
        # line. SGLang logs its resolved arguments at start
        # (sglang/srt/entrypoints/engine.py:311), key included: the engine's log is private
        # to the agent's user and the supervisor masks the key in the tail it reports.
        if not launch.key_file:
            raise ValueError("an SGLang engine key needs a key file to travel in")
        argv += ["--config", launch.key_file]
        files = ((launch.key_file, f"api-key: {json.dumps(launch.api_key)}\n"),)
    argv += launch.args
    return Command(tuple(argv), _gpu_env(launch), files)


# org/repo or org/repo:quant, as llama-server's -hf takes it; a path is absolute,
# starts with ./ or ../, or names a .gguf file.
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_LLAMA_ALIAS = ("-a", "--alias")
_LLAMA_GPU_LAYERS = ("-ngl", "--gpu-layers", "--n-gpu-layers")


def is_hf_repo(model: str) -> bool:
    return bool(_HF_REPO.match(model)) and not model.lower().endswith(".gguf")


def llamacpp(prefix: Sequence[str], launch: EngineLaunch) -> Command:
    # llama.cpp 0c1e570, common/arg.cpp: -m/--model :3035, -hf/--hf-repo :3060 (which
    # downloads, so needs the network), -a/--alias :3011, -ngl :2789. No -c: llama.cpp
    # then fits the context to memory itself; `-c 0` would take the model's whole trained
    # context and turn that fitting off (:1640-1648). A profile sets it with `-c N`.
    model = ["-hf", launch.model] if is_hf_repo(launch.model) else ["-m", launch.model]
    argv = [*prefix, *model, "--host", launch.host, "--port", str(launch.port)]
    # The profile's own --alias or -ngl replaces llmgw's rather than adding a second.
    if not given(launch.args, _LLAMA_ALIAS):
        argv += ["--alias", launch.served_name]
    if not given(launch.args, _LLAMA_GPU_LAYERS):
        argv += ["-ngl", "999"]  # every layer on the GPUs it was given
    if not given(launch.args, ("--metrics",)):
        argv.append("--metrics")  # its load (requests processing, deferred) for the router
    argv += _context(launch)  # -c N: the profile's max_model_len
    argv += launch.args
    env = _gpu_env(launch)
    if launch.api_key:
        # common/arg.cpp:3501: --api-key is also read from LLAMA_API_KEY. /health stays
        # open without it (tools/server/server.cpp:251).
        env["LLAMA_API_KEY"] = launch.api_key
    return Command(tuple(argv), env)


ADAPTERS: dict[str, Callable[[Sequence[str], EngineLaunch], Command]] = {
    "vllm": vllm,
    "sglang": sglang,
    "llamacpp": llamacpp,
    "mock": vllm,  # the mock engine takes vLLM's command line and VLLM_API_KEY
}

MULTI_NODE = frozenset({"vllm", "sglang", "mock"})

# The options through which each engine would take a key of the profile's own, which
# would shadow the one llmgw gives it.
KEY_OPTIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("--api-key",),
    "mock": ("--api-key",),
    "sglang": ("--api-key", "--config"),
    "llamacpp": ("--api-key", "--api-key-file"),
}


def build_command(prefix: Sequence[str], launch: EngineLaunch) -> Command:
    return ADAPTERS[launch.engine](prefix, launch)
