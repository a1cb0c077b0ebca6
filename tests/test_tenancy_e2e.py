"""Tenants' limits and fair queues, end to end: a real router process in front of real mock
engines, driven by the official openai client and httpx. The limits' and the queues'
arithmetic is property-tested in test_tenant_limits.py and test_fair_queue.py; here,
what a client sees: 429 in the API's shape with Retry-After and OpenAI's x-ratelimit-*
headers, tokens settled from the engine's usage, and a full model's requests served by
priority and fair share rather than by arrival."""

from __future__ import annotations

import hashlib
import secrets
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from fleet import Fleet, wait_until
from llmgw_core.config import digest_of
from procs import Proc, Procs, free_port, metric, models_toml

KEY_A, KEY_B, KEY_FREE = "sk-team-a", "sk-team-b", "sk-free"


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenants_toml(*tenants: str, router: str = "") -> str:
    keys = (
        f'[[auth.keys]]\ndigest = "{sha(KEY_A)}"\ntenant = "team-a"\n'
        f'[[auth.keys]]\ndigest = "{sha(KEY_B)}"\ntenant = "team-b"\n'
        f'[[auth.keys]]\ndigest = "{sha(KEY_FREE)}"\n'
    )
    declared = "".join(tenants)
    if 'name = "team-b"' not in declared:
        declared += '[[tenants]]\nname = "team-b"\n'
    return f"[router]\n{router}\n" + keys + declared


def client(url: str, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=retries, timeout=30)


