"""The paths of the OpenAI-style APIs, and of the engines' own, that llmgw knows (issue 21).

Shared by the config (which checks `[router] extra_paths`) and the router (which relays).
"""

from __future__ import annotations

# POST, a JSON body with a "model": OpenAI's, Anthropic's, and the engines' own
# (vLLM's and llama.cpp's, checked against their routes).
JSON_PATHS = frozenset(
    {
        b"/v1/chat/completions",
        b"/v1/completions",
        b"/v1/embeddings",
        b"/v1/responses",
        b"/v1/messages",
        b"/v1/messages/count_tokens",
        b"/v1/rerank",
        b"/rerank",
        b"/v2/rerank",
        b"/v1/score",
        b"/score",
        b"/classify",
        b"/pooling",
        b"/tokenize",
        b"/detokenize",
        b"/apply-template",
        b"/v1/chat/completions/input_tokens",
    }
)
# POST, multipart/form-data with a "model" field.
FORM_PATHS = frozenset({b"/v1/audio/transcriptions", b"/v1/audio/translations"})
# Anthropic's Messages API: its clients send their key in x-api-key, and read errors
# in Anthropic's shape.
ANTHROPIC_PATHS = frozenset({b"/v1/messages", b"/v1/messages/count_tokens"})
# What an engine offers its operator, not its clients: never relayed.
MANAGEMENT_PATHS = frozenset(
    {
        b"/v1/load_lora_adapter",
        b"/v1/unload_lora_adapter",
        b"/lora-adapters",
        b"/slots",
        b"/props",
        b"/v1/chat/completions/control",
        b"/reset_prefix_cache",
        b"/reset_mm_cache",
        b"/sleep",
        b"/wake_up",
        b"/collective_rpc",
        b"/scale_elastic_ep",
        b"/pause",
        b"/resume",
        b"/start_profile",
        b"/stop_profile",
    }
)


def valid_extra_path(path: str) -> str:
    """`[router] extra_paths`: absolute, plain, and none of the management paths."""
    if not path.startswith("/") or "?" in path or "#" in path or any(c <= " " for c in path):
        raise ValueError("must be an absolute path without query, fragment or spaces")
    if path.encode() in MANAGEMENT_PATHS:
        raise ValueError("is an engine's management path, which is never relayed")
    return path
