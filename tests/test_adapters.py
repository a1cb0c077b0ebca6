"""llama.cpp's command line, as the real llama-server showed it must be (vLLM and
SGLang: test_adapter_golden.py)."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw_agent.adapters import EngineLaunch, build_command, given, is_hf_repo

LLAMA = ("llama-server",)


def launch(**kw: Any) -> EngineLaunch:
    base: dict[str, Any] = dict(
        engine="llamacpp", model="/models/llama-8b.gguf", served_name="llama-8b",
        host="0.0.0.0", port=20001, gpu_indices=(0,),
    )  # fmt: skip
    base.update(kw)
    return EngineLaunch(**base)


def test_a_local_path_with_m_and_no_context_unasked() -> None:
    """No `-c 0`: llama.cpp fits the context to memory itself when -c is left out."""
    cmd = build_command(LLAMA, launch())
    assert cmd.argv == (
        "llama-server", "-m", "/models/llama-8b.gguf", "--host", "0.0.0.0", "--port", "20001",
        "--alias", "llama-8b", "-ngl", "999", "--metrics",
    )  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_the_context_length_comes_from_the_profile() -> None:
    cmd = build_command(LLAMA, launch(args=("-c", "8192", "-t", "2")))
    assert cmd.argv == (
        "llama-server", "-m", "/models/llama-8b.gguf", "--host", "0.0.0.0", "--port", "20001",
        "--alias", "llama-8b", "-ngl", "999", "--metrics", "-c", "8192", "-t", "2",
    )  # fmt: skip
    assert "0" not in cmd.argv


def test_max_model_len_is_c() -> None:
    cmd = build_command(LLAMA, launch(max_model_len=4096, args=("-t", "2")))
    assert cmd.argv == (
        "llama-server", "-m", "/models/llama-8b.gguf", "--host", "0.0.0.0", "--port", "20001",
        "--alias", "llama-8b", "-ngl", "999", "--metrics", "-c", "4096", "-t", "2",
    )  # fmt: skip


@pytest.mark.parametrize(
    "model",
    ["ggml-org/gemma-3-270m-GGUF", "unsloth/Qwen3-8B-GGUF:Q4_K_M", "bartowski/Llama-3.2-1B-Instruct-GGUF:q8_0"],
)
def test_a_hugging_face_repo_with_hf(model: str) -> None:
    cmd = build_command(LLAMA, launch(model=model))
    assert cmd.argv[1:3] == ("-hf", model) and "-m" not in cmd.argv


@pytest.mark.parametrize(
    "model",
    ["/models/x.gguf", "./x.gguf", "../models/x.gguf", "models/x.gguf", "x.gguf", "/models/org/repo", "org/repo/file.GGUF"],
)
def test_paths_are_not_repos(model: str) -> None:
    assert not is_hf_repo(model)
    assert build_command(LLAMA, launch(model=model)).argv[1:3] == ("-m", model)


@pytest.mark.parametrize("alias", [("--alias", "chat"), ("-a", "chat"), ("--alias=chat",)])
def test_the_profiles_alias_replaces_llmgws(alias: tuple[str, ...]) -> None:
    cmd = build_command(LLAMA, launch(args=alias))
    assert cmd.argv == (
        "llama-server", "-m", "/models/llama-8b.gguf", "--host", "0.0.0.0", "--port", "20001",
        "-ngl", "999", "--metrics", *alias,
    )  # fmt: skip


def test_the_profiles_gpu_layers_replace_llmgws() -> None:
    cmd = build_command(LLAMA, launch(args=("--n-gpu-layers", "20")))
    assert cmd.argv == (
        "llama-server", "-m", "/models/llama-8b.gguf", "--host", "0.0.0.0", "--port", "20001",
        "--alias", "llama-8b", "--metrics", "--n-gpu-layers", "20",
    )  # fmt: skip


def test_the_key_goes_through_llama_api_key() -> None:
    cmd = build_command(LLAMA, launch(api_key="k-55aa", env=(("LLAMA_ARG_THREADS", "2"),)))
    assert cmd.env == {"LLAMA_ARG_THREADS": "2", "CUDA_VISIBLE_DEVICES": "0", "LLAMA_API_KEY": "k-55aa"}
    assert not any("k-55aa" in a for a in cmd.argv) and "--api-key" not in cmd.argv


def test_the_key_llmgw_gives_wins_over_the_profiles_env() -> None:
    cmd = build_command(LLAMA, launch(api_key="k-new", env=(("LLAMA_API_KEY", "old"),)))
    assert cmd.env["LLAMA_API_KEY"] == "k-new"


def test_given() -> None:
    assert given(["-c", "2048", "--alias=x"], ("--alias",))
    assert given(["-a", "x"], ("-a", "--alias"))
    assert not given(["--aliases", "x"], ("--alias",))
    assert not given(["--host", "--alias"], ("-a",))
    assert not given(["chat--alias"], ("--alias",))
