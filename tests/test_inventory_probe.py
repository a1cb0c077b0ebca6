"""Inventory: NVML through a stand-in module, simulated inventories, and the probe's format."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from llmgw_agent.inventory_probe import (
    Hardware,
    detect_hardware,
    engine_info,
    gpus_from_nvml,
    hardware_to_toml,
    read_simulated,
    version_command,
    version_from,
)
from llmgw_core.tomlshape import ConfigError

SIM = Path(__file__).parent.parent / "conf" / "sim"


class FakeNvml:
    """Stands in for pynvml: the calls the probe makes, and their shapes."""

    def __init__(self, names: list[str | bytes]) -> None:
        self.names = names
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return self.names[h]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:04d}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=80 * 1024**3, free=(70 - h) * 1024**3, used=0)


def test_gpus_from_nvml() -> None:
    nvml = FakeNvml(["NVIDIA H100 80GB HBM3", b"NVIDIA H100 80GB HBM3"])  # old pynvml gives bytes
    gpus = gpus_from_nvml(nvml)
    assert [(g.index, g.uuid, g.name, g.memory_total_mib, g.memory_free_mib) for g in gpus] == [
        (0, "GPU-0000", "NVIDIA H100 80GB HBM3", 81920, 71680),
        (1, "GPU-0001", "NVIDIA H100 80GB HBM3", 81920, 70656),
    ]
    assert nvml.calls == ["init", "shutdown"]


def test_no_driver_means_no_gpus_and_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = types.ModuleType("pynvml")

    def fail() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = fail  # type: ignore[attr-defined]  # a module made up here
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    with caplog.at_level(logging.WARNING):
        hardware = detect_hardware()
    assert hardware.gpus == () and hardware.cpus > 0
    assert "no NVIDIA driver found (NVML Shared Library Not Found)" in caplog.text


def test_probe_output_reads_back_as_a_simulated_inventory(tmp_path: Path) -> None:
    hardware = Hardware(cpus=8, memory_mib=32000, gpus=gpus_from_nvml(FakeNvml(["NVIDIA L4"] * 3)))
    path = tmp_path / "probed.toml"
    path.write_text(hardware_to_toml(hardware))
    assert read_simulated(path) == hardware


@pytest.mark.parametrize("path", sorted(SIM.glob("*.toml")), ids=lambda p: p.name)
def test_simulated_examples_load(path: Path) -> None:
    assert read_simulated(path).gpus


def test_simulated_inventory_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[gpus]]\nname = "H100"\nmemory_total_mib = 100\nmemory_free_mib = 200\n')
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.memory_free_mib: 200 exceeds"):
        read_simulated(path)
    path.write_text('[[gpus]]\nname = "H100"\nmemory_total_mb = 100\n')
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.memory_total_mib: is required"):
        read_simulated(path)


def test_engine_info() -> None:
    mock = engine_info("mock", [sys.executable, "-m", "llmgw_mock_engine"])
    assert mock.found and mock.version.startswith("llmgw-mock-engine")
    missing = engine_info("vllm", ["/nonexistent/vllm"])
    assert not missing.found and "not found" in missing.version


# What the engines print for --version (stdout and stderr together).
LLAMA_SERVER_CPU = ["version: 0.5.0-dev (build 1, commit 0c1e570)", "built with GNU 12.2.0 for Linux x86_64"]
LLAMA_SERVER_CUDA = [
    "ggml_cuda_init: found 1 CUDA devices (Total VRAM: 81079 MiB):",
    "Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes, VRAM: 81079 MiB",
    "version: 6188 (21c17b5b)",
    "built with cc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0 for x86_64-linux-gnu",
]
VLLM = [
    "INFO 10-01 12:00:00 [__init__.py:216] Automatically detected platform cuda.",
    "0.34.0",
]


@pytest.mark.parametrize(
    ("lines", "version"),
    [
        (LLAMA_SERVER_CPU, "0.5.0-dev (build 1, commit 0c1e570)"),
        (LLAMA_SERVER_CUDA, "6188 (21c17b5b)"),
        (VLLM, "0.34.0"),
        (["sglang version: 0.5.23"], "0.5.23"),
        (["llmgw-mock-engine 0.1"], "llmgw-mock-engine 0.1"),
        ([], ""),
    ],
)
def test_the_version_comes_from_the_line_that_carries_it(lines: list[str], version: str) -> None:
    assert version_from(lines) == version


def test_version_commands() -> None:
    assert version_command("llamacpp", ["llama-server"]) == ["llama-server", "--version"]
    assert version_command("vllm", ["/opt/vllm/bin/vllm"]) == ["/opt/vllm/bin/vllm", "--version"]
    # sglang.launch_server has no --version: it would exit 2 asking for --model-path.
    python, flag, code = version_command("sglang", ["python3", "-m", "sglang.launch_server"])
    assert (python, flag) == ("python3", "-c") and "version('sglang')" in code
    assert version_command("sglang", ["sglang", "serve"]) == ["sglang", "version"]


def test_a_python_engine_without_sglang_is_not_found_and_says_so_plainly() -> None:
    info = engine_info("sglang", [sys.executable, "-m", "sglang.launch_server"])
    # The interpreter runs; what it lacks is the package (not "python3 --version exited 1").
    assert (info.found, info.version) == (False, f"{sys.executable} has no sglang package")
    # Launcher arguments after the module do not hide it.
    info = engine_info("sglang", [sys.executable, "-m", "sglang.launch_server", "--log-level", "info"])
    assert (info.found, info.version) == (False, f"{sys.executable} has no sglang package")


def test_a_failed_version_probe_names_what_ran_and_what_it_said(tmp_path: Path) -> None:
    broken = tmp_path / "vllm"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named torch' >&2\nexit 1\n")
    broken.chmod(0o755)
    info = engine_info("vllm", [str(broken)])
    assert (info.found, info.version) == (
        False,
        f"{broken} --version exited with status 1: ModuleNotFoundError: No module named torch",
    )
    # An interpreter that cannot even look sglang up is told apart from one without it.
    python = tmp_path / "python3"
    python.write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
    python.chmod(0o755)
    info = engine_info("sglang", [str(python), "-m", "sglang.launch_server"])
    assert info.version == (
        f"{python}'s lookup of the sglang package exited with status 1: "
        "Fatal Python error: init_fs_encoding"
    )


def test_an_installed_sglang_is_found_with_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "sglang-0.5.23.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    info = engine_info("sglang", [sys.executable, "-m", "sglang.launch_server"])
    assert info.found and info.version == "0.5.23"
