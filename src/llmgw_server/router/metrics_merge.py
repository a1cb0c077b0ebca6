"""One /metrics page for many worker processes: each worker's series under a `worker` label.

A scrape lands on one worker; the page it answers holds every live worker's samples, each
with `worker="<index>"` added, and each metric family's HELP and TYPE once with all its
samples together, as the Prometheus text format asks. A replaced worker's counters start
again at 0 under the same label, which Prometheus reads as a counter reset of that series.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@attrs.define
class _Family:
    help: str | None = None  # the whole `# HELP` line
    type: str | None = None  # the whole `# TYPE` line
    samples: list[str] = attrs.field(factory=list)


def with_label(sample: str, name: str, value: str) -> str:
    """A sample line with `name="value"` as its first label."""
    match = _NAME.match(sample)
    if match is None:
        return sample
    end = match.end()
    label = f'{name}="{value}"'
    if sample[end : end + 1] == "{":
        inner_empty = sample[end + 1 : end + 2] == "}"
        return f"{sample[: end + 1]}{label}{'' if inner_empty else ','}{sample[end + 1 :]}"
    return f"{sample[:end]}{{{label}}}{sample[end:]}"


def merge_pages(pages: Mapping[str, str], *, own: str = "") -> bytes:
    """Worker id -> its page, merged; `own` is a page of the merger's own, left unlabelled.

    Families keep the order in which they first appear; within a family, the workers'
    samples follow each other in the order of `pages`.
    """
    families: dict[str, _Family] = {}
    for worker, page in pages.items():
        _read(page, families, worker)
    if own:
        _read(own, families, None)
    out: list[str] = []
    for family in families.values():
        if family.help is not None:
            out.append(family.help)
        if family.type is not None:
            out.append(family.type)
        out.extend(family.samples)
    return ("\n".join(out) + "\n").encode()


def _read(page: str, families: dict[str, _Family], worker: str | None) -> None:
    current: _Family | None = None
    for line in page.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = families.setdefault(parts[2], _Family())
                if parts[1] == "HELP" and current.help is None:
                    current.help = line
                elif parts[1] == "TYPE" and current.type is None:
                    current.type = line
            continue
        if current is None:  # a sample before any family header: its own family
            match = _NAME.match(line)
            current = families.setdefault(match.group() if match else line, _Family())
        current.samples.append(line if worker is None else with_label(line, "worker", worker))
