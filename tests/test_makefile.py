"""`make` refuses a Python older than 3.11 in one line, before it creates anything.

The interpreter is a stub that says it is 3.10 and otherwise runs the real one, so that
a Makefile without the check would really create a virtualenv (and this test fail).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")

STUB = """#!/bin/sh
echo "$@" >> "{log}"
case "$1" in
  -V|--version) echo "Python 3.10.12"; exit 0;;
  -c) shift; code="$1"; shift
      exec "{real}" -c "import sys; sys.version_info = (3, 10, 12, 'final', 0)
$code" "$@";;
esac
exec "{real}" "$@"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What `make venv` reads, copied: a Makefile that failed to refuse must not touch
    the real checkout."""
    copy = tmp_path / "llmgw"
    copy.mkdir()
    for name in ("Makefile", "pyproject.toml", "requirements.lock", "requirements-audit.lock"):
        shutil.copy(REPO / name, copy / name)
    return copy


def _stub(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "stub.log"
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(STUB.format(log=log, real=sys.executable))
    stub.chmod(0o755)
    return stub, log


def _make(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if MAKE is None:
        pytest.fail("make is not installed: the project is built with it")
    return subprocess.run(
        [MAKE, "--no-print-directory", "-C", str(checkout), *args],
        capture_output=True,
        text=True,
        timeout=120,
        # As typed in a shell, even when the tests themselves run under `make test`.
        env={
            k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")
        },
    )


def test_the_stub_is_a_working_python_that_says_it_is_3_10(tmp_path: Path) -> None:
    stub, _ = _stub(tmp_path)
    said = subprocess.run(
        [stub, "-c", "import sys; print(sys.version_info[:2], 6 * 7)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert said.stdout.strip() == "(3, 10) 42"


@pytest.mark.parametrize("target", ["venv", "vuln"])
def test_python_3_10_is_refused_in_one_line_before_anything_is_created(
    tmp_path: Path, checkout: Path, target: str
) -> None:
    stub, log = _stub(tmp_path)
    done = _make(checkout, f"PY={stub}", target)
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    assert lines[0] == (
        f"llmgw needs Python 3.11 or newer; {stub} is Python 3.10.12: "
        "run make PY=python3.11 (or newer)"
    ), done.stderr
    assert all(line.startswith("make: ***") for line in lines[1:]), done.stderr
    assert sorted(p.name for p in checkout.iterdir()) == [
        "Makefile", "pyproject.toml", "requirements-audit.lock", "requirements.lock",
    ]  # fmt: skip
    assert "-m venv" not in log.read_text()  # asked its version, never asked to build


def test_a_missing_interpreter_is_named(checkout: Path) -> None:
    done = _make(checkout, "PY=/nonexistent/python3", "venv")
    assert done.returncode != 0
    assert done.stderr.splitlines()[0] == (
        "llmgw needs Python 3.11 or newer; /nonexistent/python3 is not found: "
        "run make PY=python3.11 (or newer)"
    )
    assert not (checkout / ".venv").exists()


def test_a_virtualenv_left_by_python_3_10_is_named_with_the_way_out(
    tmp_path: Path, checkout: Path
) -> None:
    """A .venv made before the check existed: pip in it would fail cryptically."""
    stub, _ = _stub(tmp_path)
    (checkout / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(stub, checkout / ".venv" / "bin" / "python")
    done = _make(checkout, f"PY={sys.executable}", "venv")
    assert done.returncode != 0
    assert done.stderr.splitlines()[0] == (
        "llmgw needs Python 3.11 or newer; .venv/bin/python is Python 3.10.12: "
        "run make clean, then make PY=python3.11 (or newer)"
    )
    assert not (checkout / ".venv" / ".installed-stamp").exists()


def test_python_3_11_passes_the_check(tmp_path: Path, checkout: Path) -> None:
    """The same check lets the real interpreter through (dry run: nothing is built)."""
    done = _make(checkout, f"PY={sys.executable}", "-n", "venv")
    assert done.returncode == 0, done.stderr
    assert f"{sys.executable} -m venv .venv" in done.stdout
    done = _make(checkout, f"PY={sys.executable}", "--eval=probe:\n\t$(call need_python_3_11,$(PY))", "probe")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
