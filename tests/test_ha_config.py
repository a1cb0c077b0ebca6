"""`[control.store]` and the per-process options of control planes that share a store:
what is refused, and what one config with a port and a URL per process gives."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from llmgw_core.config import Config, parse_config
from llmgw_core.tomlshape import ConfigError
from llmgw_server.__main__ import build_parser, with_process_options
from llmgw_server.control_shell.seat import advertised_url, catalog_digest
from test_router_apart import read_service

DROP_IN = Path(__file__).parent.parent / "conf" / "systemd" / "llmgw-server-ha.conf"
MODEL = {"models": [{"name": "m", "endpoints": ["http://127.0.0.1:9"]}]}


def config(store: dict[str, object], **more: object) -> Config:
    data = {"control": {"store": store}, "agents": {"insecure": True}, **MODEL, **more}
    return parse_config(data, "server.toml")


@pytest.mark.parametrize(
    ("store", "says"),
    [
        ({"endpoints": []}, "name at least one etcd client URL"),
        ({"endpoints": ["127.0.0.1:2379"]}, "is not an etcd client URL"),
        ({"endpoints": ["http://a:2379/v3"]}, "is not an etcd client URL"),
        ({"endpoints": ["http://a:2379"], "prefix": "llmgw"}, "must start and end with '/'"),
        ({"endpoints": ["http://a:2379"], "prefix": "/a//b/"}, "must start and end with '/'"),
        ({"endpoints": ["http://a:2379"], "lease_ttl_s": 1}, "lease_ttl_s"),
        ({"endpoints": ["http://a:2379"], "user": "llmgw"}, "user and password_env go together"),
        ({"endpoints": ["http://a:2379"], "ca": "ca.crt"}, "ca.crt"),
        ({"endpoints": ["http://a:2379"], "advertise": "https://cp:8081"}, "ws://HOST:PORT"),
        ({"endpoints": ["http://a:2379"], "leader": 1}, "leader"),
    ],
)
def test_a_store_section_that_cannot_work_is_refused_with_its_key(
    store: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError, match=r"control\.store") as refused:
        config(store)
    assert says in str(refused.value)


def test_one_config_gives_each_process_its_ports_and_url() -> None:
    shared = config({"endpoints": ["http://127.0.0.1:2379", "http://127.0.0.1:2380"]})
    args = build_parser().parse_args(
        ["serve", "--listen", "127.0.0.1:9001", "--control-listen", "0.0.0.0:9002"]
    )
    mine = with_process_options(shared, args)
    assert (mine.server.listen.port, mine.server.control_listen.port) == (9001, 9002)
    # A wildcard control_listen is advertised on loopback; --advertise says better.
    assert advertised_url(mine, 9002) == "ws://127.0.0.1:9002"
    args = build_parser().parse_args(["--advertise", "wss://cp-2.example:9002"])
    assert advertised_url(with_process_options(mine, args), 9002) == "wss://cp-2.example:9002"
    # The catalog decides who may lead together, not the ports.
    assert catalog_digest(mine) == catalog_digest(shared)


def test_advertise_without_a_store_or_not_a_websocket_url_is_refused() -> None:
    alone = parse_config({"agents": {"insecure": True}, **MODEL}, "server.toml")
    with pytest.raises(ValueError, match=r"share a \[control\.store\]"):
        with_process_options(alone, build_parser().parse_args(["--advertise", "wss://a:1"]))
    shared = config({"endpoints": ["http://127.0.0.1:2379"]})
    with pytest.raises(ValueError, match="ws://HOST:PORT"):
        with_process_options(shared, build_parser().parse_args(["--advertise", "https://a:1"]))


def test_the_drop_in_advertises_each_hosts_own_name_on_the_same_config() -> None:
    (cleared, line) = read_service(DROP_IN)["ExecStart"]
    assert cleared == ""  # a drop-in replaces ExecStart: the empty one clears the unit's
    argv = shlex.split(line)
    assert argv[:3] == ["/opt/llmgw/bin/llmgw-server", "--config", "/etc/llmgw/server.toml"]
    assert argv[3:] == ["--advertise", "wss://%H:8081"]
    args = build_parser().parse_args(argv[1:])
    assert args.advertise == "wss://%H:8081"


def test_a_store_with_workers_is_refused() -> None:
    """The workers' parent runs a control plane without an election: it would lead too."""
    with pytest.raises(ConfigError, match=r"control\.store: .*workers = 1 \(not 2\)"):
        config({"endpoints": ["http://127.0.0.1:2379"]}, server={"workers": 2})
