"""A profile change rolls a two-replica model one replica at a time, as real processes:
server, agents with simulated GPUs, mock engines; a request loop sees no error."""

from __future__ import annotations

import signal
import threading
from typing import Any

import httpx
import openai
import pytest

from fleet import Fleet, wait_until
from test_fleet_e2e import RequestLoop, model

SLOW = 'LLMGW_MOCK_STARTUP_DELAY = "1.5", LLMGW_MOCK_TPS = "40"'


class Watch:
    """Polls the control plane's status from a thread: what each snapshot shows of the
    roll, and every moment that breaks its promises."""

    def __init__(self, fleet: Fleet, old: set[str]) -> None:
        self.fleet, self.old = fleet, old
        self.violations: list[str] = []
        self.seen: set[str] = set()  # every replica id seen
        self.snapshots = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                replicas: list[dict[str, Any]] = self.fleet.status()["replicas"]
            except httpx.HTTPError:
                continue  # a failed poll is no snapshot
            self.snapshots += 1
            chat = [r for r in replicas if r["model"] == "chat"]
            self.seen |= {r["replica_id"] for r in chat}
            serving = [r["replica_id"] for r in chat if r["serving"]]
            starting = [
                r["replica_id"]
                for r in chat
                if r["replica_id"] not in self.old and r["kept"] and not r["serving"]
            ]
            if len(serving) < 2:
                self.violations.append(f"{len(serving)} serving: {chat}")
            if len(starting) > 1:
                self.violations.append(f"{len(starting)} new ones starting at once: {starting}")


@pytest.mark.parametrize("workers", [1, 2])  # with workers, their parent owns the control plane
def test_a_profile_change_rolls_one_replica_at_a_time_and_loses_no_request(
    fleet: Fleet, workers: int
) -> None:
    path = fleet.procs.tmp / "server.toml"
    fleet.server(
        model("chat", replicas=2, extra='args = ["--mock-block-size", "16"]'), workers=workers
    )
    fleet.agent("gpu-1", "node-2xl4.toml", env=SLOW)
    fleet.agent("gpu-2", "node-2xl4.toml", env=SLOW)
    before = wait_until(
        lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None,
        what="two replicas",
    )
    old = {r["replica_id"] for r in before}
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    wait_until(lambda: [m.id for m in client.models.list()] == ["chat"], what="the router")
    with RequestLoop(client) as loop, Watch(fleet, old) as watch:
        wait_until(lambda: loop.done >= 4, what="requests before the change")
        path.write_text(
            path.read_text().replace('"--mock-block-size", "16"', '"--mock-block-size", "32"')
        )
        assert fleet.server_proc is not None
        fleet.server_proc.popen.send_signal(signal.SIGHUP)

        def rolled() -> bool:
            chat = [r for r in fleet.status()["replicas"] if r["model"] == "chat"]
            ids = {r["replica_id"] for r in chat}
            return len(ids) == 2 and not ids & old and all(r["serving"] for r in chat)

        wait_until(rolled, timeout=90, what="the roll to end")
        after = loop.done
        wait_until(lambda: loop.done >= after + 4, what="requests after the roll")
    assert loop.errors == []
    assert watch.snapshots > 20 and watch.violations == []
    new = {r["replica_id"] for r in fleet.serving("chat")}
    assert watch.seen == old | new  # each replaced once: no replacement was replaced
    out = fleet.server_proc.output()
    assert "profiles changed (rolled): chat" in out
    assert "its profile changed and its replacement serves" in out
    ports = {"mock:" + r["url"].rsplit(":", 1)[1] for r in before + fleet.serving("chat")}
    assert loop.served_by <= ports and len(loop.served_by) >= 3  # old ones, then new ones
