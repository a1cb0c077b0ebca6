"""The agent's one way to write a file of its state: whole or not at all, readable by
its user only."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write a file only the agent's user can read, whole or not at all (a crash never
    leaves half a record, half a key file or half the node's flags)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a leftover partial file keeps its old mode otherwise
        f.write(text)
    os.replace(tmp, path)
