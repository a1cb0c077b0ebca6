"""What this node has: GPUs from NVML, or a simulated inventory from TOML; engines found.

`python -m llmgw_agent probe` prints the inventory in exactly the format that
`inventory_file` reads, so a probed node and a simulated one are written alike.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import tomli_w

from llmgw_agent.config import AgentConfig
from llmgw_core.inventory import EngineInfo, Gpu, Inventory
from llmgw_core.tomlshape import Table, load_toml

log = logging.getLogger("llmgw.agent.inventory")

_MIB = 1024 * 1024


@attrs.frozen
class Hardware:
    cpus: int
    memory_mib: int
    gpus: tuple[Gpu, ...]


def host_cpus_and_memory() -> tuple[int, int]:
    cpus = os.cpu_count() or 0
    memory_mib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_mib = int(line.split()[1]) // 1024
                break
    except OSError:
        pass
    return cpus, memory_mib


def gpus_from_nvml(nvml: Any) -> tuple[Gpu, ...]:
    """Every GPU NVML sees; `nvml` is the pynvml module (a stand-in under test)."""
    nvml.nvmlInit()
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                Gpu(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total_mib=int(memory.total) // _MIB,
                    memory_free_mib=int(memory.free) // _MIB,
                )
            )
        return tuple(gpus)
    finally:
        nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def detect_hardware() -> Hardware:
    """The real machine: NVML where a driver is present, else no GPUs and one clear log line."""
    cpus, memory_mib = host_cpus_and_memory()
    try:
        import pynvml

        gpus = gpus_from_nvml(pynvml)
    except ImportError:
        log.warning("nvidia-ml-py is not installed: this node reports no GPUs")
        gpus = ()
    except Exception as exc:  # pynvml raises NVMLError subclasses made at import time
        log.warning("no NVIDIA driver found (%s): this node reports no GPUs", exc)
        gpus = ()
    return Hardware(cpus, memory_mib, gpus)


def read_simulated(path: Path) -> Hardware:
    """A simulated inventory, in the format `probe` prints."""
    file = str(path)
    data = load_toml(path)
    t = Table(data, file)
    cpus = t.integer("cpus", 0, min=0)
    memory_mib = t.integer("memory_mib", 0, min=0)
    gpus: list[Gpu] = []
    for g in t.tables("gpus"):
        total = g.integer("memory_total_mib", min=1)
        gpu = Gpu(
            index=g.integer("index", len(gpus), min=0),
            uuid=g.text("uuid", f"GPU-sim-{len(gpus)}"),
            name=g.text("name"),
            memory_total_mib=total,
            memory_free_mib=g.integer("memory_free_mib", total, min=0),
        )
        if gpu.memory_free_mib > total:
            g.fail("memory_free_mib", f"{gpu.memory_free_mib} exceeds memory_total_mib {total}")
        if any(other.index == gpu.index for other in gpus):
            g.fail("index", f"GPU index {gpu.index} is listed twice")
        g.finish()
        gpus.append(gpu)
    t.finish()
    return Hardware(cpus, memory_mib, tuple(gpus))


def hardware_to_toml(hardware: Hardware) -> str:
    data = {
        "cpus": hardware.cpus,
        "memory_mib": hardware.memory_mib,
        "gpus": [attrs.asdict(g) for g in hardware.gpus],
    }
    return tomli_w.dumps(data)


_VERSION_LABEL = re.compile(r"(?:^|\s)version:\s*(\S.*)$", re.IGNORECASE)
_BARE_VERSION = re.compile(r"^v?\d+(\.\d+)+\S*$")


# The sglang probe's own exit status for "this interpreter has no sglang package": Python
# exits 1 for an uncaught error and 2 for a usage error, so 3 means only this.
_NO_SGLANG = 3
_SGLANG_VERSION = (
    "import importlib.metadata as m, sys\n"
    "try: v = m.version('sglang')\n"
    f"except m.PackageNotFoundError: sys.exit({_NO_SGLANG})\n"
    "print('sglang version: ' + v)"
)


def _sglang_interpreter(name: str, command: Sequence[str]) -> list[str] | None:
    """The interpreter (and its options) of a `python -m sglang.launch_server` command."""
    if name != "sglang":
        return None
    for i in range(1, len(command) - 1):
        if command[i] == "-m" and command[i + 1] == "sglang.launch_server":
            return list(command[:i])
    return None


def version_command(name: str, command: Sequence[str]) -> list[str]:
    """How to ask an engine's program for its version. `sglang.launch_server` has no
    --version (it would exit 2 for want of --model-path); the package's metadata says it."""
    interpreter = _sglang_interpreter(name, command)
    if interpreter is not None:
        return [*interpreter, "-c", _SGLANG_VERSION]
    if name == "sglang" and tuple(command[-1:]) == ("serve",):  # the `sglang serve` CLI
        return [*command[:-1], "version"]
    return [*command, "--version"]


def _why_not_found(name: str, command: Sequence[str], code: int, lines: Sequence[str]) -> str:
    """What the version probe's failure says, naming what really ran: the interpreter's
    metadata lookup for sglang, else the program's version command; with its last line."""
    program = command[0]
    if _sglang_interpreter(name, command) is not None:
        if code == _NO_SGLANG:
            return f"{program} has no sglang package"
        ran = f"{program}'s lookup of the sglang package"
    else:
        ran = " ".join(version_command(name, command))
    said = f": {lines[-1][:100]}" if lines else ""
    return f"{ran} exited with status {code}{said}"


def version_from(lines: Sequence[str]) -> str:
    """The version out of what `--version` printed, from the line that carries it:
    llama-server prints `version: 0.5.0-dev (build 1, commit 0c1e570)` and then
    `built with ...` (a GPU build prints its devices first); vLLM prints its bare
    version, after any log lines; other programs, their last line."""
    for line in lines:
        labelled = _VERSION_LABEL.search(line)
        if labelled:
            return labelled.group(1)[:100]
    bare = [line for line in lines if _BARE_VERSION.match(line)]
    return (bare or list(lines) or [""])[-1][:100]


# `vllm --version` imports vLLM (torch, transformers): 20 s was not enough on a busy
# machine, and the node then said it had no vLLM until the agent restarted.
VERSION_TIMEOUT_S = 120.0


def engine_info(
    name: str, command: Sequence[str], timeout_s: float = VERSION_TIMEOUT_S
) -> EngineInfo:
    """Whether the engine's program exists and runs, and the version it prints."""
    program = command[0]
    if shutil.which(program) is None:
        return EngineInfo(name, found=False, version=f"{program} not found")
    try:
        done = subprocess.run(
            version_command(name, command),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return EngineInfo(name, found=False, version=f"{program} does not run: {exc}")
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode != 0:
        return EngineInfo(
            name, found=False, version=_why_not_found(name, command, done.returncode, lines)
        )
    return EngineInfo(name, found=True, version=version_from(lines))


def take_inventory(config: AgentConfig) -> Inventory:
    hardware = read_simulated(config.inventory_file) if config.inventory_file else detect_hardware()
    engines = tuple(engine_info(kind, e.command) for kind, e in sorted(config.engines.items()))
    return Inventory(
        name=config.name,
        address=config.advertise_host,
        labels=dict(config.labels),
        fabric=dict(config.fabric),
        cpus=hardware.cpus,
        memory_mib=hardware.memory_mib,
        gpus=hardware.gpus,
        engines=engines,
    )
