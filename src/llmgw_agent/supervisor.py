"""One engine process, owned by one task: start or adopt, watch readiness and exit, stop.

The process runs in its own session (process group), so stopping it reaches
every process the engine started: SIGTERM to the group, a grace period, then
SIGKILL. When the main process dies on its own (a crash, a SIGKILL), the rest of
the group is stopped the same way at once, and what the engine left in /dev/shm
is removed (`shm_leftovers`) before the failure is reported, so a restart finds
the node as before. Its output goes to a log file, not a pipe, so the engine outlives a
restart of the agent and its last lines are still there when it fails. Each
start writes a fresh log (the previous start's is kept as `.1`), so the lines
reported with a failure are this attempt's. Each transition is reported
through `report`.

The log is capped in size and count. The engine writes to its file descriptor
itself (a pipe the agent had to drain would tie the engine's output to the
agent's life), so the size is checked every `LOG_CHECK_S`: a log past
`log_max_bytes` is copied to `.1` (older copies shift to `.2`..., at most
`log_keep` of them) and truncated in place, as logrotate's copytruncate does.
The log is opened with O_APPEND, so the engine's next write lands at the new
end; lines written between the copy and the truncation are lost, and a log may
overshoot the cap by what the engine writes in `LOG_CHECK_S`. An adopted engine
whose log is not in append mode (started by an older agent) is left uncapped.

The engine's key (`api_key`) is sent with the readiness probes and masked in
every tail reported; the log and the files written for the engine (`files`)
are readable by the agent's user only.

When the task is cancelled, the engine is stopped only if `stop_on_cancel` is
set (a stop command); an agent that shuts down leaves its engines serving.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import attrs
import httpx
import trio

from llmgw_agent import procinfo
from llmgw_agent.adoption import MARKER, Identity, Verdict, decide
from llmgw_agent.private_files import write_private
from llmgw_agent.shm_leftovers import SHM, clean_after, snapshot

log = logging.getLogger("llmgw.agent.supervisor")

TAIL_LINES = 40
_POLL_S = 0.5
LOG_MAX_BYTES = 64 * 1024 * 1024  # one engine log's cap; the copies are as large at most
LOG_KEEP = 2  # older logs kept per shard (.1, .2): previous starts and rotated copies
LOG_CHECK_S = 10.0
# Log files kept in the agent's logs directory besides those of the shards it knows (of
# replicas gone): the oldest go first. With the size cap, about 2 GiB at most.
LOG_FILES_KEPT = 30


@attrs.frozen
class Transition:
    state: str  # starting | ready | stopped | failed
    detail: str = ""
    output_tail: tuple[str, ...] = ()
    pid: int | None = None


Report = Callable[[Transition], Awaitable[None]]


def read_tail(path: Path, lines: int = TAIL_LINES, secret: str = "") -> tuple[str, ...]:
    """The last lines of an engine's log file (each cut to 1,000 characters), with
    `secret` masked: an engine may print its own key (SGLang logs its arguments)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(0, f.tell() - 64 * 1024)
            f.seek(start)
            data = f.read()
    except OSError:
        return ()
    if start:  # the first line is cut: it could hold part of the key, which masking misses
        data = data.partition(b"\n")[2]
    text = data.decode("utf-8", errors="replace")
    if secret:
        text = text.replace(secret, "****")
    return tuple(line.rstrip()[:1000] for line in text.splitlines()[-lines:])


def _older(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def _shift_older(path: Path, keep: int) -> None:
    """Make room for a new `NAME.1`: `.1` becomes `.2` and so on; the oldest beyond
    `keep` goes."""
    for n in range(keep, 0, -1):
        try:
            if n == keep:
                _older(path, n).unlink()
            else:
                os.replace(_older(path, n), _older(path, n + 1))
        except FileNotFoundError:
            pass


def open_fresh_log(path: Path, keep: int = LOG_KEEP) -> BinaryIO:
    """A new, empty log for one start of an engine; the previous start's log becomes
    `NAME.1` (older ones shift, at most `keep` kept). In append mode, so that it can be
    truncated under the engine; private to the agent's user: an engine may print its key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if keep > 0:
        _shift_older(path, keep)
        try:
            os.replace(path, _older(path, 1))
        except FileNotFoundError:
            pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    return os.fdopen(os.open(path, flags, 0o600), "wb")


def rotate_if_large(path: Path, max_bytes: int, keep: int) -> bool:
    """Copy a log past `max_bytes` to `NAME.1` (with `keep` 0, drop it) and truncate it in
    place; True when it did. Blocking: run it in a thread."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        if keep > 0:
            _shift_older(path, keep)
            copy = _older(path, 1)
            with path.open("rb") as src:
                fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1024 * 1024)
        os.truncate(path, 0)
    except OSError as exc:
        log.warning("cannot rotate the engine log %s: %s", path, exc)
        return False
    return True


