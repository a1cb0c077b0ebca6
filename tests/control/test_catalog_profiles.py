"""Profiles in the catalog and the [control] section: shapes, defaults, errors with key paths."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from llmgw_core.catalog import Endpoint, read_catalog
from llmgw_core.control_config import ControlSection, read_control
from llmgw_core.tomlshape import ConfigError, Table

ISSUE_EXAMPLE = """
[[models]]
name = "qwen2.5-72b"
replicas = 2
[models.profile]
engine = "vllm"                  # vllm | sglang | llamacpp | mock
model = "Qwen/Qwen2.5-72B-Instruct"
tensor_parallel = 4
pipeline_parallel = 1
gpu_memory_gib = 70              # free memory each GPU must have
gpu_model = "H100"               # optional substring match on the GPU name
node_selector = { pool = "prod" }   # optional label match
args = ["--max-model-len", "32768"]
"""


def catalog_of(text: str) -> Any:
    return read_catalog(Table(tomllib.loads(text), "llmgw.toml"))


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        catalog_of(text)
    return str(info.value)


def test_the_issue_example_reads_as_written() -> None:
    (entry,) = catalog_of(ISSUE_EXAMPLE).models
    assert entry.name == "qwen2.5-72b"
    assert entry.replicas == 2
    assert entry.endpoints == ()
    p = entry.profile
    assert p is not None
    assert (p.engine, p.model) == ("vllm", "Qwen/Qwen2.5-72B-Instruct")
    assert (p.tensor_parallel, p.pipeline_parallel, p.gpus) == (4, 1, 4)
    assert p.gpu_memory_gib == 70.0
    assert p.gpu_model == "H100"
    assert p.node_selector == {"pool": "prod"}
    assert p.args == ("--max-model-len", "32768")
    assert p.env == {}


def test_profile_defaults_and_env() -> None:
    (entry,) = catalog_of(
        """
        [[models]]
        name = "tiny"
        [models.profile]
        engine = "mock"
        model = "org/tiny"
        env = { HF_HOME = "/models", VLLM_LOGGING_LEVEL = "DEBUG" }
        """
    ).models
    assert entry.replicas == 1
    p = entry.profile
    assert p is not None
    assert (p.tensor_parallel, p.pipeline_parallel, p.gpu_memory_gib) == (1, 1, 0.0)
    assert p.gpu_model is None and p.node_selector == {} and p.args == ()
    assert p.env == {"HF_HOME": "/models", "VLLM_LOGGING_LEVEL": "DEBUG"}


def test_static_and_profiled_models_live_side_by_side() -> None:
    cat = catalog_of(
        ISSUE_EXAMPLE
        + """
        [[models]]
        name = "static"
        endpoints = ["http://10.0.0.9:8000"]
        """
    )
    static = cat.get("static")
    assert static is not None
    assert static.endpoints == (Endpoint("10.0.0.9", 8000),)
    assert static.profile is None and static.replicas == 0
    assert [m.name for m in cat.profiled] == ["qwen2.5-72b"]


def test_replicas_may_be_zero() -> None:
    (entry,) = catalog_of(ISSUE_EXAMPLE.replace("replicas = 2", "replicas = 0")).models
    assert entry.replicas == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            ISSUE_EXAMPLE.replace('name = "qwen2.5-72b"', 'name = "q"\nendpoints = ["http://a:1"]'),
            "llmgw.toml: models[0].profile: cannot be combined with endpoints",
        ),
        (
            '[[models]]\nname = "q"\n',
            "llmgw.toml: models[0]: model 'q' needs either endpoints (the URLs of engines you run) "
            "or a [models.profile]",
        ),
        (
            '[[models]]\nname = "q"\nendpoints = []\n',
            "llmgw.toml: models[0].endpoints: must list at least one engine URL",
        ),
        (
            '[[models]]\nname = "q"\nreplicas = 2\nendpoints = ["http://a:1"]\n',
            "llmgw.toml: models[0].replicas: only applies to a model with a profile",
        ),
        (
            ISSUE_EXAMPLE.replace("replicas = 2", "replicas = -1"),
            "llmgw.toml: models[0].replicas: must be at least 0, not -1",
        ),
        (
            ISSUE_EXAMPLE.replace('engine = "vllm"', 'engine = "tgi"'),
            "llmgw.toml: models[0].profile.engine: must be one of vllm, sglang, llamacpp, mock, "
            "not 'tgi'",
        ),
        (
            ISSUE_EXAMPLE.replace('model = "Qwen/Qwen2.5-72B-Instruct"', ""),
            "llmgw.toml: models[0].profile.model: is required",
        ),
        (
            ISSUE_EXAMPLE.replace("tensor_parallel = 4", "tensor_parallel = 0"),
            "llmgw.toml: models[0].profile.tensor_parallel: must be at least 1, not 0",
        ),
        (
            ISSUE_EXAMPLE.replace("pipeline_parallel = 1", 'pipeline_parallel = "2"'),
            "llmgw.toml: models[0].profile.pipeline_parallel: must be an integer, not a string",
        ),
        (
            ISSUE_EXAMPLE.replace("gpu_memory_gib = 70", "gpu_memory_gib = -1"),
            "llmgw.toml: models[0].profile.gpu_memory_gib: must be at least 0, not -1",
        ),
        (
            ISSUE_EXAMPLE.replace('gpu_model = "H100"', 'gpu_model = " "'),
            "llmgw.toml: models[0].profile.gpu_model: must not be empty",
        ),
        (
            ISSUE_EXAMPLE.replace('{ pool = "prod" }', "{ pool = 1 }"),
            "llmgw.toml: models[0].profile.node_selector.pool: must be a string, not an integer",
        ),
        (
            ISSUE_EXAMPLE.replace('"32768"]', "32768]"),
            "llmgw.toml: models[0].profile.args[1]: must be a string, not an integer",
        ),
        (
            ISSUE_EXAMPLE + 'env = { "1X" = "a" }\n',
            "llmgw.toml: models[0].profile.env.1X: is not a valid environment variable name",
        ),
        (
            ISSUE_EXAMPLE + 'env = { CUDA_VISIBLE_DEVICES = "0" }\n',
            "llmgw.toml: models[0].profile.env.CUDA_VISIBLE_DEVICES: is set by the agent",
        ),
        (
            ISSUE_EXAMPLE.replace("tensor_parallel = 4", "tensor_paralel = 4"),
            "llmgw.toml: models[0].profile.tensor_paralel: is not a known key "
            "(did you mean 'tensor_parallel'?)",
        ),
        (
            ISSUE_EXAMPLE.replace("replicas = 2", "replica = 2"),
            "llmgw.toml: models[0].replica: is not a known key (did you mean 'replicas'?)",
        ),
        (
            '[[models]]\nname = "q"\nprofile = "vllm"\n',
            "llmgw.toml: models[0].profile: must be a table, not a string",
        ),
    ],
)
def test_profile_errors_name_the_key_path(text: str, message: str) -> None:
    assert error_of(text).startswith(message)


BARE = '[[models]]\nname = "q"\n[models.profile]\nengine = "vllm"\nmodel = "org/q"\n'


def test_max_model_len_is_read_and_defaults_to_the_engines_own() -> None:
    (entry,) = catalog_of(BARE + "max_model_len = 2048\n").models
    assert entry.profile is not None and entry.profile.max_model_len == 2048
    (entry,) = catalog_of(BARE).models
    assert entry.profile is not None and entry.profile.max_model_len is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("max_model_len = 0", "profile.max_model_len: must be at least 1, not 0"),
        ("max_model_len = -4096", "profile.max_model_len: must be at least 1, not -4096"),
        ('max_model_len = "32k"', "profile.max_model_len: must be an integer, not a string"),
        ("max_model_len = 2048.0", "profile.max_model_len: must be an integer, not a number"),
        ("max_model_len = true", "profile.max_model_len: must be an integer, not a boolean"),
    ],
)
def test_max_model_len_must_be_a_positive_integer(line: str, message: str) -> None:
    assert error_of(BARE + line + "\n") == f"llmgw.toml: models[0].{message}"


@pytest.mark.parametrize(
    ("engine", "arg", "flag"),
    [
        ("vllm", "--max-model-len", "--max-model-len"),
        ("vllm", "--max_model_len", "--max-model-len"),
        ("vllm", "--max-model-len=8192", "--max-model-len"),
        ("mock", "--max-model-len", "--max-model-len"),
        ("llamacpp", "-c", "-c"),
        ("llamacpp", "--ctx-size", "-c"),
        ("sglang", "--context-length", "--context-length"),
    ],
)
def test_args_that_set_the_context_again_are_refused(engine: str, arg: str, flag: str) -> None:
    text = BARE.replace('"vllm"', f'"{engine}"') + f'max_model_len = 2048\nargs = ["{arg}", "8192"]\n'
    assert error_of(text) == (
        f"llmgw.toml: models[0].profile.args: {arg} sets the context length that "
        f"max_model_len already sets ({flag} 2048): give it once, as max_model_len"
    )


def test_a_context_flag_in_args_alone_is_still_taken() -> None:
    """Without max_model_len, args keep saying it as before; another engine's spelling is
    not this engine's flag."""
    (entry,) = catalog_of(BARE + 'args = ["--max-model-len", "8192"]\n').models
    assert entry.profile is not None and entry.profile.args == ("--max-model-len", "8192")
    (entry,) = catalog_of(BARE + 'max_model_len = 2048\nargs = ["-c", "8192"]\n').models
    assert entry.profile is not None and entry.profile.max_model_len == 2048


