"""A fleet whose control planes share an etcd: several `llmgw-server` processes on one
config (a port each, one certificate naming 127.0.0.1 for all), agents and routers apart
that know every control plane, and a request loop through the routers apart."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from etcd_cluster import EtcdCluster
from fleet import Fleet, wait_until
from llmgw_core.config import digest_of
from procs import Proc, free_port

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


class ControlPlaneProc:
    def __init__(self, proc: Proc, port: int, control_port: int) -> None:
        self.proc = proc
        self.port = port
        self.control_port = control_port
        self.control = f"https://127.0.0.1:{control_port}"
        self.url = f"wss://127.0.0.1:{control_port}"

    @property
    def alive(self) -> bool:
        return self.proc.popen.poll() is None


class HAFleet:
    """`fleet` with `count` control planes on `endpoints` (etcd), under a prefix of its own."""

    def __init__(self, fleet: Fleet, endpoints: Sequence[str], *, lease_ttl_s: float = 2.0) -> None:
        self.fleet = fleet
        self.endpoints = list(endpoints)
        self.prefix = f"/llmgw/test-{secrets.token_hex(4)}/"
        self.lease_ttl_s = lease_ttl_s
        self.router_token = "router-" + secrets.token_hex(8)
        self.admin_token = "admin-" + secrets.token_hex(8)
        self.admin_headers = {"authorization": f"Bearer {self.admin_token}"}
        self.planes: list[ControlPlaneProc] = []
        self.routers: list[Proc] = []

    def config(self, models: str, control: str = "") -> None:
        """The one config every control plane runs (its ports come from the command line)."""
        store = (
            f"\n[control.store]\nendpoints = {self.endpoints!r}\nprefix = {self.prefix!r}\n"
            f"lease_ttl_s = {self.lease_ttl_s}\n"
        ).replace("'", '"')
        admin = (
            f'\n[admin]\nrouter_token_digest = "sha256:{digest_of(self.router_token)}"\n'
            f'token_digest = "sha256:{digest_of(self.admin_token)}"\nopen_status = true\n'
        )
        # A node is lost after 15 s, not the fleet tests' 4: a failover's agents take up to
        # their silence bound (2 s), a dial of the frozen leader (5 s) and an election (the
        # lease) to register with the new leader, which replaces what it waits for only then.
        self.path = self.fleet.server_config(models, control + store, agents=admin, lost_after_s=15)

    def control_plane(self) -> ControlPlaneProc:
        return self._start(free_port(), free_port())

    def control_plane_at(self, old: ControlPlaneProc) -> ControlPlaneProc:
        """A control plane again on `old`'s ports (a restart: agents and routers list it)."""
        return self._start(old.port, old.control_port)

    def _start(self, port: int, control_port: int) -> ControlPlaneProc:
        argv = [
            sys.executable,
            "-m",
            "llmgw_server",
            "--config",
            str(self.path),
            "--listen",
            f"127.0.0.1:{port}",
            "--control-listen",
            f"127.0.0.1:{control_port}",
        ]
        proc = Proc(argv, port)
        self.fleet.procs.all.append(proc)
        plane = ControlPlaneProc(proc, port, control_port)
        self.planes.append(plane)
        wait_until(lambda: self._answers(plane), what=f"control plane on {control_port}")
        return plane

    def _answers(self, plane: ControlPlaneProc) -> bool:
        try:
            httpx.get(plane.control + "/metrics", verify=self.fleet.tls, timeout=2)
        except httpx.HTTPError:
            if not plane.alive:
                raise AssertionError(plane.proc.output()) from None
            return False
        return True

    def logs(self, lines: int = 40) -> str:
        """Every process's last lines, for a failure's message."""
        procs = [("control plane " + str(p.control_port), p.proc) for p in self.planes]
        procs += [("agent " + name, proc) for name, proc in self.fleet.agents.items()]
        procs += [("router " + str(r.port), r) for r in self.routers]
        # Not the routers' access log: one line a request.
        return "\n".join(
            f"--- {what}:\n"
            + "\n".join([x for x in proc.output().splitlines() if "request_id=" not in x][-lines:])
            for what, proc in procs
        )

    @contextmanager
    def explained(self, etcd: EtcdCluster | None = None) -> Iterator[None]:
        """A failed assertion inside says what every process logged last."""
        try:
            yield
        except AssertionError as exc:
            members = range(len(etcd.endpoints)) if etcd is not None else range(0)
            store = "".join(
                f"\n--- etcd member {i}:\n" + "\n".join(etcd.log(i).splitlines()[-15:])
                for i in members
                if etcd is not None
            )
            raise AssertionError(f"{exc}\n{self.logs()}{store}") from None

    @property
    def server_urls(self) -> list[str]:
        return [f"{p.url}/v1/agent" for p in self.planes]

    def agent(self, name: str, inventory: str = "node-2xl4.toml", **kw: Any) -> Proc:
        return self.fleet.agent(name, inventory, servers=self.server_urls, **kw)

    def is_leader(self, plane: ControlPlaneProc) -> bool:
        if not plane.alive:
            return False
        try:
            page = httpx.get(plane.control + "/metrics", verify=self.fleet.tls, timeout=2).text
        except httpx.HTTPError:
            return False
        return re.search(r"^llmgw_control_leader 1$", page, re.M) is not None

    def leadership_changes(self) -> int:
        """Leaderships begun or ended, summed over the living control planes' /metrics."""
        return self.metric_sum("llmgw_control_leadership_changes_total")

    def metric_sum(self, series: str) -> int:
        """One series (its name and labels, as /metrics writes them), summed over the
        living control planes."""
        total = 0
        for plane in self.planes:
            if plane.alive:
                page = httpx.get(plane.control + "/metrics", verify=self.fleet.tls, timeout=5)
                found = re.search(rf"^{re.escape(series)} (\d+)$", page.text, re.M)
                assert found is not None, page.text[-500:]
                total += int(found.group(1))
        return total

    def leader(self, timeout: float = 30) -> ControlPlaneProc:
        leaders: list[ControlPlaneProc] = wait_until(
            lambda: [p for p in self.planes if self.is_leader(p)], timeout=timeout, what="a leader"
        )
        assert len(leaders) == 1, [p.control_port for p in leaders]
        return leaders[0]

    def status(self, via: ControlPlaneProc | None = None) -> dict[str, Any]:
        """Status through any living control plane: a standby redirects to the leader."""
        plane = via or next(p for p in self.planes if p.alive)
        answer = httpx.get(
            plane.control + "/v1/admin/status",
            verify=self.fleet.tls,
            timeout=5,
            follow_redirects=True,
        )
        answer.raise_for_status()
        data: dict[str, Any] = answer.json()
        return data

    def cli(
        self, *args: str, via: Sequence[ControlPlaneProc] = ()
    ) -> subprocess.CompletedProcess[str]:
        """The admin CLI given every control plane (or `via`), trusting the fleet's CA."""
        controls = ",".join(p.control for p in (via or self.planes))
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "llmgw_server",
                "--control",
                controls,
                "--ca",
                str(self.fleet.certs / "ca.crt"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "LLMGW_ADMIN_TOKEN": self.admin_token},
        )

    def router_apart(self) -> Proc:
        port = free_port()
        path = self.fleet.procs.tmp / f"router-{port}.toml"
        path.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\n[router]\nhealth_interval_s = 0.5\n'
        )
        controls = ",".join(p.control for p in self.planes)
        argv = [
            sys.executable,
            "-m",
            "llmgw_server",
            "router",
            "--config",
            str(path),
            "--control",
            controls,
            "--ca",
            str(self.fleet.certs / "ca.crt"),
        ]
        proc = Proc(argv, port, env={"LLMGW_ROUTER_TOKEN": self.router_token})
        self.fleet.procs.all.append(proc)
        self.routers.append(proc)
        proc.wait_http("/readyz", timeout=60)
        return proc


class RequestLoop:
    """Clients sending chat requests through each router at a steady pace, counting
    failures. The pace is the failover bench's order of load (a hundred a second in all),
    so a fault's window of a second or two still meets a hundred requests. Back to back,
    the clients took whatever CPU was free: test_ha_e2e alone took 90 s of CPU in 85 s
    (40 s paced), all of it taken from the rest of make test on two cores."""

    def __init__(
        self, urls: Sequence[str], model: str = "chat", per_url: int = 2, rate: float = 100.0
    ) -> None:
        self.urls = list(urls)
        self.model = model
        self.per_url = per_url
        self.interval_s = len(self.urls) * per_url / rate  # each client's, between starts
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for url in self.urls:
            for _ in range(self.per_url):
                thread = threading.Thread(target=self._loop, args=(url,), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _loop(self, url: str) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                client.chat.completions.create(model=self.model, messages=CHAT)
                self.done += 1
            except Exception as exc:
                self.errors.append(
                    f"{time.strftime('%H:%M:%S')} {url}: {type(exc).__name__}: {exc}"
                )
            # The next start on the pace, never a burst to catch up after a slow answer.
            next_at = max(next_at + self.interval_s, time.monotonic())
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=40)
