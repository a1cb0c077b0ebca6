"""tests/rewrite_asserts.py writes what pytest's import hook would, where pytest reads it."""

from __future__ import annotations

import marshal
import types
from pathlib import Path

from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc

from rewrite_asserts import TESTS, rewrite, rewritten_modules


def names(code: types.CodeType) -> set[str]:
    """The names a code object and those it holds use."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= names(const)
    return found


def test_a_module_is_rewritten_once_and_again_when_it_changes(tmp_path: Path) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text("def test_sum():\n    assert 1 + 1 == 3, 'arithmetic'\n")
    assert rewrite(module)
    assert not rewrite(module)  # current: left alone
    pyc = tmp_path / "__pycache__" / f"test_sample{PYC_TAIL}"
    cached = _read_pyc(module, pyc, trace=lambda _: None)
    assert cached is not None  # pytest takes it
    assert "_call_reprcompare" in names(cached)  # the assert rewritten as pytest does
    module.write_text("def test_sum():\n    assert 1 + 1 == 2\n")
    assert _read_pyc(module, pyc, trace=lambda _: None) is None  # stale for pytest too
    assert rewrite(module)
    assert _read_pyc(module, pyc, trace=lambda _: None) is not None
    assert marshal.loads(pyc.read_bytes()[16:]).co_filename == str(module)


def test_the_modules_are_those_pytest_rewrites() -> None:
    modules = rewritten_modules()
    assert TESTS / "conftest.py" in modules
    assert TESTS / "etcd_cluster.py" in modules  # conftest's pytest_plugins
    assert TESTS / "control" / "test_reconciler.py" in modules
    assert TESTS / "fleet.py" not in modules  # a helper: imported as it is
    assert all(p.name.startswith("test_") for p in modules if p.parent.name == "control")
