"""Rewrite every test module's asserts into pytest's own bytecode cache, before `make
test`'s workers start: each worker otherwise rewrites them all again as it collects
(5 s of CPU each, six workers), and a collection in one process first, which wrote the
cache as well, took 7-9 s of one core. This does what pytest's import hook
(AssertionRewritingHook) does for the same files (conftest.py, test_*.py and the
plugins a conftest names), without importing them, and leaves alone a file whose cached rewrite is current.
pytest checks each cached file's source hash when it loads it and rewrites a stale one
itself; this is only a head start.

Run by the Makefile: `python tests/rewrite_asserts.py` (it says how many it wrote).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from _pytest.assertion.rewrite import PYC_TAIL, _write_pyc_fp, get_cache_dir, rewrite_asserts

TESTS = Path(__file__).resolve().parent
HEADER = 16  # magic, flags, the source's hash: pytest's cached file (PEP 552's layout)


def rewritten_modules() -> list[Path]:
    """The modules pytest rewrites: conftest.py, test_*.py and the plugins a conftest
    names (`pytest_plugins`, modules beside it)."""
    found = {p for p in TESTS.rglob("*.py") if p.name == "conftest.py" or p.name.startswith("test_")}
    for conftest in [p for p in found if p.name == "conftest.py"]:
        for node in ast.parse(conftest.read_bytes()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets
            ):
                names = ast.literal_eval(node.value)
                found |= {conftest.parent / f"{name}.py" for name in names}
    return sorted(p for p in found if p.is_file())


def rewrite(path: Path) -> bool:
    """Write the module's rewritten code to pytest's cache, unless it is there already."""
    source = path.read_bytes()
    source_hash = importlib.util.source_hash(source)
    cache = get_cache_dir(path)
    pyc = cache / (path.name[:-3] + PYC_TAIL)
    try:
        with open(pyc, "rb") as cached:
            header = cached.read(HEADER)
        if header[:4] == importlib.util.MAGIC_NUMBER and header[8:16] == source_hash[:8]:
            return False
    except OSError:
        pass
    tree = ast.parse(source, filename=str(path))
    # No config: what pytest's hook writes unless enable_assertion_pass_hook is set,
    # which this project's pytest options do not set.
    rewrite_asserts(tree, source, str(path), None)
    code = compile(tree, str(path), "exec", dont_inherit=True)
    cache.mkdir(exist_ok=True)
    partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
    with open(partial, "wb") as out:
        _write_pyc_fp(out, source_hash, code)
    os.replace(partial, pyc)
    return True


def main() -> int:
    if sys.dont_write_bytecode:
        print("rewrite_asserts: PYTHONDONTWRITEBYTECODE is set; pytest would not read them either")
        return 0
    modules = rewritten_modules()
    written = sum(rewrite(p) for p in modules)
    print(f"rewrite_asserts: {written} of {len(modules)} test modules rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
