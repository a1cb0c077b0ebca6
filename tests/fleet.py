"""A whole fleet on loopback: the server and agents with simulated GPUs, as real processes."""

from __future__ import annotations

import json
import os
import random
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import openai

from llmgw_core.certs import init_ca, issue_node
from procs import Proc, Procs, free_port

SIM = Path(__file__).parent.parent / "conf" / "sim"
MOCK = [sys.executable, "-m", "llmgw_mock_engine"]


def wait_until(check: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        # Read before the check, so that one check follows the deadline: a stall of this
        # process (a starved CI machine) past it is not taken for the condition's lateness.
        last = time.monotonic() >= deadline
        try:
            value = check()
        except (httpx.HTTPError, openai.APIError, KeyError, IndexError, ValueError, StopIteration):
            value = None  # not yet: a replica may be between engines
        if value:
            return value
        if last:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def engine_port_block() -> int:
    """The first of 100 ports for a fleet's engines.

    Below the kernel's ephemeral range (32768 on), so no outgoing connection of another
    test holds an engine's port, and above the default 20000-20999 that tests with their
    own server config use. Under pytest-xdist each worker draws from blocks of its own
    (every worker count-th one), so that fleets running at once never share a port; one
    worker's fleets run one after another. Not the global generator: hypothesis seeds it
    for its own tests, which would hand later fleets the same ports as an earlier one.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return random.SystemRandom().choice(range(21000 + 100 * worker, 32700, 100 * workers))


class Fleet:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.port = free_port()
        self.control_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = f"https://127.0.0.1:{self.control_port}"
        self.server_proc: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self.every_agent: list[Proc] = []  # restarted ones too: their engines live on
        base = engine_port_block()
        self.ports = (base, base + 99)
        # mTLS as in production: a CA made on the fly, a certificate per node.
        self.certs = procs.tmp / "certs"
        init_ca(self.certs)

    def server(
        self, models: str, control: str = "", agents: str = "", workers: int = 1, router: str = ""
    ) -> Proc:
        """`workers`: router processes under the server's parent ([server] workers);
        `router`: more lines for its [router] table."""
        path = self.server_config(models, control, agents, workers, router)
        proc = Proc([sys.executable, "-m", "llmgw_server", "--config", str(path)], self.port)
        self.procs.all.append(proc)
        proc.wait_http("/healthz")
        self.server_proc = proc
        return proc

    def server_config(
        self,
        models: str,
        control: str = "",
        agents: str = "",
        workers: int = 1,
        router: str = "",
        lost_after_s: float = 4,
    ) -> Path:
        """The server's config file, as `server` writes it."""
        path = self.procs.tmp / "server.toml"
        path.write_text(
            f'[server]\nlisten = "127.0.0.1:{self.port}"\ncontrol_listen = "127.0.0.1:{self.control_port}"\n'
            f"shutdown_grace_s = 2\nworkers = {workers}\n"
            f'[agents]\nca = "{self.certs}/ca.crt"\ncert = "{self.certs}/server.crt"\n'
            f'key = "{self.certs}/server.key"\n{agents}\n'
            f"[router]\nhealth_interval_s = 0.5\n{router}\n"
            f"[control]\nunreachable_after_s = 1.5\nlost_after_s = {lost_after_s}\nsettle_after_start_s = 1\n"
            f"restart_backoff_s = 0.5\ndrain_timeout_s = 2\nengine_port_min = {self.ports[0]}\n"
            f"engine_port_max = {self.ports[1]}\n{control}\n{models}"
        )
        return path

    def agent(
        self,
        name: str,
        inventory: str,
        fabric: str = "pod-a",
        env: str = "",
        cert_for: str = "",
        via: int | None = None,
        command: Sequence[str] = MOCK,
        reconnect: str = "base_s = 0.1\ncap_s = 0.5",
        servers: Sequence[str] = (),
    ) -> Proc:
        """An agent with its own certificate (`cert_for`: one issued to another name);
        `via`: the port of a relay in front of the control plane; `command`: how it
        launches its (mock) engines; `reconnect`: its [reconnect] table (a quick backoff
        unless a test needs the default's); `servers`: the control planes' URLs, where
        several share a store."""
        path = self.procs.tmp / f"{name}.toml"
        crt, key, _ = issue_node(self.certs, cert_for or name)
        server = json.dumps(list(servers) or f"wss://127.0.0.1:{via or self.control_port}/v1/agent")
        path.write_text(
            f'name = "{name}"\nserver = {server}\n'
            f'state_dir = "{self.procs.tmp / name}"\ninventory_file = "{SIM / inventory}"\n'
            f'fabric = {{ ib_domain = "{fabric}" }}\nbind_host = "127.0.0.1"\nstop_grace_s = 3\n'
            f'[tls]\nca = "{self.certs}/ca.crt"\ncert = "{crt}"\nkey = "{key}"\n'
            f"[reconnect]\n{reconnect}\n"
            f"[engines.vllm]\nenv = {{ {env} }}\n".replace("'", '"')
            # JSON's strings are TOML's basic strings: a command may hold quotes.
            + f"command = {json.dumps(list(command))}\n"
            # The agent's inventory probes sglang with this interpreter, not the default's
            # `python3` on PATH: pyenv's bash shim on these machines, twice the CPU at
            # every agent's start (about 100 starts in make test).
            + f"[engines.sglang]\ncommand = {json.dumps([sys.executable, '-m', 'sglang.launch_server'])}\n"
        )
        proc = Proc([sys.executable, "-m", "llmgw_agent", "--config", str(path)], 0)
        self.procs.all.append(proc)
        self.agents[name] = proc
        self.every_agent.append(proc)
        return proc

    def status(self) -> dict[str, Any]:
        response = self.admin.get("/v1/admin/status")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    @cached_property
    def tls(self) -> ssl.SSLContext:
        """One context for the fleet's CA: making one reads the CA file again."""
        return ssl.create_default_context(cafile=str(self.certs / "ca.crt"))

    @cached_property
    def admin(self) -> httpx.Client:
        """One client for the tests' status polls (a client per poll costs about 0.2 s
        of CPU on a busy machine). No keep-alive: each request makes a new connection,
        as a client per request did, so none is reused across a server's restart."""
        return httpx.Client(
            base_url=self.control,
            verify=self.tls,
            timeout=5,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        if "admin" in self.__dict__:
            self.admin.close()

    def cli(self, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        """The admin CLI against this fleet's control plane (trusting the fleet's CA)."""
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "llmgw_server",
                "--control",
                self.control,
                "--ca",
                str(self.certs / "ca.crt"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def node(self, name: str) -> dict[str, Any]:
        return next(n for n in self.status()["nodes"] if n["name"] == name)

    def serving(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.status()["replicas"] if r["model"] == model and r["serving"]]

    def every_engine_pid(self) -> set[int]:
        """Every engine any agent of this fleet started, for the teardown: an agent
        restarted under the same name replaced its entry in `agents`, not its engines."""
        return {
            int(line.rsplit(" ", 1)[1])
            for proc in self.every_agent
            for line in proc.output().splitlines()
            if ": starting pid " in line
        }

    def engine_pids(self) -> list[int]:
        """PIDs of the engines the agents started (from their logs)."""
        pids = []
        for proc in self.agents.values():
            for line in proc.output().splitlines():
                if ": starting pid " in line:
                    pids.append(int(line.rsplit(" ", 1)[1]))
        return pids