@pytest.mark.parametrize(
    ("typo", "suggestion"), [("endpionts", "endpoints"), ("profil", "profile")]
)
def test_a_misspelt_endpoints_or_profile_is_reported_as_a_typo(typo: str, suggestion: str) -> None:
    text = f'[[models]]\nname = "q"\n{typo} = ["http://a:1"]\n'
    assert error_of(text).startswith(
        f"llmgw.toml: models[0].{typo}: is not a known key (did you mean {suggestion!r}?)"
    )


def test_a_profiled_model_name_clash_is_reported() -> None:
    text = ISSUE_EXAMPLE + '\n[[models]]\nname = "qwen2.5-72b"\nendpoints = ["http://a:1"]\n'
    assert error_of(text).startswith(
        "llmgw.toml: models[1].name: duplicates the model name 'qwen2.5-72b' of models[0]"
    )


# -- [control] --------------------------------------------------------------------


def control_of(text: str) -> ControlSection:
    data = tomllib.loads(text)
    return read_control(Table(data, "llmgw.toml").table("control"))


def test_control_defaults() -> None:
    c = control_of("")
    assert c == ControlSection()
    assert (c.unreachable_after_s, c.lost_after_s) == (15.0, 120.0)
    assert (c.mass_loss_share, c.fabric_key, c.spread) == (0.5, "ib_domain", False)
    assert (c.restart_backoff_s, c.restart_backoff_max_s) == (10.0, 300.0)


