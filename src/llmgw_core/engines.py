"""The engines llmgw launches: one closed set, for the catalog's profiles and the agent."""

from collections.abc import Sequence
from typing import Final, Literal, get_args

EngineKind = Literal["vllm", "sglang", "llamacpp", "mock"]
ENGINE_KINDS: Final[tuple[EngineKind, ...]] = get_args(EngineKind)

# The flag through which each engine takes a profile's `max_model_len`, first the one the
# agent's adapter writes, then its other spellings: vLLM 0.32.0 `--max-model-len`
# (vllm/engine/arg_utils.py), llama.cpp 0c1e570 `-c, --ctx-size` (`llama-server --help`),
# SGLang 0.5.23 `--context-length`. The mock engine takes vLLM's command line.
CONTEXT_FLAGS: Final[dict[str, tuple[str, ...]]] = {
    "vllm": ("--max-model-len",),
    "mock": ("--max-model-len",),
    "sglang": ("--context-length",),
    "llamacpp": ("-c", "--ctx-size"),
}


def flag_name(engine: str, arg: str) -> str:
    """The option an argument names, as the engine reads it: `--name=value` is `--name`;
    vLLM (and the mock, which takes its line) also reads `--max_model_len` as
    `--max-model-len`, `--json-arg.key` as `--json-arg` and `-O3` as
    `--optimization-level 3` (vllm/utils/argparse_utils.py)."""
    name = arg.split("=", 1)[0]
    if engine in ("vllm", "mock") and name.startswith("-O"):
        return "--optimization-level"
    if engine in ("vllm", "mock") and name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    return name


def context_flag_in(engine: str, args: Sequence[str]) -> str | None:
    """The argument of `args` that sets the context length `max_model_len` sets, if any."""
    names = CONTEXT_FLAGS.get(engine, ())
    return next((a for a in args if a.startswith("-") and flag_name(engine, a) in names), None)
