"""Config sections declared once (issue 13, item 6): each section's attrs class is what the
file is read into, its fields' rules are what is checked, and every error names file, key
path and what is wrong, with a "did you mean" for a misspelt key."""

from __future__ import annotations

import os
import re
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import profile_times
from llmgw_agent.config import AgentConfig, parse_agent_config
from llmgw_core.catalog import Profile
from llmgw_core.config import (
    AdminSection,
    AuthSection,
    CacheAwareSection,
    RouterSection,
    ServerSection,
    digest_of,
    parse_config,
)
from llmgw_core.config_schema import Rules, structure
from llmgw_core.control_config import ControlSection
from llmgw_core.tomlshape import ConfigError
from test_fuzz_config import KNOWN_KEYS, TRICKY_TEXT, VALID_AGENT, VALID_SERVER, _copy

SECTIONS: list[type] = [
    ServerSection,
    RouterSection,
    CacheAwareSection,
    ControlSection,
    AdminSection,
    AuthSection,
    Profile,
    AgentConfig,
]


def _rules(cls: type) -> list[tuple[str, Rules]]:
    """(file key, rules) of every field the file may set."""
    found = []
    for field in attrs.fields(cls):
        spec = field.metadata.get("llmgw_config", Rules())
        if field.init and spec.in_file:
            found.append((spec.key or field.name, spec))
    return found


def _nested(key: str, value: object) -> dict[str, Any]:
    """{"ports": {"min": value}} for the file key "ports.min"."""
    head, dot, tail = key.partition(".")
    return {head: {tail: value}} if dot else {key: value}


def _required(cls: type) -> dict[str, Any]:
    """Values for the keys `cls` requires."""
    if cls is Profile:
        return {"engine": "mock", "model": "m"}
    if cls is AgentConfig:
        return {"name": "n", "server": "ws://127.0.0.1:1/v1/agent", "insecure": True}
    return {}


def _error(data: object, cls: type, **kw: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        structure(data, cls, file="f.toml", path="s", **kw)
    return str(caught.value)


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_declared_bound_is_checked_at_its_key_path(cls: type) -> None:
    base = _required(cls)
    checked = 0
    for key, spec in _rules(cls):
        for bound, bad, word in [(spec.min, -1, "least"), (spec.max, +1, "most")]:
            if bound is None:
                continue
            value = bound + bad
            message = _error({**base, **_nested(key, value)}, cls)
            assert message == f"f.toml: s.{key}: must be at {word} {bound}, not {value}"
            checked += 1
    assert checked or cls in (AdminSection, AuthSection)


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_misspelt_key_is_named_with_the_key_meant(cls: type) -> None:
    base = _required(cls)
    for key, _ in _rules(cls):
        typo = key[:-1] + key[-1].upper()  # a one-letter slip that is no other key
        message = _error({**base, **_nested(typo, 1)}, cls)
        assert message.startswith(f"f.toml: s.{typo}: is not a known key"), message
        assert message.endswith(f"(did you mean {key.rpartition('.')[2]!r}?)"), message


@pytest.mark.parametrize(
    "cls", [ServerSection, RouterSection, CacheAwareSection, ControlSection, AdminSection]
)
def test_an_empty_table_is_the_declared_defaults(cls: type) -> None:
    assert structure({}, cls, file="f.toml") == cls()


def test_a_missing_key_points_at_its_misspelling() -> None:
    data = _copy(VALID_SERVER)
    profile = data["models"][1]["profile"]
    profile["modle"] = profile.pop("model")
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "s.toml")
    assert str(caught.value) == (
        "s.toml: models[1].profile.model: is required (is 'modle' a misspelling of it?)"
    )


def test_workers_is_a_number_or_auto() -> None:
    def workers(value: object) -> int:
        return structure({"workers": value}, ServerSection, file="f.toml").workers

    assert workers(3) == 3
    assert workers("auto") == len(os.sched_getaffinity(0))
    assert _error({"workers": "all"}, ServerSection) == (
        'f.toml: s.workers: must be a number of processes (1 or more) or "auto"'
    )
    assert _error({"workers": 0}, ServerSection) == "f.toml: s.workers: must be at least 1, not 0"
    assert _error({"workers": True}, ServerSection) == (
        "f.toml: s.workers: must be an integer, not a boolean"
    )


