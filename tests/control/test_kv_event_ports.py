"""A profile with kv_events: its replicas hold four ports (HTTP, rendezvous, the KV
events' and their replay's), and the route table's endpoint names where they publish."""

from __future__ import annotations

from fleetsim import FAST, Fleet, catalog, gpu_node, model

from llmgw_core.inventory import ShardState
from llmgw_server.control.launch import free_port


def test_free_port_finds_a_run_of_the_width_asked() -> None:
    assert free_port({20000, 20001}, 20000, 20010) == 20002
    assert free_port({20000, 20001, 20005}, 20000, 20010, width=4) == 20006
    assert free_port(set(), 20000, 20003, width=4) == 20000  # 20000..20003 fits exactly
    assert free_port({20000}, 20000, 20003, width=4) == 20000  # none left: the agent says so


def test_replicas_with_kv_events_hold_four_ports_and_say_where_they_publish() -> None:
    fleet = Fleet(FAST, catalog(model("chat", replicas=3, kv_events=True), model("plain")))
    fleet.join(gpu_node("n1", 8))
    fleet.ready_all()
    specs = sorted((s.spec for _, s in fleet.shards(ShardState.READY)), key=lambda s: s.port)
    held = [p for spec in specs for p in spec.ports]
    assert len(held) == len(set(held)) == 3 * 4 + 2  # no port shared
    serving = fleet.cp.serving()
    for endpoint in serving["chat"]:
        port = endpoint.port
        assert endpoint.kv_events == f"tcp://{endpoint.host}:{port + 2}"
        assert endpoint.kv_replay == f"tcp://{endpoint.host}:{port + 3}"
    (plain,) = serving["plain"]
    assert plain.kv_events == plain.kv_replay == ""
