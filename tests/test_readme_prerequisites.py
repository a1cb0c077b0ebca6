"""The README's prerequisites say how a user's machine gets what `make test` installs:
vLLM's torch pin (not on PyPI) and the disk it takes (issue 36)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_readme_says_where_vllms_torch_comes_from_and_its_disk() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    # The pin the vLLM build meets (tests/real_vllm.py), as the README names it.
    (pin,) = set(re.findall(r"torch==[\w.+]+", (ROOT / "tests" / "real_vllm.py").read_text()))
    assert f"`{pin}`, which is not on PyPI" in quick
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in quick
    assert "about 3.6 GB of disk" in quick
