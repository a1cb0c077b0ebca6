"""The router's metrics for operators: tokens per model and key, refused requests and auth
failures, /metrics behind a token. A real router process, real mock engines, real clients."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw_core.config import parse_config
from llmgw_core.tomlshape import ConfigError
from procs import Proc, Procs, metric, models_toml

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there my friend"}]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


def page(router: Proc, token: str | None = None) -> str:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(router.url + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    return response.text


def test_tokens_counted_per_model_and_key_from_the_engines_usage(procs: Procs) -> None:
    m = procs.mock("m", "--mock-tokens", "4")
    e = procs.mock("e")
    router = procs.router(
        models_toml({"m": [m.url], "e": [e.url]})
        + f'\n[auth]\napi_keys = ["sha256:{sha("sk-alpha")}"]\n'
        + f'[[auth.keys]]\ndigest = "sha256:{sha("sk-beta")}"\nmodels = ["m"]\n'
    )
    alpha, beta = client(router.url, "sk-alpha"), client(router.url, "sk-beta")
    want: dict[tuple[str, str, str], int] = {}

    def add(model: str, key: str, prompt: int, completion: int | None) -> None:
        want[(model, sha(key)[:8], "prompt")] = (
            want.get((model, sha(key)[:8], "prompt"), 0) + prompt
        )
        if completion is not None:
            k = (model, sha(key)[:8], "completion")
            want[k] = want.get(k, 0) + completion

    for api, key in ((alpha, "sk-alpha"), (beta, "sk-beta"), (beta, "sk-beta")):
        usage = api.chat.completions.create(model="m", messages=CHAT).usage
        assert usage is not None
        add("m", key, usage.prompt_tokens, usage.completion_tokens)
    last = list(
        alpha.chat.completions.create(
            model="m",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
        )
    )[-1]
    assert last.usage is not None
    add("m", "sk-alpha", last.usage.prompt_tokens, last.usage.completion_tokens)
    completion = alpha.completions.create(model="m", prompt="one two three", max_tokens=2)
    assert completion.usage is not None
    add("m", "sk-alpha", completion.usage.prompt_tokens, completion.usage.completion_tokens)
    embedding = alpha.embeddings.create(model="e", input=["a b", "c"])
    add("e", "sk-alpha", embedding.usage.prompt_tokens, None)
    # A stream without include_usage carries no usage: nothing is counted for it.
    assert len(list(beta.chat.completions.create(model="m", messages=CHAT, stream=True))) > 3

    text = page(router)
    counted = {
        (model, key_id, kind): metric(
            text, "llmgw_tokens_total", model=model, key_id=key_id, kind=kind
        )
        for model, key_id, kind in want
    }
    assert counted == want
    assert all(n > 0 for n in want.values())
    assert text.count("llmgw_tokens_total{") == len(want) == 5
    assert "sk-alpha" not in text and "sk-beta" not in text


def test_refused_requests_are_counted_and_logged_at_a_bounded_rate(procs: Procs) -> None:
    engine = procs.mock("m")
    other = procs.mock("o")
    router = procs.router(
        models_toml({"m": [engine.url], "o": [other.url]})
        + f'\n[[auth.keys]]\ndigest = "sha256:{sha("sk-m")}"\nmodels = ["m"]\n',
        server="max_body_bytes = 4096",
    )
    url = router.url + "/v1/chat/completions"
    good = {"authorization": "Bearer sk-m"}
    chat = {"model": "m", "messages": CHAT}
    for _ in range(5):
        assert httpx.post(url, json=chat).status_code == 401
    for _ in range(2):
        wrong = httpx.post(url, json=chat, headers={"authorization": "Bearer sk-nope"})
        assert wrong.status_code == 401
    assert httpx.post(url, json={**chat, "model": "o"}, headers=good).status_code == 403
    assert httpx.post(url, json={**chat, "model": "zz"}, headers=good).status_code == 403
    assert httpx.post(url, content=b"{nope", headers=good).status_code == 400
    assert httpx.post(url, json={"messages": CHAT}, headers=good).status_code == 404
    assert httpx.get(url, headers=good).status_code == 405
    assert httpx.get(router.url + "/nowhere").status_code == 404
    big = {**chat, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert httpx.post(url, json=big, headers=good).status_code == 413
    assert httpx.post(url, json=chat, headers=good).status_code == 200

    text = page(router)
    statuses = {"401": 7, "403": 1, "400": 1, "404": 2, "405": 1, "413": 1}
    for status, n in statuses.items():
        assert metric(text, "llmgw_requests_total", model="-", status=status) == n, status
    # A model this router serves is named even when the key may not use it.
    assert metric(text, "llmgw_requests_total", model="o", status="403") == 1
    assert metric(text, "llmgw_requests_total", model="m", status="200") == 1
    reasons = {"missing_key": 5, "invalid_key": 2, "model_not_allowed": 2}
    for reason, n in reasons.items():
        assert metric(text, "llmgw_auth_failures_total", reason=reason) == n, reason
    assert metric(text, "llmgw_auth_failures_total", reason="metrics_token") == 0

    refusals = [line for line in router.output().splitlines() if " refused " in line]
    # One line a period (10 s) for each status and reason: 5 missing keys make one line.
    assert sum("missing_key" in line for line in refusals) == 1
    assert sum("invalid_key" in line for line in refusals) == 1
    assert sum("model_not_allowed" in line for line in refusals) == 1
    assert sum("with 413" in line for line in refusals) == 1
    assert "sk-nope" not in router.output() and "sk-m" not in router.output()
    wrong_key = next(line for line in refusals if "invalid_key" in line)
    assert f"key_id={sha('sk-nope')[:8]}" in wrong_key
    assert len(refusals) == 7  # 401 x2 reasons, 403, 400, 404, 405, 413: not one per request


def test_metrics_behind_a_token_and_what_stays_open(procs: Procs) -> None:
    engine = procs.mock("m")
    router = procs.router(
        models_toml({"m": [engine.url]}),
        server=f'metrics_token_digest = "sha256:{sha("scrape-me")}"',
    )
    assert httpx.get(router.url + "/metrics").status_code == 401
    wrong = httpx.get(router.url + "/metrics", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert wrong.headers["x-request-id"]
    text = page(router, "scrape-me")
    assert metric(text, "llmgw_auth_failures_total", reason="metrics_token") == 2
    assert metric(text, "llmgw_requests_total", model="-", status="401") == 2
    assert f'endpoint="{engine.url}"' in text  # what the token keeps from others
    # /readyz and /healthz stay open for load balancers: model names and counts, no URL.
    ready = httpx.get(router.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "draining": False, "models": {"m": 1}}
    assert httpx.get(router.url + "/healthz").status_code == 200


def test_metrics_token_settings() -> None:
    models = [{"name": "m", "endpoints": ["http://127.0.0.1:9001"]}]

    def server(environ: dict[str, str] | None = None, **settings: Any) -> Any:
        data: dict[str, object] = {"server": settings, "models": models}
        return parse_config(data, "x.toml", environ=environ or {}).server

    assert server().metrics_token_digest is None
    digest = sha("tok")
    assert server(metrics_token_digest=f"sha256:{digest}").metrics_token_digest == digest
    from_env = server({"SCRAPE": " tok\n"}, metrics_token_env="SCRAPE")
    assert from_env.metrics_token_digest == digest
    with pytest.raises(ConfigError, match=r"server\.metrics_token_env: give metrics_token_digest"):
        server(metrics_token_digest=f"sha256:{digest}", metrics_token_env="SCRAPE")
    with pytest.raises(ConfigError, match=r"server\.metrics_token_digest: must be 'sha256:'"):
        server(metrics_token_digest="tok")
    with pytest.raises(ConfigError, match=r"server\.metrics_token_env: .*SCRAPE is not set"):
        server(metrics_token_env="SCRAPE")


def test_a_client_that_went_away_is_status_0(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "1000", "--mock-tokens-per-second", "20")
    router = procs.router(models_toml({"m": [engine.url]}))
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={"model": "m", "messages": CHAT, "stream": True},
    ) as response:
        lines = response.iter_lines()
        next(lines)
    deadline = time.monotonic() + 10
    while metric(page(router), "llmgw_requests_total", model="m", status="0") != 1:
        assert time.monotonic() < deadline, page(router)
        time.sleep(0.05)
    assert metric(page(router), "llmgw_requests_total", model="m", status="200") == 0