def appends(pid: int, fd: int = 1) -> bool:
    """Whether process `pid` writes its descriptor `fd` in append mode (from /proc)."""
    try:
        text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags:"):
            return bool(int(line.split()[1], 8) & os.O_APPEND)
    return False


def prune_logs(directory: Path, keep_files: int, protect: Collection[str]) -> list[Path]:
    """Remove the oldest engine logs in `directory` beyond `keep_files`, sparing those
    whose name starts with one of `protect` (the logs of shards the agent knows)."""
    try:
        found = [p for p in directory.iterdir() if p.is_file() and ".log" in p.name]
    except OSError:
        return []
    spared = [p for p in found if not any(p.name.startswith(name) for name in protect)]
    if len(found) <= keep_files:
        return []
    spared.sort(key=_mtime)
    removed = []
    for path in spared[: len(found) - keep_files]:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class _Child:
    """A process this agent started: waited on directly. `shm_before`: what /dev/shm held
    just before it started."""

    def __init__(self, process: trio.Process, shm_before: frozenset[str]) -> None:
        self.process = process
        self.pid = process.pid
        self.shm_before = shm_before

    async def wait(self) -> int:
        return await self.process.wait()

    def exited(self) -> bool:
        return self.process.returncode is not None


class _Adopted:
    """A process an earlier run of the agent started: watched through /proc.
    `shm_before`: /dev/shm before it started, as its record kept it (None: unknown)."""

    def __init__(self, pid: int, started: int, shm_before: frozenset[str] | None) -> None:
        self.pid = pid
        self.started = started
        self.shm_before = shm_before

    async def wait(self) -> int | None:
        while not self.exited():
            await trio.sleep(_POLL_S)
        return None  # not our child: its status is not ours to read

    def exited(self) -> bool:
        return not procinfo.running(self.pid) or procinfo.start_time(self.pid) != self.started


