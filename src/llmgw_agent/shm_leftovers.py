"""What a dead engine left in shared memory (/dev/shm), and removing it.

vLLM's processes share a ring buffer (hundreds of MiB) and semaphores through files in
/dev/shm; its resource tracker removes them when the engine ends in order. A SIGKILL of
the API server leaves them, and a replica that crash-loops fills the node's shared
memory. Which files are the engine's: those that were not there when it was launched
(`snapshot`, taken just before), belong to the engine's user, are plain files, and that
no live process holds, open or mapped (/proc/*/fd and /proc/*/maps). What another
process holds is never touched, whoever made it. A file is known by its device and
inode, not its path, so a process in another mount namespace (a container given the
host's /dev/shm elsewhere) that holds it is seen too. A file anyone but its owner may
open is kept when some process's /proc could not be read: that process may hold it.

`leftovers` decides from plain values; `holders` and `remove_leftovers` read /proc and
the directory (blocking: run them in a thread, once an engine's whole group is gone).
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
# Descriptors that are no file of a directory: never stat'ed.
_NOT_FILES = ("socket:", "pipe:", "anon_inode:")

FileId = tuple[int, int]  # st_dev, st_ino


@attrs.frozen
class Entry:
    name: str
    uid: int
    mode: int  # st_mode
    size: int
    file: FileId = (0, 0)


@attrs.frozen
class Holders:
    """The files on the directory's device that live processes hold, and whether every
    process's /proc could be read."""

    files: frozenset[FileId]
    complete: bool


def leftovers(
    entries: Iterable[Entry], before: frozenset[str], uid: int, held: Holders
) -> list[Entry]:
    """The entries a dead engine of user `uid`, launched when the directory held `before`,
    left behind and nobody holds."""
    found = []
    for entry in entries:
        if entry.name in before or entry.uid != uid or not stat.S_ISREG(entry.mode):
            continue
        if entry.file in held.files:
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
                found.append(
                    Entry(item.name, st.st_uid, st.st_mode, st.st_size, (st.st_dev, st.st_ino))
                )
    except OSError:
        pass
    return found


def holders(device: int, proc: Path = Path("/proc")) -> Holders:
    """Every file on `device` a live process has open (/proc/PID/fd) or mapped
    (/proc/PID/maps: a POSIX semaphore or a shared buffer is mapped, its descriptor often
    closed)."""
    files: set[FileId] = set()
    complete = True
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # gone meanwhile
        except OSError:
            complete = False
            fds = []
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd).startswith(_NOT_FILES):
                    continue
                st = os.stat(fd_dir / fd)  # the file itself, wherever it is mounted
            except OSError:
                continue
            if st.st_dev == device:
                files.add((st.st_dev, st.st_ino))
        try:
            with open(proc / pid / "maps", encoding="ascii", errors="replace") as maps:
                for line in maps:
                    mapped = _mapped_file(line)
                    if mapped is not None and mapped[0] == device:
                        files.add(mapped)
        except FileNotFoundError:
            continue
        except OSError:
            complete = False
    return Holders(frozenset(files), complete)


def _mapped_file(line: str) -> FileId | None:
    """The device and inode of a /proc/PID/maps line (`addr perms offset MAJ:MIN inode
    path`); None for an anonymous mapping."""
    fields = line.split(maxsplit=5)
    if len(fields) < 5 or fields[4] == "0":
        return None
    try:
        major, minor = (int(part, 16) for part in fields[3].split(":"))
        return os.makedev(major, minor), int(fields[4])
    except ValueError:
        return None


def remove_leftovers(before: frozenset[str], directory: Path = SHM) -> list[Entry]:
    """Remove what a dead engine of this user left in `directory` (see the module's words);
    the entries removed."""
    uid = os.getuid()
    mine = [e for e in entries(directory) if e.name not in before and e.uid == uid]
    if not mine:
        return []  # the common case: no scan of every process
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return []
    removed = []
    for entry in leftovers(mine, before, uid, holders(device)):
        path = directory / entry.name
        try:
            st = os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != entry.file:
                continue  # another file took the name since: not what was judged
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove %s left by an engine: %s", path, exc)
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
