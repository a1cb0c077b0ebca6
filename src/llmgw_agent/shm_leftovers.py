"""What a dead engine left in shared memory (/dev/shm), and removing it.

vLLM's processes share a ring buffer (hundreds of MiB) and semaphores through files in
/dev/shm; its resource tracker removes them when the engine ends in order. A SIGKILL of
the API server leaves them, and a replica that crash-loops fills the node's shared
memory. Which files are the engine's: those that were not there when it was launched
(`snapshot`, taken just before), belong to the engine's user, are plain files, and that
no live process holds, open or mapped (/proc/*/fd and /proc/*/maps). What another
process holds is never touched, whoever made it. A file anyone but its owner may open is
kept when some process's /proc could not be read (another user's): that process may hold
it.

`leftovers` decides from plain values; `scan` and `remove_leftovers` read /proc and the
directory (blocking: run them in a thread, once an engine's whole group is gone).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs

log = logging.getLogger("llmgw.agent.shm")

SHM = Path("/dev/shm")
_DELETED = " (deleted)"


@attrs.frozen
class Entry:
    name: str
    uid: int
    mode: int  # st_mode
    size: int


@attrs.frozen
class Holders:
    """The files under the directory that live processes hold, and whether every
    process's /proc could be read."""

    paths: frozenset[str]
    complete: bool


def leftovers(
    entries: Iterable[Entry], before: frozenset[str], uid: int, held: Holders, directory: str
) -> list[Entry]:
    """The entries a dead engine of user `uid`, launched when the directory held `before`,
    left behind and nobody holds."""
    found = []
    for entry in entries:
        if entry.name in before or entry.uid != uid or not stat.S_ISREG(entry.mode):
            continue
        if os.path.join(directory, entry.name) in held.paths:
            continue
        if not held.complete and entry.mode & 0o077:
            continue  # someone we could not look at may have it open
        found.append(entry)
    return found


def snapshot(directory: Path = SHM) -> frozenset[str]:
    """The names in the directory now (empty when it cannot be read)."""
    try:
        return frozenset(os.listdir(directory))
    except OSError:
        return frozenset()


def entries(directory: Path) -> list[Entry]:
    found = []
    try:
        with os.scandir(directory) as scan:
            for item in scan:
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append(Entry(item.name, st.st_uid, st.st_mode, st.st_size))
    except OSError:
        pass
    return found


def holders(directory: Path, proc: Path = Path("/proc")) -> Holders:
    """Every path under `directory` a live process has open (/proc/PID/fd) or mapped
    (/proc/PID/maps: a POSIX semaphore or a shared buffer is mapped, its descriptor often
    closed)."""
    prefix = str(directory).rstrip("/") + "/"
    paths: set[str] = set()
    complete = True
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(proc / pid / "fd")
        except FileNotFoundError:
            continue  # gone meanwhile
        except OSError:
            complete = False
            fds = []
        for fd in fds:
            try:
                target = os.readlink(proc / pid / "fd" / fd)
            except OSError:
                continue
            if target.startswith(prefix):
                paths.add(target.removesuffix(_DELETED))
        try:
            with open(proc / pid / "maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        paths.add(line[at:].rstrip("\n").removesuffix(_DELETED))
        except FileNotFoundError:
            continue
        except OSError:
            complete = False
    return Holders(frozenset(paths), complete)


def remove_leftovers(before: frozenset[str], directory: Path = SHM) -> list[Entry]:
    """Remove what a dead engine of this user left in `directory` (see the module's words);
    the entries removed."""
    uid = os.getuid()
    mine = [e for e in entries(directory) if e.name not in before and e.uid == uid]
    if not mine:
        return []  # the common case: no scan of every process
    removed = []
    for entry in leftovers(mine, before, uid, holders(directory), str(directory)):
        try:
            os.unlink(directory / entry.name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove %s left by an engine: %s", directory / entry.name, exc)
            continue
        removed.append(entry)
    return removed


def clean_after(pid: int, before: frozenset[str], directory: Path = SHM) -> None:
    """Remove what the dead engine whose main process was `pid` left, and log each file."""
    for entry in remove_leftovers(before, directory):
        log.warning(
            "removed %s (%d bytes), left in shared memory by engine pid %d",
            directory / entry.name,
            entry.size,
            pid,
        )