def test_control_reads_every_tunable() -> None:
    c = control_of(
        """
        [control]
        unreachable_after_s = 5
        lost_after_s = 30
        mass_loss_share = 0.75
        mass_loss_window_s = 20
        fabric_key = "nvlink_domain"
        spread = true
        restart_backoff_s = 1
        restart_backoff_max_s = 8
        crash_loop_after = 5
        drain_timeout_s = 10
        settle_after_start_s = 3
        reconcile_interval_s = 0.5
        engine_port_min = 30000
        engine_port_max = 30999
        """
    )
    assert c == ControlSection(
        unreachable_after_s=5,
        lost_after_s=30,
        mass_loss_share=0.75,
        mass_loss_window_s=20,
        fabric_key="nvlink_domain",
        spread=True,
        restart_backoff_s=1,
        restart_backoff_max_s=8,
        crash_loop_after=5,
        drain_timeout_s=10,
        settle_after_start_s=3,
        reconcile_interval_s=0.5,
        engine_port_min=30000,
        engine_port_max=30999,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "lost_after_s = 10",
            "control.lost_after_s: must be longer than unreachable_after_s (15), not 10",
        ),
        ("mass_loss_share = 0", "control.mass_loss_share: must be above 0 and at most 1"),
        ("mass_loss_share = 1.5", "control.mass_loss_share: must be above 0 and at most 1"),
        (
            "restart_backoff_max_s = 5",
            "control.restart_backoff_max_s: must be at least restart_backoff_s (10), not 5",
        ),
        ("engine_port_max = 70000", "control.engine_port_max: must be at most 65535"),
        ("engine_port_max = 20010", "control.engine_port_max: leaves too few ports"),
        ("spread = 1", "control.spread: must be true or false, not an integer"),
        ("fabric = 'x'", "control.fabric: is not a known key"),
    ],
)
def test_control_errors_name_the_key_path(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        control_of("[control]\n" + text)
    assert str(info.value).startswith(f"llmgw.toml: {message}")


# -- LoRA adapters ----------------------------------------------------------------------

LORA = BARE + 'max_lora_rank = 8\n[[models.profile.lora]]\nname = "q-sql"\npath = "/data/lora/sql"\n'


def lora(name: str, path: str = "/data/lora/x") -> str:
    return f'[[models.profile.lora]]\nname = "{name}"\npath = "{path}"\n'


def test_lora_adapters_are_read_with_their_rank_and_named_by_the_catalog() -> None:
    catalog = catalog_of(LORA + lora("q-chat", "org/q-chat-lora") + '\n[[models]]\nname = "r"\nendpoints = ["http://a:1"]\n')
    profile = catalog.models[0].profile
    assert profile is not None and profile.max_lora_rank == 8
    assert [(a.name, a.path) for a in profile.lora] == [("q-sql", "/data/lora/sql"), ("q-chat", "org/q-chat-lora")]
    assert catalog.adapters == {"q-sql": "q", "q-chat": "q"}
    (entry,) = catalog_of(BARE).models
    assert entry.profile is not None and (entry.profile.lora, entry.profile.max_lora_rank) == ((), None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # An adapter's name is no model's, its own model's included...
        (BARE + lora("q"), "models[0].profile.lora[0].name: 'q' is already the name of the model models[0]"),
        (LORA + '[[models]]\nname = "q-sql"\nendpoints = ["http://a:1"]\n',
         "models[0].profile.lora[0].name: 'q-sql' is already the name of the model models[1]"),
        # ... and no other adapter's, of the same profile or another model's.
        (LORA + lora("q-sql"), "models[0].profile.lora[1].name: 'q-sql' is already the name of the adapter models[0].profile.lora[0]"),
        (LORA + BARE.replace('"q"', '"r"') + lora("q-sql"),
         "models[1].profile.lora[0].name: 'q-sql' is already the name of the adapter models[0].profile.lora[0]"),
    ],
)  # fmt: skip
def test_an_adapter_name_that_collides_is_refused_where_it_is_given(text: str, message: str) -> None:
    assert error_of(text).startswith(f"llmgw.toml: {message}: clients call an adapter by its name")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BARE + lora("q sql"), "lora[0].name: 'q sql' is not a valid model name (letters, digits, ._:/@+-)"),
        (BARE + lora("-q"), "lora[0].name: '-q' is not a valid model name (letters, digits, ._:/@+-)"),
        (BARE + lora(""), "lora[0].name: must not be empty"),
        (BARE + lora("s", "/a,b"), "lora[0].path: '/a,b' holds a comma, which vLLM's --lora-modules cannot take"),
        (BARE + '[[models.profile.lora]]\nname = "s"\n', "lora[0].path: is required"),
        (BARE + '[[models.profile.lora]]\nname = "s"\npath = "/a"\npaht = "/b"\n',
         "lora[0].paht: is not a known key (did you mean 'path'?)"),
        (BARE + 'lora = "s=/a"\n', "lora: must be an array of tables ([[lora]]), not a string"),
        (BARE + "".join(lora(f"s{i}") for i in range(65)), "lora: lists 65 adapters: a profile takes 64 at most"),
        (LORA.replace("max_lora_rank = 8", "max_lora_rank = 4"),
         "max_lora_rank: must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (vLLM's), not 4"),
        (BARE + "max_lora_rank = 8\n",
         "max_lora_rank: is the rank of the profile's LoRA adapters, and it declares none ([[models.profile.lora]])"),
    ],
)  # fmt: skip
def test_bad_adapters_are_refused_at_their_key_path(text: str, message: str) -> None:
    assert error_of(text) == f"llmgw.toml: models[0].profile.{message}"