@attrs.define
class EngineProcess:
    argv: Sequence[str]
    env: Mapping[str, str] = attrs.field(repr=False)
    health_url: str | None  # None: a rank that serves no HTTP; ready once it stays up
    report: Report
    client: httpx.AsyncClient
    log_path: Path
    stop_grace_s: float = 10.0
    health_interval_s: float = 0.5
    settle_s: float = 1.0  # how long a rank without HTTP must stay up to count as ready
    stop_on_cancel: bool = False  # set by a stop command; else cancelling leaves it running
    # Told the engine's PID and what /dev/shm held just before it started.
    on_spawn: Callable[[int, frozenset[str]], None] | None = None
    start_timeout_s: float = 1800.0  # loading weights takes long, but not forever
    api_key: str = attrs.field(default="", repr=False)  # the key the engine requires
    files: Sequence[tuple[str, str]] = attrs.field(default=(), repr=False)  # path, text
    log_max_bytes: int = LOG_MAX_BYTES  # 0: no size cap
    log_keep: int = LOG_KEEP
    log_check_s: float = LOG_CHECK_S
    shm_dir: Path = SHM  # where the engine's shared memory lives
    group_poll_s: float = 0.1  # how often the end of the engine's group is looked for
    _gave_up: bool = False

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine and supervise it until it exits or the task is cancelled."""
        try:
            for path, text in self.files:
                write_private(Path(path), text)
            shm_before = snapshot(self.shm_dir)
            with open_fresh_log(self.log_path, self.log_keep) as out:
                process = await trio.lowlevel.open_process(
                    list(self.argv),
                    env=dict(self.env),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            await self.report(Transition("failed", f"cannot start {self.argv[0]}: {exc}"))
            task_status.started(0)
            return
        if self.on_spawn is not None:
            self.on_spawn(process.pid, shm_before)
        task_status.started(process.pid)
        await self.report(Transition("starting", f"pid {process.pid}", pid=process.pid))
        await self._supervise(_Child(process, shm_before))

    async def adopt(
        self, pid: int, started: int, shm_before: frozenset[str] | None = None
    ) -> None:
        """Supervise an engine a previous run of the agent started (its shard starts out as
        starting; the first good health check makes it ready, usually before registering)."""
        await self._supervise(_Adopted(pid, started, shm_before))

    async def _supervise(self, handle: _Child | _Adopted) -> None:
        final_reported = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._wait_ready, handle.pid)
                if self.log_max_bytes > 0 and (isinstance(handle, _Child) or appends(handle.pid)):
                    nursery.start_soon(self._cap_log)
                code = await handle.wait()
                nursery.cancel_scope.cancel()
            final_reported = True
            await self._end_group(handle)
            why = (
                f"the engine did not become healthy within {self.start_timeout_s:g} s"
                if self._gave_up
                else how_it_ended(code)
            )
            await self.report(
                Transition(
                    "failed",
                    why,
                    read_tail(self.log_path, secret=self.api_key),
                    handle.pid,
                )
            )
        finally:
            if not final_reported and self.stop_on_cancel:
                # Stopped on request, also when that came while the exit was being read:
                # either way the group goes and a final state is reported.
                with trio.CancelScope(shield=True):
                    if not handle.exited():
                        await self._stop(handle)
                    await self._end_group(handle)
                    await self.report(Transition("stopped", "stopped on request", pid=handle.pid))

    async def _end_group(self, handle: _Child | _Adopted) -> None:
        """Once the engine's main process is gone: the rest of its group (vLLM's engine
        core, workers, resource tracker) gets SIGTERM and `stop_grace_s` to end, which lets
        the tracker remove the shared memory it knows, then SIGKILL; then what the engine
        left in /dev/shm and nobody holds is removed (`shm_leftovers`; not for an engine
        adopted from an agent that kept no snapshot of /dev/shm)."""
        for signum, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 5.0)):
            if not await _group_alive(handle.pid):
                break
            _signal_group(handle.pid, signum)
            with trio.move_on_after(wait_s):
                while await _group_alive(handle.pid):
                    await trio.sleep(self.group_poll_s)
        else:
            if await _group_alive(handle.pid):
                log.error("processes of engine group %d outlived SIGKILL", handle.pid)
                return  # they may still hold what they made
        if handle.shm_before is not None:
            await trio.to_thread.run_sync(clean_after, handle.pid, handle.shm_before, self.shm_dir)

    async def _cap_log(self) -> None:
        while True:
            await trio.sleep(self.log_check_s)
            await trio.to_thread.run_sync(
                rotate_if_large, self.log_path, self.log_max_bytes, self.log_keep
            )

    async def _stop(self, handle: _Child | _Adopted) -> None:
        _signal_group(handle.pid, signal.SIGTERM)
        with trio.move_on_after(self.stop_grace_s):
            await handle.wait()
            return
        log.warning(
            "engine pid %d ignored SIGTERM for %s s: SIGKILL", handle.pid, self.stop_grace_s
        )
        _signal_group(handle.pid, signal.SIGKILL)
        await handle.wait()

    async def _wait_ready(self, pid: int) -> None:
        with trio.move_on_after(self.start_timeout_s):
            if self.health_url is None:
                await trio.sleep(self.settle_s)
            else:
                headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else None
                while True:
                    try:
                        response = await self.client.get(self.health_url, headers=headers)
                        if response.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(self.health_interval_s)
            await self.report(Transition("ready", "", pid=pid))
            return
        # Never healthy: stop it; its exit is then reported as this failure.
        self._gave_up = True
        _signal_group(pid, signal.SIGTERM)
        await trio.sleep(self.stop_grace_s)
        _signal_group(pid, signal.SIGKILL)


def leftovers(identity: Identity) -> tuple[int, ...]:
    """The processes of a launch that cannot be adopted but still run (see `adoption`)."""
    leader = procinfo.view(identity.pid, MARKER)
    decision = decide(identity, leader, procinfo.group_members(identity.pid, MARKER))
    return decision.leftovers if decision.verdict is Verdict.STOP else ()


async def stop_leftovers(identity: Identity, grace_s: float, poll_s: float = 0.2) -> bool:
    """Stop what runs of an engine that cannot be adopted, its whole process group: SIGTERM,
    `grace_s`, SIGKILL. The group is signalled only while `decide` finds processes of the
    launch in it. True when nothing of it is left (a process stuck in the kernel may
    outlive SIGKILL for a while)."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, max(grace_s, 5.0))):
        if not leftovers(identity):
            return True
        _signal_group(identity.pid, signum)
        with trio.move_on_after(wait_s):
            while leftovers(identity):
                await trio.sleep(poll_s)
    return not leftovers(identity)


async def _group_alive(pgid: int) -> bool:
    # A scan of every process in /proc: off the agent's loop on a node that runs many.
    return await trio.to_thread.run_sync(procinfo.group_alive, pgid)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def how_it_ended(code: int | None) -> str:
    """The failure text for an engine's exit status (None: an adopted engine is no child of
    this agent, its status is not ours to read). The engine is launched without a shell, so
    a signal death is a negative status; a status of 128+N is the engine's own exit code,
    told as it is (a wrapper script's shell may mean signal N by it, or not)."""
    if code is None:
        return "the engine exited"
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"the engine was killed by signal {-code}{name}"
    return f"the engine exited with status {code}"
