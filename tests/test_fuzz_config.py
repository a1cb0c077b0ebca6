"""Bad input for the config loaders (issue 5): arbitrary TOML-shaped data and arbitrary
text either loads or raises ConfigError, never anything else; the CLIs exit 2 on a bad
file and print no traceback."""

from __future__ import annotations

import datetime as dt
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_agent.config import parse_agent_config
from llmgw_agent.inventory_probe import read_simulated
from llmgw_core.config import load_config, parse_config
from llmgw_core.tomlshape import ConfigError

FUZZ = settings(
    max_examples=profile_times(1.5),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# -- strategies ------------------------------------------------------------------

# Every key the loaders know, so that generated tables reach past the unknown-key check.
KNOWN_KEYS = sorted(
    {
        # server
        "server", "listen", "control_listen", "max_body_bytes", "header_timeout_s",
        "body_timeout_s", "keepalive_timeout_s", "shutdown_grace_s", "max_connections",
        "min_body_rate",
        # router
        "router", "retries", "connect_timeout_s", "first_byte_timeout_s",
        "eject_after_failures", "eject_cooldown_s", "health_interval_s", "health_timeout_s",
        "session_header",
        # auth, catalog
        "auth", "api_keys", "models", "name", "endpoints", "replicas", "profile", "engine",
        "model", "tensor_parallel", "pipeline_parallel", "gpu_memory_gib", "gpu_model",
        "node_selector", "args", "env",
        # control
        "control", "unreachable_after_s", "lost_after_s", "mass_loss_share",
        "mass_loss_window_s", "fabric_key", "spread", "restart_backoff_s",
        "restart_backoff_max_s", "crash_loop_after", "drain_timeout_s", "settle_after_start_s",
        "reconcile_interval_s", "engine_port_min", "engine_port_max",
        # agent
        "state_dir", "advertise_host", "bind_host", "labels", "fabric", "inventory_file",
        "engines", "vllm", "sglang", "llamacpp", "mock", "command", "ports", "min", "max",
        "reconnect", "base_s", "cap_s", "stop_grace_s",
        # mTLS and admin (issue 5)
        "agents", "insecure", "tls", "ca", "cert", "key", "deny_serials", "admin", "token",
        "open_status",
        # keys added since (workers, access log, metrics and router tokens, cache-aware
        # routing, per-key [[auth.keys]])
        "workers", "access_log", "access_log_format", "access_log_file", "metrics_token_digest",
        "metrics_token_env", "token_digest", "token_env", "router_token_digest",
        "router_token_env", "balancing", "cache_aware", "read_idle_timeout_s",
        "upstream_idle_s", "metrics_interval_s", "metrics_max_age_s", "block_bytes",
        "max_share", "shared_prefix_ratio", "keys", "digest", "start_timeout_s", "control_hosts",
        # static endpoints with an engine key
        "url", "key_env", "key_file",
        # simulated inventory
        "cpus", "memory_mib", "gpus", "index", "uuid", "memory_total_mib", "memory_free_mib",
        # a profile's context and LoRA adapters
        "max_model_len", "lora", "path", "max_lora_rank",
        # holding requests for models at zero, and their bodies' byte budgets
        "hold_timeout_s", "hold_max_per_model", "hold_max_bytes_per_model", "hold_max_bytes",
        "extra_paths",
    }
)  # fmt: skip

TRICKY_TEXT = [
    "", " ", "\n", "x", "m", "127.0.0.1:0", "127.0.0.1:99999", ":80", "[::1]:80", "[]:80",
    "host:", "host:²", "host:١٢", "http://127.0.0.1:8000", "http://[::1]:8000",
    "http://[::1", "http://h:port", "http://h:99999", "http://h:1/v1", "http://u@h:1",
    "ftp://h", "ws://127.0.0.1:8081/v1/agent", "wss://h/v1/agent", "ws://[", "ws://[::1",
    "ws://", "ws://h:abc", "sha256:" + "0" * 64, "sha256:" + "0" * 64 + "\n", "vllm", "mock",
    "H100", "CUDA_VISIBLE_DEVICES", "1bad-env", "\x00", "é", "🙂",
]  # fmt: skip

keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=8))
texts = st.one_of(st.sampled_from(TRICKY_TEXT), st.text(max_size=20))
scalars = st.one_of(
    texts,
    st.booleans(),
    st.integers(),
    st.sampled_from([0, 1, -1, 1023, 1024, 65535, 65536, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.datetimes(),
    st.dates(),
    st.times(),
)
toml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(keys, inner, max_size=5),
    ),
    max_leaves=25,
)
toml_tables = st.dictionaries(keys, toml_values, max_size=6)