def test_sixty_four_adapters_fit_one_profile() -> None:
    (entry,) = catalog_of(BARE + "".join(lora(f"s{i}") for i in range(64))).models
    assert entry.profile is not None and len(entry.profile.lora) == 64


@pytest.mark.parametrize("engine", ["llamacpp", "sglang"])
def test_engines_that_cannot_serve_an_adapter_under_its_name_are_refused_it(engine: str) -> None:
    message = error_of(LORA.replace('"vllm"', f'"{engine}"'))
    assert message.startswith(f"llmgw.toml: models[0].profile.lora: cannot be served by engine {engine!r}: ")
    assert "never" in message  # the reason: how that engine picks an adapter instead
    # The mock takes vLLM's command line, adapters included.
    assert catalog_of(LORA.replace('"vllm"', '"mock"')).adapters == {"q-sql": "q"}


@pytest.mark.parametrize(
    "arg", ["--lora-modules", "--lora_modules=x=/y", "--enable-lora", "--no-enable-lora", "--max-lora-rank"]
)
def test_args_that_say_the_adapters_or_rank_again_are_refused(arg: str) -> None:
    # (args before the array of tables: after it, they would be the adapter's keys)
    text = BARE + f'max_lora_rank = 8\nargs = ["{arg}", "1"]\n' + lora("q-sql")
    assert error_of(text) == (
        f"llmgw.toml: models[0].profile.args: {arg} says again what lora and max_lora_rank "
        "make llmgw pass the engine (a second --lora-modules would replace the adapters): "
        "give them once, there"
    )


def test_the_rank_in_args_alone_is_still_taken() -> None:
    (entry,) = catalog_of(BARE + 'args = ["--max-lora-rank", "32"]\n' + lora("q-sql")).models
    assert entry.profile is not None and entry.profile.args == ("--max-lora-rank", "32")
