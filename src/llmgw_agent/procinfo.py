"""What /proc says about a process: enough to know an engine is still the one we started."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw_agent.adoption import ProcView


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ")".
    return text.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """Clock ticks after boot when the process started (/proc/PID/stat field 22); a
    reused PID has another."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait unreaped where nobody reaps it)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")  # type: ignore[index]


def environ_value(pid: int, name: str) -> str | None:
    """The value of `name` in the environment process `pid` was started with ("" when it
    has none), or None when /proc/PID/environ cannot be read (another user's process, a
    non-dumpable one, a process gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("utf-8", errors="replace")
    return ""


def view(pid: int, marker: str) -> ProcView | None:
    """What /proc says of a live (not zombie) process, with its `marker` variable; None
    when it is gone."""
    fields = _stat_fields(pid)
    if not fields or len(fields) <= 19 or fields[0] in ("Z", "X"):
        return None
    return ProcView(
        pid=pid, start_time=int(fields[19]), pgid=int(fields[2]), marker=environ_value(pid, marker)
    )


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group `pgid` remains (a scan of
    /proc, for the end of an engine, not a hot path)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields and len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in "ZX":
                return True
    return False


def group_members(pgid: int, marker: str) -> list[ProcView]:
    """The live processes of process group `pgid` (a scan of /proc: run it at an agent's
    start, not on a hot path)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields and len(fields) > 19 and int(fields[2]) == pgid:
            member = view(int(entry.name), marker)
            if member is not None:
                members.append(member)
    return members
