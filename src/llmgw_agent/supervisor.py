"""One engine process, owned by one task: start, watch readiness, keep its output tail, stop.

The process runs in its own session (process group), so stopping it reaches
every process the engine started: SIGTERM to the group, a grace period, then
SIGKILL. Each transition is reported through `report`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence

import attrs
import httpx
import trio

log = logging.getLogger("llmgw.agent.supervisor")

TAIL_LINES = 40


@attrs.frozen
class Transition:
    state: str  # starting | ready | stopped | failed
    detail: str = ""
    output_tail: tuple[str, ...] = ()
    pid: int | None = None


Report = Callable[[Transition], Awaitable[None]]


@attrs.define
class EngineProcess:
    argv: Sequence[str]
    env: Mapping[str, str]
    health_url: str | None  # None: a rank that serves no HTTP; ready once it stays up
    report: Report
    client: httpx.AsyncClient
    stop_grace_s: float = 10.0
    health_interval_s: float = 0.5
    settle_s: float = 1.0  # how long a rank without HTTP must stay up to count as ready
    tail: deque[str] = attrs.field(factory=lambda: deque(maxlen=TAIL_LINES))
    process: trio.Process | None = None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until the engine exits (reported as failed) or the task is cancelled (stopped)."""
        try:
            process = await trio.lowlevel.open_process(
                list(self.argv),
                env=dict(self.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            await self.report(Transition("failed", f"cannot start {self.argv[0]}: {exc}"))
            task_status.started(0)
            return
        self.process = process
        task_status.started(process.pid)
        await self.report(Transition("starting", f"pid {process.pid}", pid=process.pid))
        final_reported = False
        try:
            output_done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_output, process, output_done)
                nursery.start_soon(self._wait_ready, process)
                code = await process.wait()
                # The last lines are the ones that say why: read them before reporting.
                with trio.move_on_after(1.0):
                    await output_done.wait()
                nursery.cancel_scope.cancel()
            _signal_group(process.pid, signal.SIGKILL)  # whatever the engine left behind
            final_reported = True
            await self.report(
                Transition(
                    "failed",
                    f"the engine exited with status {_describe(code)}",
                    tuple(self.tail),
                    process.pid,
                )
            )
        finally:
            if not final_reported:
                # Stopped on request, also when that came while the exit was being read:
                # either way the group goes and a final state is reported.
                with trio.CancelScope(shield=True):
                    if process.returncode is None:
                        await self._stop(process)
                    else:
                        _signal_group(process.pid, signal.SIGKILL)
                    await self.report(Transition("stopped", "stopped on request", pid=process.pid))

    async def _stop(self, process: trio.Process) -> None:
        _signal_group(process.pid, signal.SIGTERM)
        with trio.move_on_after(self.stop_grace_s):
            await process.wait()
            return
        log.warning(
            "engine pid %d ignored SIGTERM for %s s: SIGKILL", process.pid, self.stop_grace_s
        )
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()

    async def _read_output(self, process: trio.Process, done: trio.Event) -> None:
        assert process.stdout is not None
        pending = b""
        while True:
            try:
                data = await process.stdout.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self.tail.append(line.decode("utf-8", errors="replace").rstrip()[:1000])
            if len(pending) > 65536:  # a line with no end: keep its start only
                self.tail.append(pending[:1000].decode("utf-8", errors="replace"))
                pending = b""
        if pending:
            self.tail.append(pending.decode("utf-8", errors="replace")[:1000])
        done.set()

    async def _wait_ready(self, process: trio.Process) -> None:
        if self.health_url is None:
            await trio.sleep(self.settle_s)
        else:
            while True:
                try:
                    response = await self.client.get(self.health_url)
                    if response.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await trio.sleep(self.health_interval_s)
        await self.report(Transition("ready", "", pid=process.pid))


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
