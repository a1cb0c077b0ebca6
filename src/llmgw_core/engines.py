"""The engines llmgw launches: one closed set, for the catalog's profiles and the agent."""

from typing import Final, Literal, get_args

EngineKind = Literal["vllm", "sglang", "llamacpp", "mock"]
ENGINE_KINDS: Final[tuple[EngineKind, ...]] = get_args(EngineKind)
