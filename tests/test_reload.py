"""Reloading the config without a restart: what a reload applies (pure), then SIGHUP and
the admin API's reload on real servers, single-process and with workers."""

from __future__ import annotations

import hashlib
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from fleet import Fleet, wait_until
from llmgw_core.catalog import Catalog, parse_endpoint
from llmgw_core.config import Config, parse_config
from llmgw_core.tomlshape import load_toml
from llmgw_server.reload import ReloadPlan, plan_reload, reloaded_config, with_control_plane
from procs import Proc, Procs, free_port, models_toml

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello reload"}]


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def config(text: str, tmp_path: Path) -> Config:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return parse_config(load_toml(path), str(path))


PROFILED = (
    '\n[[models]]\nname = "placed"\n[models.profile]\nengine = "vllm"\nmodel = "org/placed"\n'
    "[agents]\ninsecure = true\n"
)


def test_a_plan_names_what_it_applies_and_what_waits_for_a_restart(tmp_path: Path) -> None:
    old = config(
        '[server]\nlisten = "127.0.0.1:9000"\n'
        f'[auth]\napi_keys = ["{digest("a")}", "{digest("b")}"]\n'
        f'[[auth.keys]]\ndigest = "{digest("c")}"\nmodels = ["m"]\n'
        + models_toml({"m": ["http://e1:8000"], "gone": ["http://e2:8000"]})
        + PROFILED,
        tmp_path,
    )
    new = config(
        '[server]\nlisten = "127.0.0.1:9001"\nworkers = 3\n[router]\nretries = 5\n'
        f'[auth]\napi_keys = ["{digest("a")}", "{digest("d")}"]\n'
        f'[[auth.keys]]\ndigest = "{digest("c")}"\nmodels = ["m", "new"]\n'
        + models_toml({"m": ["http://e1:8000", "http://e3:8000"], "new": ["http://e4:8000"]})
        + PROFILED.replace("org/placed", "org/other"),
        tmp_path,
    )
    plan = plan_reload(old, new)
    assert (plan.keys_added, plan.keys_removed, plan.keys_changed) == (1, 1, 1)
    e = parse_endpoint
    assert plan.models_added == {"new": (e("http://e4:8000"),)}
    assert plan.models_changed == {"m": (e("http://e1:8000"), e("http://e3:8000"))}
    assert plan.models_removed == ("gone",)
    assert plan.needs_restart == (
        "server.listen",
        "server.workers",
        "router.retries",
    )
    assert plan.profiles_changed == ("placed",)  # the control plane rolls it
    assert plan.summary() == (
        "API keys: 1 added, 1 removed, 1 changed; models added: new; models changed: m; "
        "models removed: gone; profiles changed (rolled): placed"
    )
    served = reloaded_config(old, new)
    # What serves after it: the new keys and static models, everything else as it was.
    assert served.auth == new.auth and served.server == old.server and served.router == old.router
    assert [m.name for m in served.catalog.models] == ["m", "new", "placed"]
    assert served.catalog.get("placed") == new.catalog.get("placed")
    assert plan_reload(served, served).changes is False
    assert plan_reload(served, new).needs_restart == plan.needs_restart


def test_a_change_of_replicas_alone_is_named_as_such_not_as_a_roll(tmp_path: Path) -> None:
    old = config(PROFILED, tmp_path)
    more = PROFILED.replace('name = "placed"\n', 'name = "placed"\nreplicas = 2\n')
    plan = plan_reload(old, config(more, tmp_path))
    assert plan.changes and plan.profiles_changed == ()
    assert plan.replicas_changed == {"placed": (1, 2)}
    assert plan.summary() == "replicas changed: placed 1 -> 2"
    assert plan.as_json()["models"]["replicas_changed"] == {"placed": [1, 2]}
    both = plan_reload(old, config(more.replace("org/placed", "org/other"), tmp_path))
    assert both.summary() == "profiles changed (rolled): placed; replicas changed: placed 1 -> 2"


async def test_replicas_or_autoscaling_alone_reach_the_control_plane(tmp_path: Path) -> None:
    old = config(PROFILED, tmp_path)
    more = PROFILED.replace('name = "placed"\n', 'name = "placed"\nreplicas = 2\n')
    scaled = PROFILED.replace(
        "[agents]", "[models.autoscale]\nmax = 4\ntarget_in_flight = 8\n[agents]"
    )
    bigger = scaled.replace("max = 4", "max = 6")
    for before, after, summary in (
        (PROFILED, more, "replicas changed: placed 1 -> 2"),
        (PROFILED, scaled, "autoscaling changed: placed"),
        (scaled, bigger, "autoscaling changed: placed"),
    ):
        plan = plan_reload(config(before, tmp_path), new := config(after, tmp_path))
        assert plan.summary() == summary and plan.profiles_changed == ()
        given: list[Catalog] = []

        async def applied(config: Config, plan: ReloadPlan) -> None:
            pass

        await with_control_plane(applied, lambda c: given.append(c))(new, plan)  # noqa: B023
        assert given == [new.catalog], summary
    assert plan_reload(old, config(bigger, tmp_path)).as_json()["models"]["autoscale_changed"] == [
        "placed"
    ]


