"""What /proc says about a process: enough to know an engine is still the one we started."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ")".
    return text.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """Clock ticks after boot when the process started; a reused PID has another."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait unreaped where nobody reaps it)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")  # type: ignore[index]


def cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode("utf-8", errors="replace") for part in raw.split(b"\0") if part]


def same_process(pid: int, started: int, argv: list[str]) -> bool:
    """The PID still names the process we recorded: same start time, same command line."""
    return running(pid) and start_time(pid) == started and cmdline(pid) == argv
