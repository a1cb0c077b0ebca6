"""The daemons' processes started from a warm interpreter, for end-to-end tests.

`python -m llmgw_server` spends 0.3-0.4 s of CPU importing and compiling before its
first line of work, and the suite starts some 600 routers, agents and mock engines: on
CI's two cores, a fifth of `make test`. So each test process (each pytest-xdist
worker) keeps one fork server, a Python that has imported the three daemons once; a
test's process is a fork of it that runs the module's `__main__` as `python -m` would
(`runpy`, with its own argv, environment, working directory, session and log), so it
is a real process on real sockets, only started warm. The fork server reports each
child's exit status, which `WarmPopen` gives as `subprocess.Popen` does.

What `python -m` itself does before `main` (the interpreter's start, the import of the
daemons from scratch) is tested where it is the point: tests/test_cli.py,
tests/test_install.py and the real engines' tests exec the commands. Set
LLMGW_TEST_COLD=1 to start every process with exec.

Run as a script, this is the fork server: requests and answers are JSON lines over the
socket it is given (fd 3).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

# The modules a warm start runs, and what the fork server imports once for them.
WARM_MODULES = ("llmgw_server", "llmgw_agent", "llmgw_mock_engine")
_PRELOAD = (
    "llmgw_server.__main__",
    "llmgw_server.wiring",
    "llmgw_server.control_shell.controlplane",
    "llmgw_server.route_feed.remote",
    "llmgw_agent.__main__",
    "llmgw_agent.agent",
    "llmgw_mock_engine.cli",
    "llmgw_mock_engine.engine",
)


def warm_module(argv: Sequence[str]) -> str | None:
    """The daemon module `argv` runs as `python -m MODULE`, when a warm start can run it."""
    if os.environ.get("LLMGW_TEST_COLD") == "1":
        return None
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in WARM_MODULES:
        return argv[2]
    return None


class WarmPopen:
    """A forked daemon, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This test process's end of its fork server."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._socket = ours
        self._process = subprocess.Popen(
            [sys.executable, __file__],
            pass_fds=[theirs.fileno()],
            env={**os.environ, "LLMGW_FORK_SERVER_FD": str(theirs.fileno())},
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._lock = threading.Lock()  # one request at a time, one reader of the socket
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._answer(self._started, 60.0)  # it says it is ready: pid 0
        atexit.register(self.close)

    def close(self) -> None:
        """End the fork server (it ends when its socket closes) and wait for it."""
        self._socket.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def start(self, module: str, argv: list[str], env: dict[str, str], log: str) -> WarmPopen:
        request = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "log": log}
        with self._lock:
            self._socket.sendall(json.dumps(request).encode() + b"\n")
            pid = self._answer(self._started, 30.0)
        return WarmPopen(self, pid, argv)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:  # held a moment at a time: other threads start processes
                if pid in self._exits:
                    return self._exits.pop(pid)
                left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                self._read(max(left, 0.0))
                if pid in self._exits:
                    return self._exits.pop(pid)
                if left <= 0:
                    return None

    def _answer(self, into: list[int], timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not into:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("the fork server did not answer")
            self._read(left)
        return into.pop(0)

    def _read(self, timeout: float | None) -> None:
        self._socket.settimeout(timeout)
        try:
            data = self._socket.recv(65536)
        except (TimeoutError, BlockingIOError):
            return
        if not data:
            raise AssertionError(f"the fork server exited ({self._process.poll()})")
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "exit" in message:
                self._exits[message["exit"]] = message["code"]
            else:
                self._started.append(message["pid"])

    @property
    def alive(self) -> bool:
        return self._process.poll() is None


_server: ForkServer | None = None


def start(argv: Sequence[str], env: dict[str, str], log: str) -> WarmPopen | None:
    """`argv` started warm, or None where it must be exec'd."""
    global _server
    module = warm_module(argv)
    if module is None:
        return None
    if _server is None or not _server.alive:
        _server = ForkServer()
    return _server.start(module, list(argv), env, log)


# -- the fork server ---------------------------------------------------------------


def _serve(fd: int) -> None:
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)

    def say(message: dict[str, Any]) -> None:
        sock.sendall(json.dumps(message).encode() + b"\n")

    say({"pid": 0})
    buffer = b""
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
            else:
                data = sock.recv(65536)
                if not data:
                    return  # the test process is gone: so is its fork server
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    say({"pid": _fork(json.loads(line))})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2:  # the server's socket, its wakeup pipe and selector: not the child's
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        import runpy

        sys.argv = [request["module"], *request["argv"][3:]]
        sys.path[0] = request["cwd"]  # as `python -m` has it, not this script's directory
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = _exit_code(exit.code)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # as the interpreter's exit would (logging's flush)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve(int(os.environ.pop("LLMGW_FORK_SERVER_FD")))
