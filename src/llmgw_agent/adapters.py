"""Engine adapters: the exact command line and environment each engine is started with.

Pure functions of what to launch; the supervisor runs what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs


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
    env: dict[str, str]


def _gpu_env(launch: EngineLaunch) -> dict[str, str]:
    env = dict(launch.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in launch.gpu_indices)
    return env


def vllm(prefix: Sequence[str], launch: EngineLaunch) -> Command:
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
    return Command(tuple(argv), _gpu_env(launch))


def sglang(prefix: Sequence[str], launch: EngineLaunch) -> Command:
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
        "--tp",
        str(launch.tensor_parallel),
    ]
    if launch.pipeline_parallel > 1:
        argv += ["--pp-size", str(launch.pipeline_parallel)]
    if launch.nnodes > 1:
        argv += [
            "--nnodes",
            str(launch.nnodes),
            "--node-rank",
            str(launch.node_rank),
            "--dist-init-addr",
            f"{launch.master_addr}:{launch.master_port}",
        ]
    argv += launch.args
    return Command(tuple(argv), _gpu_env(launch))


def llamacpp(prefix: Sequence[str], launch: EngineLaunch) -> Command:
    argv = [
        *prefix,
        "-m",
        launch.model,
        "--host",
        launch.host,
        "--port",
        str(launch.port),
        "--alias",
        launch.served_name,
        "-ngl",
        "999",  # every layer on the GPUs it was given
    ]
    if "-c" not in launch.args and "--ctx-size" not in launch.args:
        argv += ["-c", "0"]  # 0: the context length the model was trained with
    argv += launch.args
    return Command(tuple(argv), _gpu_env(launch))


ADAPTERS: dict[str, Callable[[Sequence[str], EngineLaunch], Command]] = {
    "vllm": vllm,
    "sglang": sglang,
    "llamacpp": llamacpp,
    "mock": vllm,  # the mock engine takes vLLM's command line
}

MULTI_NODE = frozenset({"vllm", "sglang", "mock"})


def build_command(prefix: Sequence[str], launch: EngineLaunch) -> Command:
    return ADAPTERS[launch.engine](prefix, launch)