def test_a_change_of_lora_adapters_rolls_the_profile_and_the_served_catalog_has_them(
    tmp_path: Path,
) -> None:
    sql = '[[models.profile.lora]]\nname = "placed-sql"\npath = "/lora/sql"\n'
    with_lora = PROFILED.replace("[agents]", sql + "[agents]")
    old = config(PROFILED, tmp_path)
    for new_text in (with_lora, with_lora.replace("/lora/sql", "/lora/sql-2")):
        new = config(new_text, tmp_path)
        plan = plan_reload(old, new)
        assert plan.profiles_changed == ("placed",) and plan.needs_restart == ()
        served = reloaded_config(old, new)
        assert served.catalog.adapters == {"placed-sql": "placed"}
        old = served
    # Removed again: rolled again, and the adapter is gone.
    plan = plan_reload(old, config(PROFILED, tmp_path))
    assert plan.profiles_changed == ("placed",)
    assert reloaded_config(old, config(PROFILED, tmp_path)).catalog.adapters == {}


def test_a_model_that_changes_between_static_and_placed_waits_for_a_restart(
    tmp_path: Path,
) -> None:
    old = config(models_toml({"m": ["http://e1:8000"]}) + PROFILED, tmp_path)
    swapped = models_toml({"placed": ["http://e1:8000"]}) + PROFILED.replace(
        '"placed"', '"m"'
    ).replace("org/placed", "org/m")
    new = config(swapped, tmp_path)
    plan = plan_reload(old, new)
    assert not plan.changes
    assert set(plan.needs_restart) == {"models.m (profile)", "models.placed (profile)"}
    assert reloaded_config(old, new).catalog == old.catalog


def test_profiled_models_added_or_removed_go_to_the_control_plane_not_to_a_restart(
    tmp_path: Path,
) -> None:
    huge = PROFILED.replace('"placed"', '"huge"').replace("org/placed", "org/huge")
    old = config(models_toml({"m": ["http://e1:8000"]}) + PROFILED, tmp_path)
    new = config(models_toml({"m": ["http://e1:8000"]}) + huge, tmp_path)
    plan = plan_reload(old, new)
    assert plan.needs_restart == () and plan.control_plane_changes
    assert (plan.placed_added, plan.placed_removed) == (("huge",), ("placed",))
    assert plan.summary() == "placed models added: huge; placed models removed (drained): placed"
    models = plan.as_json()["models"]
    assert (models["placed_added"], models["placed_removed"]) == (["huge"], ["placed"])
    served = reloaded_config(old, new)
    assert [m.name for m in served.catalog.models] == ["m", "huge"]
    assert served.catalog.get("huge") == new.catalog.get("huge")
    assert plan_reload(served, new).changes is False
    # Every profiled model removed: the control plane runs on, and takes one added again.
    bare = config(models_toml({"m": ["http://e1:8000"]}) + "[agents]\ninsecure = true\n", tmp_path)
    emptied = reloaded_config(old, bare, plane=True)
    assert [m.name for m in emptied.catalog.models] == ["m"]
    again = plan_reload(emptied, old, plane=True)
    assert again.placed_added == ("placed",) and again.needs_restart == ()
    # Where no control plane runs (a file with no profiled model), one waits for a restart.
    plan = plan_reload(bare, old)
    assert plan.needs_restart == ("models.placed (profile)",) and not plan.placed_added
    assert reloaded_config(bare, old).catalog == bare.catalog


# -- real servers ----------------------------------------------------------------------


def api(url: str, key: str) -> openai.OpenAI:
    limits = httpx2.Limits(max_keepalive_connections=0)  # each request: any worker
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key=key,
        max_retries=0,
        timeout=20,
        http_client=httpx2.Client(limits=limits, timeout=20),  # openai is typed against its fork
    )


def answers(url: str, key: str, model: str) -> bool:
    try:
        api(url, key).chat.completions.create(model=model, messages=CHAT)
    except (openai.AuthenticationError, openai.NotFoundError):
        return False
    return True


def model_ids(url: str, key: str) -> list[str] | None:
    """The healthy models a key sees; None when it is refused."""
    try:
        return sorted(m.id for m in api(url, key).models.list())
    except openai.AuthenticationError:
        return None


