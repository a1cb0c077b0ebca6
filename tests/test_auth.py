"""Router API keys: stored as digests, limited to models, read from the environment.

The config rules are checked through `parse_config`; the behaviour through a real router
process in front of real mock engines, driven by the official openai client.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw_core.config import parse_config
from llmgw_core.tomlshape import ConfigError
from procs import Proc, Procs, free_port, models_toml

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def config(auth: dict[str, Any], environ: dict[str, str] | None = None) -> Any:
    data: dict[str, object] = {
        "auth": auth,
        "models": [
            {"name": "a", "endpoints": ["http://127.0.0.1:9001"]},
            {"name": "b", "endpoints": ["http://127.0.0.1:9002"]},
        ],
    }
    return parse_config(data, "x.toml", environ=environ or {})


def config_error(auth: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        config(auth, environ)
    return str(caught.value)


def test_plain_digests_still_mean_every_model() -> None:
    keys = config({"api_keys": [sha("k1"), sha("k2")]}).auth.keys
    assert keys == {sha("k1")[7:]: None, sha("k2")[7:]: None}
    assert config({}).auth.keys == {}


def test_keys_limited_to_models_from_a_digest_or_the_environment() -> None:
    auth = config(
        {
            "api_keys": [sha("old")],
            "keys": [
                {"digest": sha("team-a"), "models": ["a"]},
                {"env": "TEAM_B_KEY", "models": ["b", "a"]},
                {"env": "ALL_KEY"},
            ],
        },
        {"TEAM_B_KEY": "sk-b\n", "ALL_KEY": "sk-all"},
    ).auth
    # White space around a key in the environment is not part of it.
    assert auth.keys == {
        sha("old")[7:]: None,
        sha("team-a")[7:]: frozenset({"a"}),
        sha("sk-b")[7:]: frozenset({"a", "b"}),
        sha("sk-all")[7:]: None,
    }
    # Only digests are kept, never the raw key.
    assert "sk-b" not in repr(auth)


def test_a_key_may_be_limited_to_a_lora_adapter_which_clients_call_as_a_model() -> None:
    profile = {"engine": "vllm", "model": "org/c", "lora": [{"name": "c-sql", "path": "/l/sql"}]}
    data: dict[str, object] = {
        "auth": {"keys": [{"digest": sha("k"), "models": ["c-sql"]}]},
        "models": [{"name": "c", "profile": profile}],
        "agents": {"insecure": True},
    }
    assert parse_config(data, "x.toml", environ={}).auth.keys == {sha("k")[7:]: frozenset({"c-sql"})}
    data["auth"] = {"keys": [{"digest": sha("k"), "models": ["c-chat"]}]}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "x.toml", environ={})
    assert str(caught.value) == "x.toml: auth.keys[0].models[0]: 'c-chat' is not a model of this config"


@pytest.mark.parametrize(
    ("auth", "environ", "expected"),
    [
        (
            {"keys": [{"digest": sha("x")}, {"env": "NOPE", "models": ["a"]}]},
            {},
            "x.toml: auth.keys[1].env: the environment variable NOPE is not set",
        ),
        (
            {"keys": [{"env": "EMPTY"}]},
            {"EMPTY": "  "},
            "x.toml: auth.keys[0].env: the environment variable EMPTY is empty",
        ),
        (
            {"keys": [{"digest": sha("x"), "models": ["a", "c"]}]},
            {},
            "x.toml: auth.keys[0].models[1]: 'c' is not a model of this config",
        ),
        (
            {"keys": [{"digest": sha("x"), "models": []}]},
            {},
            "x.toml: auth.keys[0].models: must name at least one model",
        ),
        (
            {"keys": [{"digest": sha("x"), "model": ["a"]}]},
            {},
            "x.toml: auth.keys[0].model: is not a known key (did you mean 'models'?)",
        ),
        (
            {"keys": [{"models": ["a"]}]},
            {},
            "x.toml: auth.keys[0]: give either digest",
        ),
        (
            {"keys": [{"digest": sha("x"), "env": "K"}]},
            {"K": "k"},
            "x.toml: auth.keys[0]: give either digest",
        ),
        (
            {"keys": [{"digest": "sk-plain-key"}]},
            {},
            "x.toml: auth.keys[0].digest: must be 'sha256:' and 64 lowercase hex digits",
        ),
        (
            {"api_keys": ["sk-plain-key"]},
            {},
            "x.toml: auth.api_keys[0]: must be 'sha256:' and 64 lowercase hex digits",
        ),
        (
            {"api_keys": [sha("k")], "keys": [{"env": "K", "models": ["a"]}]},
            {"K": "k"},
            "x.toml: auth.keys[0]: is the same key as auth.api_keys[0]",
        ),
        (
            {"keys": {"digest": sha("x")}},
            {},
            "x.toml: auth.keys: must be an array of tables ([[keys]])",
        ),
        (
            {"key": [sha("x")]},
            {},
            "x.toml: auth.key: is not a known key",
        ),
    ],
)
def test_config_errors_name_the_key_path(
    auth: dict[str, Any], environ: dict[str, str], expected: str
) -> None:
    assert expected in config_error(auth, environ)


# --- a real router process ---------------------------------------------------------------


def router(procs: Procs, toml: str, env: dict[str, str]) -> Proc:
    port = free_port()
    path = procs.tmp / f"router-{port}.toml"
    path.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\n' + toml)
    proc = Proc([sys.executable, "-m", "llmgw_server", "--config", str(path)], port, env)
    procs.all.append(proc)
    proc.wait_http("/readyz")
    return proc


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_keys_limited_to_models_through_the_openai_client(procs: Procs) -> None:
    a, b = procs.mock("a"), procs.mock("b")
    toml = models_toml({"a": [a.url], "b": [b.url]}) + (
        f'[auth]\napi_keys = ["{sha("sk-all")}"]\n'
        f'[[auth.keys]]\ndigest = "{sha("sk-team-a")}"\nmodels = ["a"]\n'
        '[[auth.keys]]\nenv = "LLMGW_TEST_KEY_B"\nmodels = ["b"]\n'
    )
    proc = router(procs, toml, {"LLMGW_TEST_KEY_B": "sk-from-env"})

    every = client(proc.url, "sk-all")
    assert sorted(m.id for m in every.models.list()) == ["a", "b"]
    for model in ("a", "b"):
        assert every.chat.completions.create(model=model, messages=CHAT).choices

    team_a = client(proc.url, "sk-team-a")
    assert [m.id for m in team_a.models.list()] == ["a"]
    assert team_a.chat.completions.create(model="a", messages=CHAT).choices
    with pytest.raises(openai.PermissionDeniedError) as denied:
        team_a.chat.completions.create(model="b", messages=CHAT)
    assert denied.value.status_code == 403
    assert denied.value.code == "model_not_allowed"
    with pytest.raises(openai.PermissionDeniedError):
        team_a.embeddings.create(model="b", input=["x"])
    # A model outside the key's list is refused alike whether it exists or not.
    with pytest.raises(openai.PermissionDeniedError):
        team_a.completions.create(model="no-such-model", prompt="hi")

    from_env = client(proc.url, "sk-from-env")
    assert [m.id for m in from_env.models.list()] == ["b"]
    assert from_env.completions.create(model="b", prompt="hi", max_tokens=2).choices
    with pytest.raises(openai.PermissionDeniedError):
        from_env.chat.completions.create(model="a", messages=CHAT)

    for bad in ("sk-wrong", "LLMGW_TEST_KEY_B", sha("sk-team-a"), sha("sk-team-a")[7:]):
        with pytest.raises(openai.AuthenticationError):
            client(proc.url, bad).chat.completions.create(model="a", messages=CHAT)
        with pytest.raises(openai.AuthenticationError):
            client(proc.url, bad).models.list()

    # The OpenAI error shape, on the wire.
    response = httpx.post(
        proc.url + "/v1/chat/completions",
        json={"model": "b", "messages": CHAT},
        headers={"authorization": "Bearer sk-team-a"},
    )
    assert response.status_code == 403
    assert response.json() == {
        "error": {
            "message": "this API key may not use the model 'b'",
            "type": "permission_error",
            "code": "model_not_allowed",
        }
    }


def test_a_missing_key_variable_stops_the_server_with_the_key_path(procs: Procs) -> None:
    path = procs.tmp / "router.toml"
    path.write_text(
        models_toml({"a": ["http://127.0.0.1:9"]})
        + '[[auth.keys]]\nenv = "LLMGW_TEST_UNSET_KEY"\nmodels = ["a"]\n'
    )
    run = subprocess.run(
        [sys.executable, "-m", "llmgw_server", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"llmgw-server: config error: {path}: auth.keys[0].env: "
        "the environment variable LLMGW_TEST_UNSET_KEY is not set"
    )
    assert "Traceback" not in run.stderr