def test_secrets_from_the_environment_are_hashed_when_read() -> None:
    environ = {"ROUTER_TOKEN": " r-secret ", "SCRAPE": "m-secret"}
    config = parse_config(
        {
            **_copy(VALID_SERVER),
            "server": {"metrics_token_env": "SCRAPE"},
            "admin": {"router_token_env": "ROUTER_TOKEN", "token_digest": "sha256:" + "b" * 64},
        },
        "s.toml",
        environ=environ,
    )
    assert config.admin.router_token_digest == digest_of("r-secret")
    assert config.admin.token_digest == "b" * 64
    assert config.server.metrics_token_digest == digest_of("m-secret")
    assert "secret" not in repr(config)
    both = {"router_token_env": "ROUTER_TOKEN", "router_token_digest": "sha256:" + "b" * 64}
    assert _error(both, AdminSection, environ=environ) == (
        "f.toml: s.router_token_env: give router_token_digest or router_token_env, not both"
    )
    assert _error({"router_token_env": "NONE"}, AdminSection, environ=environ) == (
        "f.toml: s.router_token_env: the environment variable NONE is not set"
    )


def test_the_agents_port_and_reconnect_tables() -> None:
    agent = {"name": "n", "server": "ws://127.0.0.1:1/v1/agent", "insecure": True}
    config = parse_agent_config({**agent, "ports": {"min": 30000, "max": 30100}}, "a.toml")
    assert (config.port_min, config.port_max, config.file) == (30000, 30100, "a.toml")

    def error(**values: object) -> str:
        with pytest.raises(ConfigError) as caught:
            parse_agent_config({**agent, **values}, "a.toml")
        return str(caught.value)

    assert error(ports={"mn": 1}) == "a.toml: ports.mn: is not a known key (did you mean 'min'?)"
    assert error(ports=3) == "a.toml: ports: must be a table, not an integer"
    assert error(ports={"min": 30000, "max": 20000}) == (
        "a.toml: ports.max: must be at least 30000, not 20000"
    )
    assert error(reconnect={"base_s": 2, "cap_s": 1}) == (
        "a.toml: reconnect.cap_s: must be at least 2.0, not 1.0"
    )
    assert error(engines={"vllm": {"comand": ["v"]}}) == (
        "a.toml: engines.vllm.comand: is not a known key (did you mean 'command'?)"
    )


# -- every error's key path points into the file --------------------------------------

_KEYS = st.sampled_from(KNOWN_KEYS)
_VALUES = st.recursive(
    st.one_of(st.sampled_from(TRICKY_TEXT), st.booleans(), st.integers(-3, 70000), st.floats()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=10,
)


@st.composite
def _mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = _copy(base)
    for _ in range(draw(st.integers(1, 3))):
        parent: Any = data
        while isinstance(parent, dict | list) and parent and draw(st.booleans()):
            keys = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
            child = parent[draw(st.sampled_from(keys))]
            if not isinstance(child, dict | list):
                break
            parent = child
        if isinstance(parent, dict):
            action = draw(st.sampled_from(["set", "delete"]))
            if action == "delete" and parent:
                del parent[draw(st.sampled_from(list(parent)))]
            else:
                parent[draw(_KEYS)] = draw(_VALUES)
        elif isinstance(parent, list):
            parent.append(draw(_VALUES))
    return data


def _assert_points_into(data: Any, message: str, file: str) -> None:
    assert message.startswith(f"{file}: ")
    path, _, what = message.removeprefix(f"{file}: ").partition(": ")
    steps = re.findall(r"\[(\d+)\]|([^.\[\]]+)", path)
    node = data
    for index, key in steps:
        if index:
            assert isinstance(node, list) and int(index) < len(node), message
            node = node[int(index)]
        elif what.startswith(("is required", "no model is declared")) and key not in node:
            return  # a missing key, in a table that may itself be missing
        else:
            assert isinstance(node, dict) and key in node, message
            node = node[key]


FUZZ = settings(max_examples=profile_times(3), deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(_mutated(VALID_SERVER))
def test_a_server_config_error_names_a_key_path_in_the_file(data: dict[str, Any]) -> None:
    try:
        parse_config(_copy(data), "s.toml", environ={})
    except ConfigError as exc:
        _assert_points_into(data, str(exc), "s.toml")


@FUZZ
@given(_mutated(VALID_AGENT))
def test_an_agent_config_error_names_a_key_path_in_the_file(data: dict[str, Any]) -> None:
    try:
        parse_agent_config(_copy(data), "a.toml")
    except ConfigError as exc:
        _assert_points_into(data, str(exc), "a.toml")
