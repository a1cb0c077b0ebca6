from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import hypothesis_profiles
import procs as procs_module
from longest_first import longest_first
from procs import Procs

# Before any test module is imported: their `profile_times(...)` read the loaded profile.
hypothesis_profiles.load()


def _xdist_group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs["name"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # xdist may have suffixed a grouped test's id with "@group" already.
    items[:] = longest_first(items, lambda item: item.nodeid.split("@", 1)[0], _xdist_group)


@pytest.fixture(scope="session", autouse=True)
def process_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The logs of every process a test starts, under pytest's temporary directory."""
    procs_module.LOG_DIR = tmp_path_factory.mktemp("process-logs")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def fleet(procs: Procs) -> Iterator[object]:
    import os
    import signal

    from fleet import Fleet

    f = Fleet(procs)
    try:
        yield f
    finally:
        f.close()
        pids = f.every_engine_pid()
        procs.stop_all()
        for pid in pids:  # engines orphaned by an agent killed with SIGKILL
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="session")
def real_engine() -> object:
    """llama.cpp's llama-server built for CPU and the gemma-3-270m GGUF (make real-engine).

    `.server` is the binary, `.model` the GGUF. A missing build fails the test: the
    tests against a real engine are never skipped silently.
    """
    import real_engine as built

    if not built.is_built():
        pytest.fail(f"no real engine in {built.cache_dir()}: run `make real-engine` first")
    return built.RealEngine(server=built.server_binary(), model=built.model_path())


@pytest.fixture(scope="session")
def real_vllm() -> object:
    """vLLM for CPU in its own virtualenv, a tiny Llama and its LoRA adapter (make
    real-vllm; tests/real_vllm.py). A missing build fails the test, never skips it."""
    import real_vllm as built

    if not built.is_built():
        pytest.fail(f"no real vLLM in {built.cache_dir()}: run `make real-vllm` first")
    return built.real_vllm()