class Stream(threading.Thread):
    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.client = api(url, key)
        self.first = threading.Event()
        self.finished = False
        self.error: str | None = None

    def run(self) -> None:
        try:
            for chunk in self.client.chat.completions.create(
                model="m",
                messages=CHAT,
                stream=True,
            ):
                self.first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finished = True
        except openai.APIError as exc:
            self.error = repr(exc)
        finally:
            self.first.set()


def server_toml(port: int, workers: int, keys: list[str], models: dict[str, Sequence[str]]) -> str:
    return (
        f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = {workers}\nshutdown_grace_s = 2\n'
        "[router]\nhealth_interval_s = 0.3\n"
        f"[auth]\napi_keys = [{', '.join(repr(digest(k)) for k in keys)}]\n".replace("'", '"')
        + models_toml(models)
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_reloads_keys_and_static_models_without_dropping_a_stream(
    procs: Procs, workers: int
) -> None:
    slow = procs.mock("m", "--mock-tokens", "20", "--mock-tokens-per-second", "10")
    other = procs.mock("m2")
    port = free_port()
    path = procs.tmp / "server.toml"
    path.write_text(server_toml(port, workers, ["k1"], {"m": [slow.url]}))
    router = Proc([sys.executable, "-m", "llmgw_server", "--config", str(path)], port)
    procs.all.append(router)
    router.wait_http("/readyz")
    assert model_ids(router.url, "k1") is not None and model_ids(router.url, "k2") is None
    stream = Stream(router.url, "k1")
    stream.start()
    assert stream.first.wait(20)

    path.write_text(server_toml(port, workers, ["k1", "k2"], {"m": [slow.url], "m2": [other.url]}))
    router.signal(signal.SIGHUP)
    wait_until(lambda: "reloaded " in router.output(), what="the reload")
    assert "API keys: 1 added, 0 removed, 0 changed; models added: m2" in router.output()
    # Applied by every worker before the line is logged: each request, wherever it lands.
    wait_until(lambda: answers(router.url, "k2", "m2"), what="m2 to be healthy")
    for _ in range(6):
        assert answers(router.url, "k2", "m2") and "m2" in (model_ids(router.url, "k1") or ())

    # A file that does not validate changes nothing; the log says why.
    path.write_text(path.read_text().replace(digest("k2"), "sha256:nope"))
    router.signal(signal.SIGHUP)
    wait_until(lambda: "reload refused" in router.output(), what="the refusal")
    assert "auth.api_keys[1]: must be 'sha256:' and 64 lowercase hex digits" in router.output()
    for _ in range(4):
        assert answers(router.url, "k2", "m2") and "m2" in (model_ids(router.url, "k1") or ())

    stream.join(30)
    assert (stream.error, stream.finished) == (None, True)  # it went on through both
    router.popen.send_signal(signal.SIGTERM)
    assert router.popen.wait(15) == 0


def admin_models(token_digest: str) -> str:
    return (
        f'[admin]\ntoken_digest = "{token_digest}"\n'
        '\n[[models]]\nname = "placed"\nreplicas = 0\n[models.profile]\nengine = "vllm"\n'
        'model = "org/placed"\n'
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_the_admin_reload_takes_the_token_applies_the_file_and_refuses_a_broken_one(
    fleet: Fleet, procs: Procs, workers: int
) -> None:
    engine = procs.mock("static")
    fleet.server(admin_models(digest("admin-token")), workers=workers)
    path = procs.tmp / "server.toml"
    admin = httpx.Client(base_url=fleet.control, verify=fleet.tls, timeout=20)

    def reload(token: str | None = "admin-token") -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return admin.post("/v1/admin/reload", headers=headers, json={})

    assert reload(None).status_code == 401 and reload("wrong").status_code == 401
    assert not answers(fleet.url, "x", "static")
    path.write_text(
        path.read_text().replace("shutdown_grace_s = 2", "shutdown_grace_s = 3")
        + models_toml({"static": [engine.url]})
    )
    done = reload()
    assert done.status_code == 200, done.text
    body: dict[str, Any] = done.json()
    assert body["reloaded"] is True and body["models"]["added"] == ["static"]
    assert body["needs_restart"] == ["server.shutdown_grace_s"]
    wait_until(lambda: answers(fleet.url, "x", "static"), what="the static model")
    for _ in range(4):
        assert answers(fleet.url, "x", "static")

    path.write_text(path.read_text() + '\n[[models]]\nname = "static"\nendpoints = ["x"]\n')
    refused = reload()
    assert refused.status_code == 400
    message = refused.json()["error"]["message"]
    assert message.startswith("reload refused, the running config stays: ")
    assert message.endswith(
        "models[2].endpoints[0]: 'x' must start with http:// (engines are reached over plain HTTP)"
    )
    assert answers(fleet.url, "x", "static")
