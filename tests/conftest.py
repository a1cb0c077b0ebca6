from __future__ import annotations

import functools
import re
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
    items[:] = longest_first(items, lambda item: item.nodeid.split("@", 1)[0], _xdist_group)


# A module's `pytestmark = pytest.mark.xdist_group("name")`: its tests go to one worker.
_GROUP_MARK = re.compile(r'^pytestmark = pytest\.mark\.xdist_group\("([^"]+)"\)', re.MULTILINE)


@functools.cache
def _module_group(path: Path) -> str | None:
    try:
        found = _GROUP_MARK.search(path.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadgroup, grouping by the modules' marks. xdist 3.8 groups the tests whose
    ids its workers end with "@group", but the worker hook that adds it sets a field
    pytest 9 no longer reads (`_nodeid`): every grouped test went to any worker, and a
    module's session fixture (a real vLLM: 78 s of a core, 1.9 GB) was made on each.
    The scheduler, in the controller, reads the mark from the module's source instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling  # type: ignore[import-untyped]

    root = config.rootpath

    class ModuleGroups(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            group = _module_group(root / nodeid.split("::", 1)[0])
            return nodeid if group is None else f"group:{group}"

    return ModuleGroups(config, log)


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
    from llmgw_agent.adoption import MARKER
    from llmgw_agent.procinfo import environ_value

    f = Fleet(procs)
    try:
        yield f
    finally:
        f.close()
        pids = f.every_engine_pid()
        procs.stop_all()
        for pid in pids:  # engines orphaned by an agent killed with SIGKILL
            # Only a process an agent launched: a pid of an engine long gone may be
            # another test's process by now (pid_max is 32,768 on CI's machines, and the
            # suite starts thousands), a worker or a router leading its own group.
            if not environ_value(pid, MARKER):
                continue
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


# A real etcd: the fixtures `etcd` (one member) and `etcd3` (three), tests/etcd_cluster.py.
pytest_plugins = ["etcd_cluster"]