VALID_SERVER: dict[str, Any] = {
    "server": {"listen": "127.0.0.1:0", "control_listen": "127.0.0.1:0"},
    "router": {"retries": 1},
    "auth": {"api_keys": ["sha256:" + "a" * 64]},
    "control": {"unreachable_after_s": 2.0, "lost_after_s": 10.0},
    "models": [
        {"name": "a", "endpoints": ["http://127.0.0.1:8000"]},
        {
            "name": "b",
            "replicas": 2,
            "profile": {
                "engine": "vllm",
                "model": "org/b",
                "tensor_parallel": 2,
                "gpu_model": "H100",
                "node_selector": {"pool": "prod"},
                "args": ["--x"],
                "env": {"A": "1"},
                "max_lora_rank": 8,
                "lora": [{"name": "b-sql", "path": "/lora/sql"}],
            },
        },
    ],
}

VALID_AGENT: dict[str, Any] = {
    "name": "n1",
    "server": "ws://127.0.0.1:8081/v1/agent",
    "state_dir": "/tmp/x",
    "labels": {"pool": "prod"},
    "fabric": {"ib_domain": "a"},
    # Absolute: the agent's config checks that the file is there, whatever the working directory.
    "inventory_file": str(Path(__file__).parent.parent / "conf" / "sim" / "node-2xl4.toml"),
    "engines": {"mock": {"command": ["python3"], "env": {"A": "1"}}},
    "ports": {"min": 20000, "max": 20999},
    "reconnect": {"base_s": 0.5, "cap_s": 30.0},
    "stop_grace_s": 1.0,
}


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _first_valid(parse: Any, *candidates: dict[str, Any]) -> dict[str, Any]:
    """The first candidate the loader takes: with the agent stream's plaintext switched on
    explicitly where the loader asks for mTLS, without it where it knows no such key."""
    for candidate in candidates:
        try:
            parse(_copy(candidate), "<base>")
        except ConfigError:
            continue
        return candidate
    return candidates[0]


