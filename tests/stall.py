"""Run a command with stalls: the command and every process under it frozen (SIGSTOP) for
up to STALL seconds, at random, every up to EVERY seconds, as a starved CI machine holds
a process back. A test that fails under it measures the machine, not the code.

    python3 tests/stall.py 2.0 8 .venv/bin/python -m pytest -q -n 3 tests/test_x.py

It stops the whole tree at once, so it is harsher than starvation in one way (timers of
every process expire together) and undoes one test's own SIGSTOP (test_workers'
`only_worker_accepts`) when it resumes the tree: those failures are its own."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time


def tree(root: int) -> list[int]:
    """`root` and every process under it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def send(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def main() -> int:
    stall, every, command = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    proc = subprocess.Popen(command, start_new_session=True)
    rng = random.Random()
    try:
        while proc.poll() is None:
            time.sleep(rng.uniform(0.3, every))
            if proc.poll() is not None:
                break
            frozen = tree(proc.pid)
            send(frozen, signal.SIGSTOP)
            time.sleep(rng.uniform(stall * 0.7, stall))
            send(frozen, signal.SIGCONT)
    finally:
        send(tree(proc.pid), signal.SIGCONT)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
