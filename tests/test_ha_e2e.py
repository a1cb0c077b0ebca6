"""Control planes that share an etcd, end to end as real processes (issue 35): three
`llmgw-server` on one config, two agents with simulated GPUs and mock engines, two
routers apart that know every control plane, and a request loop through the routers
apart throughout. Each fault: no failed request, no engine restarted, no replica placed
twice, a new leader within its bound."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from etcd_cluster import EtcdCluster
from fleet import Fleet, wait_until
from ha_fleet import ControlPlaneProc, HAFleet, RequestLoop

pytestmark = pytest.mark.xdist_group("ha_e2e")

MODEL = (
    '\n[[models]]\nname = "chat"\nreplicas = 2\n[models.profile]\nengine = "vllm"\n'
    'model = "org/chat"\ngpu_memory_gib = 20\n'
)


def started_engines(fleet: Fleet) -> int:
    """Engines the agents started, from their logs (an adopted engine is not started)."""
    return sum(proc.output().count(": starting pid ") for proc in fleet.every_agent)


def placements(plane: ControlPlaneProc) -> int:
    return plane.proc.output().count("starting replica ")


def running_fleet(fleet: Fleet, endpoints: list[str]) -> HAFleet:
    ha = HAFleet(fleet, endpoints)
    ha.config(MODEL)
    for _ in range(3):
        ha.control_plane()
    ha.leader()
    ha.agent("gpu-1")
    ha.agent("gpu-2")
    wait_until(
        lambda: len([r for r in ha.status()["replicas"] if r["serving"]]) == 2,
        timeout=60,
        what="both replicas serving",
    )
    ha.router_apart()
    ha.router_apart()
    return ha


def admin_write_accepted(
    ha: HAFleet,
    path: str = "/v1/admin/nodes/gpu-1/uncordon",
    stopping: ControlPlaneProc | None = None,
) -> bool:
    """An admin write (by default: uncordon a node, which changes nothing) accepted by the
    leader, reached through any living control plane but `stopping` (its port drains)."""
    for plane in ha.planes:
        if not plane.alive or plane is stopping:
            continue
        try:
            answer = httpx.post(
                plane.control + path,
                json={},
                headers=ha.admin_headers,
                verify=ha.fleet.tls,
                timeout=2,
                follow_redirects=True,
            )
        except httpx.HTTPError:
            continue
        if answer.status_code == 200:
            return True
    return False


def test_the_leader_sigkilled_another_leads_and_no_request_fails(
    fleet: Fleet, etcd: EtcdCluster
) -> None:
    ha = running_fleet(fleet, etcd.endpoints)
    with ha.explained():
        engines = started_engines(fleet)
        assert engines == 2
        loop = RequestLoop([r.url for r in ha.routers])
        loop.start()
        try:
            wait_until(lambda: loop.done > 20, what="requests before the fault")
            old = ha.leader()
            # Leadership changed once (the first began) and never without a fault.
            assert ha.leadership_changes() == 1
            old_epoch = ha.status()["control"]["epoch"]
            killed_at = time.monotonic()
            old.proc.signal(signal.SIGKILL)
            wait_until(lambda: admin_write_accepted(ha), timeout=20, what="a new leader's write")
            took = time.monotonic() - killed_at
            new = ha.leader()
            assert new is not old
            status = ha.status()
            assert status["control"]["epoch"] > old_epoch
            wait_until(
                lambda: (
                    {n["name"] for n in ha.status()["nodes"] if n["status"] == "reachable"}
                    == {"gpu-1", "gpu-2"}
                ),
                timeout=20,
                what="both agents registered with the new leader",
            )
            served = loop.done
            wait_until(lambda: loop.done > served + 20, what="requests after the fault")
        finally:
            loop.stop()
        # Each agent that lost the leader had its hello answered by what it said it lost
        # (sent to the new leader, itself included; told to come back; or taken through
        # its handshake at once).
        hellos = 'llmgw_control_agent_hellos_answered_total{answer="%s"}'
        kinds = ("leader", "this_leader", "come_back", "handshake")
        answered = {a: ha.metric_sum(hellos % a) for a in kinds}
        assert sum(answered.values()) >= 2, answered
        # The CLI, given every control plane (the dead one first), finds the leader.
        cli = ha.cli("status")
        assert cli.returncode == 0, cli.stderr
        assert f"at {new.url} (epoch {status['control']['epoch']} since" in cli.stdout
        assert "control planes: 2: " in cli.stdout and "store: ok" in cli.stdout
        # Given only a standby, it is told where the leader is and to list it.
        standby = next(p for p in ha.planes if p.alive and p is not new)
        alone = ha.cli("status", via=[standby])
        assert alone.returncode == 1 and "give every control plane" in alone.stderr
        assert not loop.errors, loop.errors[:5]
        assert ha.leadership_changes() == 1  # the new leader's beginning, nothing else
        assert started_engines(fleet) == engines  # adopted, never restarted
        assert placements(new) == 0, new.proc.output()[-3000:]
        assert took < 3 * ha.lease_ttl_s + 5, took


def test_a_sigtermed_leader_hands_over_at_once(fleet: Fleet, etcd: EtcdCluster) -> None:
    ha = running_fleet(fleet, etcd.endpoints)
    with ha.explained():
        engines = started_engines(fleet)
        loop = RequestLoop([r.url for r in ha.routers])
        loop.start()
        try:
            wait_until(lambda: loop.done > 20, what="requests before the fault")
            old = ha.leader()
            signalled = time.monotonic()
            old.proc.signal(signal.SIGTERM)
            wait_until(
                lambda: admin_write_accepted(ha, "/v1/admin/reload", old),
                timeout=20,
                what="a new leader's write",
            )
            took = time.monotonic() - signalled
            new = ha.leader()
            assert new is not old
            served = loop.done
            wait_until(lambda: loop.done > served + 20, what="requests after the handover")
        finally:
            loop.stop()
        assert not loop.errors, loop.errors[:5]
        assert started_engines(fleet) == engines
        assert placements(new) == 0, new.proc.output()[-3000:]
        # It resigned: nobody waited for the lease to end (a bound, not a speed goal: the
        # loaded CI machine measured 1.1-1.2 s here, the log 52 ms to the new leader).
        assert took < ha.lease_ttl_s, took


def test_a_leader_paused_past_its_lease_wakes_and_does_not_act(
    fleet: Fleet, etcd: EtcdCluster
) -> None:
    ha = running_fleet(fleet, etcd.endpoints)
    with ha.explained():
        engines = started_engines(fleet)
        loop = RequestLoop([r.url for r in ha.routers])
        loop.start()
        try:
            wait_until(lambda: loop.done > 20, what="requests before the fault")
            old = ha.leader()
            old.proc.signal(signal.SIGSTOP)
            try:
                new = wait_until(
                    lambda: [p for p in ha.planes if p is not old and ha.is_leader(p)],
                    timeout=30,
                    what="another leader while the old one is stopped",
                )[0]
                # The agents move to it (the paused leader's streams go silent).
                wait_until(
                    lambda: (
                        {n["name"] for n in ha.status(new)["nodes"] if n["status"] == "reachable"}
                        == {"gpu-1", "gpu-2"}
                    ),
                    timeout=30,
                    what="both agents registered with the new leader",
                )
                # An operator's act while the old leader sleeps: only the new one carries it out.
                assert admin_write_accepted(ha)
            finally:
                old.proc.signal(signal.SIGCONT)
            wait_until(
                lambda: "no longer leading" in old.proc.output(), what="the old leader to step down"
            )
            assert not ha.is_leader(old)
            assert ha.leader() is new
            served = loop.done
            wait_until(lambda: loop.done > served + 20, what="requests after the pause")
        finally:
            loop.stop()
        assert not loop.errors, loop.errors[:5]
        assert started_engines(fleet) == engines
        # The woken leader sent nothing: no agent refused (or took) a stale command.
        for proc in fleet.every_agent:
            assert "stale epoch" not in proc.output()
        log = old.proc.output()
        woke = log.index("no longer leading")
        assert not re.search(r"starting replica|draining replica|stopping replica", log[woke:])


def test_etcd_away_for_30_s_then_back(fleet: Fleet, etcd3: EtcdCluster) -> None:
    """With the store away the leader steps down at its lease's end; routers keep serving
    and agents keep their engines; status on any control plane says why. Back: a leader
    adopts what runs. One member killed first: nothing notices."""
    ha = running_fleet(fleet, etcd3.endpoints)
    with ha.explained(etcd3):
        engines = started_engines(fleet)
        # A quarter of the other tests' pace: this fault lasts 30 s, not a second or two,
        # so it still meets some 750 requests (alone: 19.5 s of CPU, 22.6 s at 100 a second).
        loop = RequestLoop([r.url for r in ha.routers], rate=25.0)
        loop.start()
        try:
            wait_until(lambda: loop.done > 20, what="requests before the fault")
            first = ha.leader()
            etcd3.kill(etcd3.a_follower())  # a quorum of two is left, and etcd's leader
            served = loop.done
            wait_until(lambda: loop.done > served + 20, what="requests with a member gone")
            assert admin_write_accepted(ha)
            assert ha.leader() is first  # no change of leader for a member's loss
            etcd3.stop_all()
            stopped = time.monotonic()
            wait_until(
                lambda: not any(ha.is_leader(p) for p in ha.planes),
                timeout=3 * ha.lease_ttl_s + 10,
                what="the leader to step down without its store",
            )
            answer = httpx.get(first.control + "/v1/admin/status", verify=fleet.tls, timeout=5)
            assert answer.status_code == 503
            assert "no leader" in answer.json()["error"]["message"]
            served = loop.done
            # The fault's length is the point here: requests go on throughout.
            wait_until(lambda: time.monotonic() - stopped >= 30, timeout=40, what="30 s")
            assert loop.done > served + 50, (served, loop.done)
            etcd3.start_all()
            wait_until(lambda: admin_write_accepted(ha), timeout=30, what="a leader again")
            wait_until(
                lambda: (
                    {n["name"] for n in ha.status()["nodes"] if n["status"] == "reachable"}
                    == {"gpu-1", "gpu-2"}
                ),
                timeout=30,
                what="both agents registered with the leader",
            )
            served = loop.done
            wait_until(lambda: loop.done > served + 20, what="requests after the store's return")
        finally:
            loop.stop()
        assert not loop.errors, loop.errors[:5]
        assert started_engines(fleet) == engines
        assert sum(placements(p) for p in ha.planes) == 2  # the first leader's two, only


def test_every_control_plane_restarted_one_at_a_time(fleet: Fleet, etcd: EtcdCluster) -> None:
    ha = running_fleet(fleet, etcd.endpoints)
    with ha.explained():
        engines = started_engines(fleet)
        loop = RequestLoop([r.url for r in ha.routers])
        loop.start()
        try:
            for plane in list(ha.planes):
                wait_until(lambda: loop.done > 10, what="requests")
                plane.proc.signal(signal.SIGTERM)
                plane.proc.popen.wait(20)
                ha.planes.remove(plane)
                ha.control_plane_at(plane)
                wait_until(lambda: admin_write_accepted(ha), timeout=20, what="a leader")
                wait_until(
                    lambda: (
                        {n["name"] for n in ha.status()["nodes"] if n["status"] == "reachable"}
                        == {"gpu-1", "gpu-2"}
                    ),
                    timeout=30,
                    what="both agents registered with the leader",
                )
            served = loop.done
            wait_until(lambda: loop.done > served + 20, what="requests after the restarts")
        finally:
            loop.stop()
        assert not loop.errors, loop.errors[:5]
        assert started_engines(fleet) == engines


AT_ZERO = """
[[models]]
name = "idle"
[models.profile]
engine = "vllm"
model = "org/idle"
gpu_memory_gib = 20
[models.autoscale]
min = 0
max = 1
target_in_flight = 2
"""


def test_a_model_at_zero_woken_during_a_failover_serves_its_held_request(
    fleet: Fleet, etcd: EtcdCluster
) -> None:
    """The leader dies and a request for a model at zero arrives at a router apart before
    any standby leads: the router holds it, tells the new leader on connecting, and the
    request is served by the replica that leader starts."""
    ha = HAFleet(fleet, etcd.endpoints)
    ha.config(MODEL + AT_ZERO, control="autoscale_interval_s = 0.5")
    for _ in range(3):
        ha.control_plane()
    with ha.explained(etcd):
        ha.leader()
        ha.agent("gpu-1")
        ha.agent("gpu-2")
        wait_until(
            lambda: len([r for r in ha.status()["replicas"] if r["serving"]]) == 2,
            timeout=60,
            what="chat's replicas serving",
        )
        router = ha.router_apart()
        old = ha.leader()
        old.proc.signal(signal.SIGKILL)
        body = {"model": "idle", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with (
            httpx.Client(base_url=router.url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as answer,
        ):
            assert answer.status_code == 200
            rest = b"".join(answer.iter_bytes())
        assert rest.startswith(b": waiting for a replica of idle to start")
        assert rest.endswith(b"data: [DONE]\n\n") and b'"content"' in rest, rest[-300:]
        new = ha.leader()
        assert new is not old
        assert "scaling idle from 0 to 1 replicas" in new.proc.output()