VALID_SERVER = _first_valid(
    parse_config, {**VALID_SERVER, "agents": {"insecure": True}}, VALID_SERVER
)
VALID_AGENT = _first_valid(parse_agent_config, {**VALID_AGENT, "insecure": True}, VALID_AGENT)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a nested dict/list value, the root excluded."""
    out: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        out.append((*prefix, key))
        if isinstance(child, dict | list):
            out += _paths(child, (*prefix, key))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """A valid config with a few values replaced, removed or added: bad input that gets deep."""
    data: dict[str, Any] = _copy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(toml_values)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(keys)] = draw(toml_values)
        else:
            parent.append(draw(toml_values))
    return data


def _only_config_error(parse: Callable[[Any, str], object], data: Any) -> object | None:
    """Anything but a ConfigError naming the file propagates and fails the test."""
    try:
        return parse(data, "<fuzz>")
    except ConfigError as exc:
        assert str(exc).startswith("<fuzz>")
        return None


# -- the server's config ----------------------------------------------------------


def test_the_valid_bases_load() -> None:
    config = parse_config(_copy(VALID_SERVER), "<base>")
    assert [m.name for m in config.catalog.models] == ["a", "b"]
    assert config.catalog.adapters == {"b-sql": "b"}
    assert parse_agent_config(_copy(VALID_AGENT), "<base>").name == "n1"


@FUZZ
@given(toml_tables)
@example({"models": [{"name": "m", "endpoints": ["http://[::1"]}]})
@example({"server": {"listen": "h:²"}, "models": [{"name": "m", "endpoints": ["http://h:1"]}]})
@example({"models": [1, {"name": "m"}]})
@example({"models": {"name": "m"}})
@example({"control": {"lost_after_s": dt.datetime(2020, 1, 1)}})
def test_arbitrary_server_tables_load_or_raise_config_error(data: dict[str, Any]) -> None:
    _only_config_error(parse_config, data)


@FUZZ
@given(mutated(VALID_SERVER))
def test_mutated_server_configs_load_or_raise_config_error(data: dict[str, Any]) -> None:
    _only_config_error(parse_config, data)


@FUZZ
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode("latin-1"))))
@example("[server]\nlisten = 1\n")
@example("[[models]]\nname = 'm'\nendpoints = ['http://h:1']\n[models.profile]\n")
@example("a = 1\na = 2\n")
def test_arbitrary_text_files_load_or_raise_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path)
    except ConfigError as exc:
        assert str(exc).startswith(str(path))


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_files_load_or_raise_config_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    try:
        load_config(path)
    except ConfigError:
        pass


def test_missing_unreadable_and_directory_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)
    (tmp_path / "latin1.toml").write_bytes(b"name = '\xe9'\n")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "latin1.toml")


@pytest.mark.parametrize(
    "section, key",
    [("server", "header_timeout_s"), ("router", "connect_timeout_s"), ("control", "lost_after_s")],
)
def test_nan_numbers_are_config_errors(section: str, key: str) -> None:
    data = _copy(VALID_SERVER)
    data[section][key] = math.nan
    with pytest.raises(ConfigError, match=key):
        parse_config(data, "<nan>")


# -- the agent's config and simulated inventories ---------------------------------


@FUZZ
@given(toml_tables)
@example({"name": "n", "server": "ws://h/v1/agent", "engines": {"vllm": 1}})
@example({"name": "n", "server": "ws://h/v1/agent", "engines": {"bogus": {}}})
@example({"name": "n", "server": "ws://h/v1/agent", "ports": {"min": 30000, "max": 20000}})
@example({"name": "n", "server": "ws://["})  # urlsplit's ValueError, once let through
@example({"name": "n", "server": "wss://[::1/v1/agent"})
@example({"name": "n", "server": "wss://h:99999/v1/agent"})
def test_arbitrary_agent_tables_load_or_raise_config_error(data: dict[str, Any]) -> None:
    _only_config_error(parse_agent_config, data)


@FUZZ
@given(mutated(VALID_AGENT))
def test_mutated_agent_configs_load_or_raise_config_error(data: dict[str, Any]) -> None:
    _only_config_error(parse_agent_config, data)


def test_agent_server_url_with_a_broken_ipv6_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="server"):
        parse_agent_config({"name": "n", "server": "ws://["}, "<agent>")


@FUZZ
@given(st.dictionaries(keys, toml_values, max_size=4) | mutated({"cpus": 8, "gpus": [
    {"index": 0, "name": "NVIDIA L4", "memory_total_mib": 23034, "memory_free_mib": 22500},
    {"index": 1, "name": "NVIDIA L4", "memory_total_mib": 23034},
]}))  # fmt: skip
def test_arbitrary_simulated_inventories_load_or_raise_config_error(
    tmp_path: Path, data: dict[str, Any]
) -> None:
    import tomli_w

    path = tmp_path / "inv.toml"
    try:
        path.write_text(tomli_w.dumps(data))
    except (TypeError, ValueError):  # not writable as TOML (a nested mixed array, say)
        return
    try:
        read_simulated(path)
    except ConfigError:
        pass


# -- the command lines ----------------------------------------------------------

BAD_SERVER_FILES: dict[str, str | bytes] = {
    "not-toml": "[server\nlisten = ",
    "binary": b"\xff\xfe\x00garbage\x00",
    "unknown-key": "[[models]]\nname = 'm'\nendpionts = ['http://h:1']\n",
    "wrong-type": "[server]\nlisten = 8080\n[[models]]\nname = 'm'\nendpoints = ['http://h:1']\n",
    "no-models": "[server]\nlisten = '127.0.0.1:0'\n",
    "bad-url": "[[models]]\nname = 'm'\nendpoints = ['http://[::1']\n",
    "models-not-a-table": "models = 3\n",
}

BAD_AGENT_FILES: dict[str, str | bytes] = {
    "not-toml": "name = \n",
    "binary": b"\x80\x81\x82",
    "no-server": "name = 'n'\n",
    "bad-scheme": "name = 'n'\nserver = 'http://h/v1/agent'\n",
    "unknown-engine": "name = 'n'\nserver = 'ws://h/v1/agent'\ninsecure = true\n[engines.bogus]\ncommand = ['x']\n",
    "bad-inventory": "name = 'n'\nserver = 'ws://h/v1/agent'\ninsecure = true\nadvertise_host = 'n.example'\ninventory_file = 'MISSING.toml'\n",
}


def _run_cli(module: str, tmp_path: Path, name: str, content: str | bytes) -> None:
    path = tmp_path / f"{name}.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    if name == "bad-inventory":
        (tmp_path / "inv.toml").write_text("[[gpus]]\nindex = 'zero'\n")
        path.write_text(str(content).replace("MISSING.toml", str(tmp_path / "inv.toml")))
    done = subprocess.run(
        [sys.executable, "-m", module, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert "config error" in done.stderr, done.stderr


@pytest.mark.parametrize("name", sorted(BAD_SERVER_FILES))
def test_server_cli_exits_2_without_a_traceback(tmp_path: Path, name: str) -> None:
    _run_cli("llmgw_server", tmp_path, name, BAD_SERVER_FILES[name])


@pytest.mark.parametrize("name", sorted(BAD_AGENT_FILES))
def test_agent_cli_exits_2_without_a_traceback(tmp_path: Path, name: str) -> None:
    _run_cli("llmgw_agent", tmp_path, name, BAD_AGENT_FILES[name])


def test_agent_cli_broken_ipv6_server_url_exits_2(tmp_path: Path) -> None:
    _run_cli("llmgw_agent", tmp_path, "ipv6", "name = 'n'\nserver = 'ws://['\n")
