"""The flags each engine program takes, read once per program and version and kept.

`FlagCache.flags` runs the program's help command (`engine_flags.help_command`) the
first time a launch needs it and keeps the parsed flags, keyed by the command, the
version the inventory read and the program file's identity (a reinstall changes it), so
`vllm serve --help=all` (about 20 s of CPU) runs once per version, not per launch.
Launches that need the same program at once wait for one reading. At most
`CACHE_ENTRIES` programs are kept, the least recently used going first.

A help that cannot be read (a timeout, a non-zero exit, no flags in it) does not block
a launch: the engine's own parser still judges its arguments, as it did before this
check, and the agent logs why the check was skipped. Such a failure is kept for
`RETRY_AFTER_S`, so a replica that fails over and over does not wait for the help each
time, and a passing trouble (a loaded node) heals.

The flags read are also kept in the agent's state directory (`FlagStore`), under the
same key: a restarted agent's first launch does not wait for the help again (10 s of
CPU for vLLM's, 47 s on a loaded 2-core machine). The version in the key is probed
anew at every start of the agent, so an upgrade is read again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from llmgw_agent.engine_flags import parse_help
from llmgw_agent.private_files import write_private

log = logging.getLogger("llmgw.agent.flags")

HELP_TIMEOUT_S = 120.0  # vLLM's help imports torch: 47 s on a loaded 2-core machine
HELP_MAX_BYTES = 4 * 1024 * 1024  # vLLM 0.32.0's is 155 KB
CACHE_ENTRIES = 16
RETRY_AFTER_S = 600.0
MAX_FLAG_CHARS = 200  # of one flag kept on disk; vLLM's longest is 48
MAX_FLAGS = 20_000  # kept on disk for one program; vLLM 0.32.0 lists about 700
_KILL_GRACE_S = 2.0


@attrs.frozen
class Help:
    """What one reading found: the flags, or why there are none (`flags` None)."""

    flags: frozenset[str] | None
    why: str = ""


async def read_help(
    argv: Sequence[str],
    env: Mapping[str, str],
    timeout_s: float = HELP_TIMEOUT_S,
    max_bytes: int = HELP_MAX_BYTES,
) -> Help:
    """Run a program's help command in its own process group and parse what it prints.
    On timeout the group gets SIGTERM, then SIGKILL."""
    shown = " ".join(argv)
    try:
        process = await trio.lowlevel.open_process(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        return Help(None, f"cannot run {shown}: {exc.strerror or exc}")
    chunks: list[bytes | bytearray] = []
    size = 0
    try:
        assert process.stdout is not None
        with trio.move_on_after(timeout_s) as timer:
            while size <= max_bytes:
                chunk = await process.stdout.receive_some(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > max_bytes:  # not waited for: it may be blocked writing the rest
                return Help(None, f"{shown} printed more than {max_bytes} bytes of help")
            await process.wait()
        if timer.cancelled_caught:
            return Help(None, f"{shown} printed no help within {timeout_s:g} s")
        if process.returncode != 0:
            return Help(None, f"{shown} exited with status {process.returncode}")
    finally:
        with trio.CancelScope(shield=True):
            await _end_group(process)
    flags = parse_help(b"".join(chunks).decode("utf-8", errors="replace"))
    if not flags:
        return Help(None, f"{shown} listed no flags")
    return Help(flags)


async def _end_group(process: trio.Process) -> None:
    """Whatever of the help command still runs: SIGTERM to its group, a grace, SIGKILL."""
    if process.returncode is None:
        _signal_group(process.pid, signal.SIGTERM)
        with trio.move_on_after(_KILL_GRACE_S):
            await process.wait()
    _signal_group(process.pid, signal.SIGKILL)  # children that outlived their leader
    await process.wait()
    if process.stdout is not None:
        await process.stdout.aclose()


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def program_identity(program: str) -> tuple[int, ...]:
    """The program file as found on PATH (device, inode, size, mtime); () when missing."""
    path = shutil.which(program)
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if st else ()


Key = tuple[object, ...]
Reader = Callable[[], Awaitable[Help]]


@attrs.frozen
class FlagStore:
    """The flags read, one file per key in `directory`, at most `entries` files (the
    least recently written go first). A file that cannot be read, is larger than a help
    may be, or holds another key or anything but flags counts as none: the help is read
    again and the file written anew. Writes go to a temporary file renamed into place."""

    directory: Path
    entries: int = CACHE_ENTRIES

    def load(self, key: Key) -> frozenset[str] | None:
        named = _key_text(key)
        if named is None:
            return None
        path = self._path(named)
        try:
            with open(path, "rb") as f:
                raw = f.read(HELP_MAX_BYTES + 1)
            kept = json.loads(raw) if len(raw) <= HELP_MAX_BYTES else None
            flags = kept.get("flags") if isinstance(kept, dict) else None
            if (
                not isinstance(kept, dict)
                or json.dumps(kept.get("key")) != named
                or not isinstance(flags, list)
                or not 0 < len(flags) <= MAX_FLAGS
                or not all(_is_flag(f) for f in flags)
            ):
                raise ValueError("not the flags of this program")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("the flags kept in %s are not used (%s): reading the help again", path, exc)
            return None
        return frozenset(flags)

    def save(self, key: Key, flags: frozenset[str]) -> None:
        named = _key_text(key)
        if named is None:
            return
        path = self._path(named)
        try:
            write_private(path, json.dumps({"key": json.loads(named), "flags": sorted(flags)}))
            kept = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
            for old in kept[: max(0, len(kept) - self.entries)]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot keep the flags read in %s: %s", self.directory, exc)

    def _path(self, named: str) -> Path:
        return self.directory / (hashlib.sha256(named.encode()).hexdigest()[:32] + ".json")


def _key_text(key: Key) -> str | None:
    """The key as JSON (tuples as lists); None for one that JSON cannot hold."""
    try:
        return json.dumps(key)
    except (TypeError, ValueError):
        return None


def _is_flag(flag: object) -> bool:
    return isinstance(flag, str) and flag.startswith("-") and 1 < len(flag) <= MAX_FLAG_CHARS


@attrs.define
class _Entry:
    done: trio.Event = attrs.field(factory=trio.Event)
    help: Help = Help(None, "not read yet")
    read_at: float = 0.0
    cancelled: bool = False


@attrs.define
class FlagCache:
    """The help each program printed, by key; one reading at a time per key."""

    entries: int = CACHE_ENTRIES
    retry_after_s: float = RETRY_AFTER_S
    store: FlagStore | None = None  # where flags read are kept across restarts
    _kept: OrderedDict[Key, _Entry] = attrs.field(factory=OrderedDict)

    async def flags(self, key: Key, read: Reader) -> Help:
        entry = self._kept.get(key)
        now = trio.current_time()
        stale = (
            entry is not None
            and entry.done.is_set()
            and entry.help.flags is None
            and now - entry.read_at >= self.retry_after_s
        )
        if entry is None or stale:
            entry = _Entry()
            self._kept[key] = entry
            while len(self._kept) > self.entries:
                self._kept.popitem(last=False)
            kept = None if self.store is None or stale else self.store.load(key)
            try:
                entry.help = Help(kept) if kept is not None else await read()
            except BaseException:
                # A cancelled reading is nobody's answer: the next launch reads again.
                if self._kept.get(key) is entry:
                    del self._kept[key]
                entry.cancelled = True
                entry.done.set()
                raise
            if self.store is not None and kept is None and entry.help.flags is not None:
                self.store.save(key, entry.help.flags)
            entry.read_at = trio.current_time()
            entry.done.set()
        else:
            self._kept.move_to_end(key)
            await entry.done.wait()
            if entry.cancelled:  # the launch that was reading it was stopped: read anew
                return await self.flags(key, read)
        return entry.help