def chat(url: str, key: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}
    return httpx.post(
        url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_requests_per_minute_answers_429_with_retry_after_and_rate_headers(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "5")
    tenant = '[[tenants]]\nname = "team-a"\nrequests_per_minute = 3\n[[tenants]]\nname = "team-b"\n'
    router = procs.router(tenants_toml(tenant) + models_toml({"m": [engine.url]}))
    answers = [chat(router.url, KEY_A) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "3" for a in answers)
    assert "x-ratelimit-limit-tokens" not in answers[0].headers  # no tokens_per_minute
    refused = chat(router.url, KEY_A)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "team-a" in error["message"]
    # The next free slot is the first request's, a minute after it (slots of a second).
    retry_ms = int(refused.headers["retry-after-ms"])
    assert 50_000 < retry_ms <= 61_000
    assert int(refused.headers["retry-after"]) == -(-retry_ms // 1000)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    reset = refused.headers["x-ratelimit-reset-requests"]
    assert reset.endswith("s") and not reset.startswith("-")

    # The openai client reads the same 429 (and would wait retry-after-ms to retry).
    with pytest.raises(openai.RateLimitError) as caught:
        client(router.url, KEY_A).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.response.headers["retry-after-ms"]

    # Other tenants are not touched: team-b is declared without limits, the free key is a
    # tenant of its own; neither gets x-ratelimit headers.
    for key in (KEY_B, KEY_FREE):
        other = chat(router.url, key)
        assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers

    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_tenant_refused_total", tenant="team-a", reason="requests") == 2
    assert metric(page, "llmgw_tenant_requests_total", tenant="team-a") == 5
    assert metric(page, "llmgw_tenant_requests_total", tenant="team-b") == 1
    key_tenant = "key:" + sha(KEY_FREE)[7:15]
    assert metric(page, "llmgw_tenant_requests_total", tenant=key_tenant) == 1
    assert metric(page, "llmgw_tenant_tokens_total", tenant="team-a", kind="completion") == 15


def test_tokens_are_reserved_then_settled_with_the_engines_usage(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "5")
    tenant = '[[tenants]]\nname = "team-a"\ntokens_per_minute = 1000\n'
    router = procs.router(tenants_toml(tenant) + models_toml({"m": [engine.url]}))
    first = chat(router.url, KEY_A, max_tokens=600)
    assert first.status_code == 200
    # Reserved at admission: the prompt's estimate and max_tokens, more than 600.
    assert int(first.headers["x-ratelimit-remaining-tokens"]) < 400
    used = first.json()["usage"]["total_tokens"]
    # Settled with the usage: the next one sees what was really used, and fits.
    second = chat(router.url, KEY_A, max_tokens=600)
    assert second.status_code == 200
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert 1000 - used - 700 < remaining < 1000 - used - 600
    # A request bigger than what is left waits for the window, however it asks.
    third = chat(router.url, KEY_A, max_tokens=990)
    assert third.status_code == 429 and "tokens per minute" in third.json()["error"]["message"]
    # A stream without usage is charged its events: 5 tokens, not the 100 it reserved.
    stream = chat(router.url, KEY_A, max_tokens=100, stream=True)
    assert stream.status_code == 200 and stream.text.count("data:") >= 6


def test_anthropic_messages_get_anthropics_429(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "5")
    tenant = '[[tenants]]\nname = "team-a"\nmax_in_flight = 1\nrequests_per_minute = 1\n'
    router = procs.router(tenants_toml(tenant) + models_toml({"m": [engine.url]}))
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    ok = httpx.post(router.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert ok.status_code == 200, ok.text
    refused = httpx.post(router.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert refused.status_code == 429
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.headers["retry-after"]


def test_max_in_flight_counts_a_tenants_requests_at_once(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "40", "--mock-tokens-per-second", "20")
    tenant = '[[tenants]]\nname = "team-a"\nmax_in_flight = 1\n'
    router = procs.router(tenants_toml(tenant) + models_toml({"m": [engine.url]}))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {KEY_A}"},
        timeout=30,
    ) as streaming:
        assert streaming.status_code == 200
        lines = streaming.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        refused = chat(router.url, KEY_A)
        assert refused.status_code == 429 and "in flight" in refused.json()["error"]["message"]
        assert refused.headers["retry-after-ms"] == "1000"
        assert chat(router.url, KEY_B).status_code == 200  # another tenant
    # The stream ended: its slot is free again.
    assert chat(router.url, KEY_A).status_code == 200


def test_a_full_model_serves_by_priority_then_fair_share(procs: Procs) -> None:
    # One replica taking one request at a time: every other request waits at the
    # router, in its tenant's queue.
    engine = procs.mock("m", "--mock-tokens", "30", "--mock-tokens-per-second", "10")
    tenants = '[[tenants]]\nname = "team-a"\n[[tenants]]\nname = "team-b"\npriority = 1\n'
    router = procs.router(
        tenants_toml(tenants, router="replica_max_in_flight = 1\nqueue_max_per_tenant = 4")
        + models_toml({"m": [engine.url]})
    )
    done: list[tuple[str, int, float]] = []
    lock = threading.Lock()

    def send(key: str, name: str, tokens: int) -> None:
        answer = chat(router.url, key, max_tokens=tokens)
        with lock:
            done.append((name, answer.status_code, time.monotonic()))

    def gauge(name: str) -> float:
        return metric(httpx.get(router.url + "/metrics").text, name, tenant="team-a")

    # team-a: one running (3 s long), then four waiting (its queue's bound).
    threads = [threading.Thread(target=send, args=(KEY_A, "a0", 30))]
    threads[0].start()
    wait_until(lambda: gauge("llmgw_tenant_requests_in_flight") == 1, what="a0 to run")
    threads += [threading.Thread(target=send, args=(KEY_A, f"a{i}", 1)) for i in range(1, 5)]
    for thread in threads[1:]:
        thread.start()
    wait_until(lambda: gauge("llmgw_tenant_requests_queued") == 4, what="4 to wait")
    overflow = chat(router.url, KEY_A)  # a fifth waiting: refused
    assert overflow.status_code == 429 and "waiting" in overflow.json()["error"]["message"]
    assert overflow.headers["retry-after"] == "1"
    # team-b arrives last, with a higher priority: next after the running one.
    b = threading.Thread(target=send, args=(KEY_B, "b", 1))
    b.start()
    for thread in [*threads, b]:
        thread.join(30)
    order = [name for name, _, _ in sorted(done, key=lambda d: d[2])]
    assert all(status == 200 for _, status, _ in done)
    assert order[:2] == ["a0", "b"], order
    page = httpx.get(router.url + "/metrics").text
    assert metric(page, "llmgw_tenant_refused_total", tenant="team-a", reason="queue_full") == 1
    assert metric(page, "llmgw_tenant_requests_queued", tenant="team-a") == 0


def test_two_workers_enforce_one_limit_together(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "2")
    tenant = '[[tenants]]\nname = "team-a"\nrequests_per_minute = 8\n'
    router = procs.router(
        tenants_toml(tenant) + models_toml({"m": [engine.url]}), server="workers = 2"
    )

    def shares() -> list[float]:
        page = httpx.get(router.url + "/metrics").text
        return [
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("llmgw_tenant_limit{") and 'of="share"' in line
        ]

    # Each worker enforces a share from the parent's hub, the shares within the limit.
    deadline = time.monotonic() + 20
    while not (len(found := shares()) == 2 and sum(found) <= 8):
        assert time.monotonic() < deadline, f"no shares within the limit: {found}"
        time.sleep(0.1)
    statuses: list[int] = []
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline and statuses.count(200) < 12:
        status = chat(router.url, KEY_A).status_code
        assert status in (200, 429)
        statuses.append(status)
        time.sleep(0.05)
    ok, refused = statuses.count(200), statuses.count(429)
    # Together never past the limit (but for the one request a window each process's
    # empty window takes beyond a share of almost nothing), and the limit's whole is
    # used: the shares moved to where the requests were.
    assert 7 <= ok <= 8 + 2, (ok, refused, shares())
    assert refused > 0
    # None refused below the limit: a worker whose share was used up while the other's
    # was not held the request until its hub raised the share (front.BORROW_WAIT_S).
    assert statuses[:7] == [200] * 7, statuses


def test_the_control_plane_shares_a_limit_between_routers_and_shows_its_use(
    fleet: Fleet,
) -> None:
    token = "router-" + secrets.token_hex(8)
    admin = f'\n[admin]\nrouter_token_digest = "sha256:{digest_of(token)}"\nopen_status = true\n'
    placed = '[[models]]\nname = "placed"\n[models.profile]\nengine = "vllm"\nmodel = "org/x"\n'
    fleet.server(placed, control=admin)
    engine = fleet.procs.mock("m", "--mock-tokens", "5")
    tenant = '[[tenants]]\nname = "team-a"\ntokens_per_minute = 100000\n'
    routers = []
    for _ in range(2):
        port = free_port()
        path = fleet.procs.tmp / f"router-{port}.toml"
        path.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = 2\n'
            + tenants_toml(tenant)
            + models_toml({"m": [engine.url]})
        )
        argv = [sys.executable, "-m", "llmgw_server", "router", "--config", str(path),
                "--control", fleet.control, "--ca", str(fleet.certs / "ca.crt")]  # fmt: skip
        router = Proc(argv, port, env={"LLMGW_ROUTER_TOKEN": token})
        fleet.procs.all.append(router)
        routers.append(router)
    for router in routers:
        router.wait_http("/readyz", timeout=60)
        assert chat(router.url, KEY_A).status_code == 200

    def limit() -> dict[str, Any] | None:
        rows = [t for t in fleet.status().get("tenants", ()) if t["tenant"] == "team-a"]
        return rows[0] if rows else None

    # The control plane hears both routers (each its workers' parent) and shares the
    # limit between them: within it, with what they used counted.
    wait_until(
        lambda: (row := limit()) is not None and len(row["shares"]) == 2 and row["used"] > 0,
        timeout=30,
        what="the control plane to share team-a's limit between the two routers",
    )
    # Each router enforced the whole limit until its first grant; the shares then come
    # within it (a grant lowered counts until the router applied it).
    wait_until(
        lambda: (row := limit()) is not None and sum(row["shares"].values()) <= 100000,
        timeout=30,
        what="the routers' shares to come within the limit",
    )
    row = limit()
    assert row is not None
    assert (row["kind"], row["model"], row["limit"]) == ("tokens", None, 100000)
    shown = fleet.cli("status")
    assert shown.returncode == 0, shown.stderr
    assert "TENANT" in shown.stdout and "100000 tokens/min" in shown.stdout
