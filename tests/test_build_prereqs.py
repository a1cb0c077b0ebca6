"""`make test`'s prerequisites beyond Python are checked first and named, with how to
install them: cmake and a C/C++ compiler (the real engine's build), chromium (the fleet
page's test)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import real_engine

REPO = Path(__file__).resolve().parent.parent


def test_each_missing_build_tool_is_named_with_how_to_install_it() -> None:
    have = {"gcc", "tar", "make"}
    missing = real_engine.missing_build_tools(lambda name: f"/usr/bin/{name}" if name in have else None)
    assert missing == [
        "cmake (cmake: apt-get install cmake)",
        "a C++ compiler (c++ or g++ or clang++: apt-get install build-essential)",
    ]
    assert real_engine.missing_build_tools(lambda name: "/x") == []


def test_the_build_without_cmake_or_compilers_is_one_line_before_it_starts(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "real_engine.py"), "build"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(empty), "LLMGW_REAL_ENGINE_CACHE": str(cache)},
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("building llama.cpp's llama-server (make real-engine, part of make test) needs cmake (cmake: apt-get install cmake); a C compiler (")
    assert not cache.exists()  # nothing was downloaded or started


def test_make_test_without_chromium_nor_root_says_what_to_install(tmp_path: Path) -> None:
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is not installed: the project is built with it")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")  # not root; no apt-get, no chromium
    (bin_dir / "id").chmod(0o755)
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    done = subprocess.run(
        [make, "--no-print-directory", "-C", str(tmp_path), "browser"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
            "PATH": str(bin_dir),
        },
    )
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "make test needs chromium and chromedriver for the fleet page's test (tests/test_ui.py): "
        "install them (on Debian or Ubuntu, as root: apt-get install chromium chromium-driver), "
        "or run make test as root where apt-get installs them"
    ), done.stderr
    assert all(line.startswith("make: ***") for line in lines[1:]), done.stderr


@pytest.mark.parametrize("in_place", [False, True])
def test_a_build_killed_half_way_is_never_used_and_the_next_one_starts_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    """The cache's one lock and build rule (real_engine.build_once), as llama.cpp's build
    (renamed into place) and vLLM's virtualenv (built in place) use it."""
    monkeypatch.setenv("LLMGW_REAL_ENGINE_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "engine-1.0"

    def done() -> bool:
        return (target / "DONE").is_file()

    def killed(out: Path, scratch: Path) -> None:
        out.mkdir()
        (out / "half").write_text("x")
        raise KeyboardInterrupt

    def complete(out: Path, scratch: Path) -> None:
        assert not (out / "half").exists() and scratch.is_dir()
        out.mkdir()
        (out / "DONE").write_text("x")

    with pytest.raises(KeyboardInterrupt):
        real_engine.build_once(target, done, killed, in_place=in_place)
    assert not done()
    assert real_engine.build_once(target, done, complete, in_place=in_place) == target
    assert done() and not (target / "half").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name != ".lock"] == [target.name]
    real_engine.build_once(target, done, killed, in_place=in_place)  # built: nothing is made
