"""Whether a restarted agent adopts an engine an earlier run started, stops what is left
of it, or finds it gone: a pure decision over the shard's record and what /proc says.

An engine is named by its PID, its start time (a reused PID has another) and a marker
the launch controls: the agent puts `LLMGW_LAUNCH_ID=<replica>.<rank>.<nonce>` in each
engine's environment and reads it back from /proc/PID/environ (readable by the same
user). The command line is no evidence: for a console script (vLLM's `vllm`) the
kernel's starts with the interpreter, and a shell wrapper's names the shell. The marker
also tells a process that only looks like the engine (the same PID and start time after
a reboot) from the engine. Where the environment cannot be read (a non-dumpable
process), the process group stands in: engines start in a session of their own, so the
engine leads the group its PID names.

An engine whose leader cannot be adopted (it ended, a wrapper that forked the engine
ended) while processes of its launch still run in its group is stopped, group and all:
left running, it would hold its GPUs and port beside its replacement. A group in which
no process carries the launch's marker is never touched; one in which some process
does is the engine's (the kernel gives its PID to no new process while the group
lives, and only the engine's session can join it), so all of it goes, a child that
scrubbed its environment included.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

MARKER = "LLMGW_LAUNCH_ID"  # the environment variable that carries the launch id


@attrs.frozen
class ProcView:
    """One live process, as /proc shows it."""

    pid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)
    pgid: int
    marker: str | None  # MARKER's value in its environment ("": none); None: unreadable


@attrs.frozen
class Identity:
    """What a shard record says of the engine it launched."""

    pid: int  # also its process group's id: engines start with a session of their own
    started: int
    launch_id: str  # "": a record written before launch ids (the group stands in)

    def is_leader(self, proc: ProcView) -> bool:
        """`proc` is the process this record launched."""
        if proc.pid != self.pid or proc.start_time != self.started:
            return False
        if self.launch_id and proc.marker is not None:
            return proc.marker == self.launch_id
        return proc.pgid == self.pid

    def launched(self, proc: ProcView, leader: ProcView | None) -> bool:
        """`proc`, a process of the engine's group, comes from this record's launch."""
        if proc.pgid != self.pid:
            return False
        if self.launch_id:
            return proc.marker == self.launch_id
        # An older record: while its group has a member the kernel gives the PID to no
        # new process, so with the leader gone the members are the engine's.
        return leader is None and proc.start_time >= self.started


class Verdict(enum.Enum):
    ADOPT = "adopt"  # the engine runs: supervise it
    STOP = "stop"  # the engine cannot be adopted, but processes of its launch run on
    GONE = "gone"  # nothing of the engine runs


@attrs.frozen
class Decision:
    verdict: Verdict
    leftovers: tuple[int, ...] = ()  # STOP: the PIDs of the launch still running


def decide(identity: Identity, leader: ProcView | None, group: Sequence[ProcView]) -> Decision:
    """`leader`: the process with the record's PID (None: none alive); `group`: the live
    processes whose process group is the record's PID."""
    if leader is not None and identity.is_leader(leader):
        return Decision(Verdict.ADOPT)
    left = tuple(sorted(p.pid for p in group if identity.launched(p, leader)))
    return Decision(Verdict.STOP, left) if left else Decision(Verdict.GONE)
