"""The fleet page (GET /ui on the control port): its stream coalesced on a virtual clock,
its files and token rules over real sockets, and the page itself in Debian's headless
chromium against a real fleet, and against `make demo`, over the control port's https."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import attrs
import httpx
import openai
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from fleet import Fleet, wait_until
from llmgw_core.traffic import MODEL_ROW, Sample, TrafficStore
from llmgw_http.server import Responder
from llmgw_server.control.history import History, Point
from llmgw_server.control.reconciler import Step
from llmgw_server.control_shell import ui_server
from llmgw_server.control_shell.fleet_feed import FleetFeed
from test_demo import _alive as engine_alive
from test_demo import found, free_pair, read_banner, start_demo

TOKEN = "ui-admin-token"
DIGEST = "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest()
AUTH = {"authorization": f"Bearer {TOKEN}"}
# Engine output is untrusted: the failing engine's error message carries HTML.
HOSTILE = "<script>window.pwned=1</script><img src=x onerror=window.pwned=1>"


# -- the stream, on a virtual clock ---------------------------------------------


class Lines:
    """A Responder that keeps the NDJSON lines it is sent, with their (virtual) times."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.status: int | None = None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status

    async def send(self, data: bytes) -> None:
        assert data.endswith(b"\n") and data.count(b"\n") == 1
        self.lines.append((trio.current_time(), json.loads(data)))

    async def abort(self) -> None:
        raise AssertionError("not expected")


async def test_the_stream_sends_a_change_within_a_second_and_coalesces_a_storm(
    autojump_clock: trio.abc.Clock,
) -> None:
    feed = FleetFeed(wall_clock=lambda: 0.0)
    out = Lines()
    async with trio.open_nursery() as nursery:
        # A fake: it implements what stream() calls, not the whole Responder.
        nursery.start_soon(ui_server.stream, feed, lambda: {"n": feed.version}, cast(Responder, out))
        await trio.sleep(10)  # quiet: one status, then nothing but keep-alives
        assert [line for _, line in out.lines] == [{"status": {"n": 0}, "recent": [], "version": 0}]
        feed.stepped(Step())  # an empty step (a heartbeat that changes nothing)
        await trio.sleep(5.1)
        assert len(out.lines) == 1
        await trio.sleep(1)
        assert out.lines[-1][1] == {"keepalive": True, "version": 0}

        changed_at = trio.current_time()
        feed.shard("gpu-1", "r1", 0, "failed", "exit 1")
        await trio.sleep(1)
        at, line = out.lines[-1]
        assert line["status"] == {"n": 1} and at - changed_at <= 0.5
        assert line["recent"][0]["subject"] == "replica r1 rank 0 on gpu-1"

        # A storm of changes (10,000 nodes' worth over 5 s): at most one line a half-second.
        before = len(out.lines)
        for _ in range(10_000):
            feed.stepped(Step(reconciled=True))
            await trio.sleep(0.0005)
        await trio.sleep(1)
        sent = [at for at, line in out.lines[before:] if "status" in line]
        assert 5 <= len(sent) <= 12
        assert all(b - a >= ui_server.COALESCE_S for a, b in itertools.pairwise(sent))
        assert out.lines[-1][1]["status"] == {"n": feed.version}  # the last change shown
        nursery.cancel_scope.cancel()


async def test_the_stream_sends_the_charts_whole_first_then_each_new_point(
    autojump_clock: trio.abc.Clock,
) -> None:
    feed = FleetFeed(wall_clock=lambda: 0.0)
    history = History()
    history.record(0.0, {"chat": Point(100.0, 2.0, 50.0, 1, 1)}, {"chat"})
    history.record(10.0, {"chat": Point(110.0, 3.0, 60.0, 2, 2)}, {"chat"})
    out = Lines()

    def since(seq: int) -> tuple[int, dict[str, Any]]:
        return history.seq, {m: [attrs.asdict(p) for p in ps] for m, ps in history.since(seq).items()}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ui_server.stream, feed, lambda: {}, cast(Responder, out), since)
        await trio.sleep(1)
        first = out.lines[0][1]["history"]
        assert first["full"] and [p["rps"] for p in first["models"]["chat"]] == [2.0, 3.0]
        history.record(20.0, {"chat": Point(120.0, 4.0, None, 2, 2)}, {"chat"})
        feed.bump()
        await trio.sleep(1)
        update = out.lines[-1][1]["history"]
        assert not update["full"] and update["models"]["chat"] == [
            {"at": 120.0, "rps": 4.0, "ttft_p90_ms": None, "serving": 2, "desired": 2}
        ]
        feed.bump()  # a change with no new point: no history in the line
        await trio.sleep(1)
        assert "history" not in out.lines[-1][1] and "status" in out.lines[-1][1]
        nursery.cancel_scope.cancel()


async def test_the_stream_sends_traffic_when_routers_report_at_most_every_few_seconds(
    autojump_clock: trio.abc.Clock,
) -> None:
    feed = FleetFeed(wall_clock=lambda: 0.0)
    store = TrafficStore()
    out = Lines()

    def wall() -> float:
        return 1000.0 + trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            ui_server.stream, feed, lambda: {}, cast(Responder, out), None, store, wall
        )
        await trio.sleep(1)
        assert out.lines[0][1]["traffic"]["models"] == {}  # the first line: nothing yet
        await trio.sleep(20)  # no report: keep-alives only
        assert all("traffic" not in line for _, line in out.lines[1:])
        # Reports come every 0.1 s (many routers), and the fleet changes as often: statuses
        # go every half-second, the traffic with one of them every 5 s.
        sent = len(out.lines)
        for _ in range(200):
            store.add(wall(), 5.0, [Sample("chat", MODEL_ROW, 1, 0, 1, 50.0, 0)])
            feed.bump()
            await trio.sleep(0.1)
        lines = [(at, line) for at, line in out.lines[sent:] if "traffic" in line]
        assert 3 <= len(lines) <= 5
        assert all(b - a >= ui_server.TRAFFIC_EVERY_S for (a, _), (b, _) in itertools.pairwise(lines))
        minute = lines[-1][1]["traffic"]["models"]["chat"]["minute"]
        assert minute["e5xx"] == minute["requests"] > 0 and minute["ttft_p90_ms"] == 50.0
        nursery.cancel_scope.cancel()


def test_history_is_an_hour_a_model_and_forgets_models_no_longer_autoscaled() -> None:
    history = History(every_s=10.0, keep=360)
    assert history.due(0.0)
    for i in range(400):
        history.record(i * 10.0, {"a": Point(i, i, None, 1, 1), "b": Point(i, 0, None, 0, 0)}, {"a", "b"})
    assert not history.due(3995.0) and history.due(4000.0)
    assert [len(v) for v in history.since(0).values()] == [360, 360]
    assert history.since(0)["a"][0].rps == 40
    seq = history.seq
    history.record(4000.0, {"a": Point(400, 400, None, 1, 1)}, {"a"})
    assert list(history.since(seq)) == ["a"] and "b" not in history.since(0)


def test_recent_transitions_are_bounded() -> None:
    feed = FleetFeed(keep=3, wall_clock=lambda: 7.0)
    for rank in range(5):
        feed.shard("gpu-1", "r1", rank, "ready", "")
    assert [t.subject for t in feed.recent] == [
        f"replica r1 rank {rank} on gpu-1" for rank in (2, 3, 4)
    ]
    assert feed.version == 5


# -- the page in a real browser against a real fleet ----------------------------


def model(name: str, *, gib: int = 20, extra: str = "") -> str:
    return (
        f'\n[[models]]\nname = "{name}"\nreplicas = 1\n[models.profile]\nengine = "vllm"\n'
        f'model = "org/{name}"\ngpu_memory_gib = {gib}\n{extra}\n'
    )


def spki_hash(certificate: bytes) -> str:
    """What chromium's --ignore-certificate-errors-spki-list takes: base64(sha256(SPKI))."""
    spki = (
        x509.load_pem_x509_certificate(certificate)
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.fixture
def browser(fleet: Fleet) -> Iterator[webdriver.Chrome]:
    with headless_chromium(fleet.certs / "server.crt") as chrome:
        yield chrome


@contextlib.contextmanager
def headless_chromium(server_certificate: Path) -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver: `make browser`"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # Trust exactly this server certificate (issued by the fleet's CA), nothing else.
    spki = spki_hash(server_certificate.read_bytes())
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--ignore-certificate-errors-spki-list={spki}",
    ):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


# What the page shows, read in one go (no element goes stale between reads).
READ_PAGE = """
const rows = (id) => [...document.querySelectorAll('#' + id + ' tbody tr')];
return {
  shown: !document.getElementById('fleet').hidden,
  login: !document.getElementById('login').hidden,
  nodes: Object.fromEntries(rows('nodes').map((r) => [r.dataset.node, {
    status: r.querySelector('.status').textContent,
    scheduling: r.querySelector('.scheduling').textContent}])),
  replicas: rows('replicas').map((r) => ({
    id: r.dataset.replica, model: r.dataset.model,
    phase: r.querySelector('.phase').textContent,
    nodes: [...r.querySelectorAll('.shards li')].map((li) => li.dataset.node),
    failures: r.querySelector('.failures').textContent,
    tail: [...r.querySelectorAll('.output-tail pre')].map((p) => p.textContent).join('\\n')})),
  models: Object.fromEntries(rows('models').map((r) => [r.dataset.model,
    r.querySelector('.why-not').textContent])),
  recent: document.getElementById('recent').textContent,
  pwned: window.pwned === 1,
  scripts: document.scripts.length,
  images: document.images.length,
};
"""


def api_status(fleet: Fleet) -> dict[str, Any]:
    response = httpx.get(
        fleet.control + "/v1/admin/status", headers=AUTH, timeout=5, verify=fleet.tls
    )
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def test_the_page_follows_the_fleet_live_in_headless_chromium(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    fleet.server(
        f'\n[admin]\ntoken_digest = "{DIGEST}"\n'
        + model("chat", extra='gpu_model = "L4"')
        + model("broken", extra='gpu_model = "H100"')
        + model("huge", gib=500)
    )
    fleet.agent("gpu-1", "node-2xl4.toml")
    fleet.agent("gpu-2", "node-2xl4.toml")
    fleet.agent("gpu-3", "node-8xh100.toml", env=f'LLMGW_MOCK_TOKENS = "{HOSTILE}"')

    def page() -> dict[str, Any]:
        data: dict[str, Any] = browser.execute_script(READ_PAGE)
        return data

    browser.get(fleet.control + "/ui")
    wait_until(lambda: page()["login"], what="the page to ask for the token")
    assert browser.find_element(By.ID, "login").is_displayed()
    assert not browser.find_element(By.ID, "fleet").is_displayed()
    browser.find_element(By.ID, "token").send_keys("not-the-token")
    browser.find_element(By.ID, "login-submit").click()
    wait_until(
        lambda: browser.find_element(By.ID, "login-error").text == "That token was refused.",
        what="a wrong token refused",
    )
    assert browser.execute_script("return sessionStorage.length") == 0
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "login-submit").click()
    wait_until(lambda: page()["shown"], what="the page to take the token")
    assert not browser.find_element(By.ID, "login").is_displayed()
    assert browser.find_element(By.ID, "fleet").is_displayed()
    assert TOKEN not in browser.current_url
    assert browser.execute_script("return sessionStorage.length") == 1

    def chat_serving() -> list[dict[str, Any]]:
        return [r for r in page()["replicas"] if r["model"] == "chat" and "serving" in r["phase"]]

    serving = wait_until(chat_serving, 30, what="the page to show chat serving")
    wait_until(lambda: "crash loop" in page()["models"]["broken"], 30, what="broken's crash loop")

    # Every node, replica and model of the fleet, as the admin API has them.
    def same_as_api() -> bool:
        shown, api = page(), api_status(fleet)
        return (
            set(shown["nodes"]) == {n["name"] for n in api["nodes"]} == {"gpu-1", "gpu-2", "gpu-3"}
            and {r["id"] for r in shown["replicas"]} == {r["replica_id"] for r in api["replicas"]}
            and set(shown["models"]) == {m["name"] for m in api["models"]}
            and all(n["status"] == "reachable" for n in shown["nodes"].values())
        )

    wait_until(same_as_api, what="the page to match the admin API")
    shown, api = page(), api_status(fleet)
    huge = next(m for m in api["models"] if m["name"] == "huge")
    assert huge["unplaced"]["explanation"] in shown["models"]["huge"]

    # The engine's output is shown as text, and none of it ran.
    broken = next(r for r in shown["replicas"] if r["model"] == "broken")
    assert HOSTILE in broken["tail"] and "crash loop" in broken["failures"]
    assert not shown["pwned"] and shown["scripts"] == 1 and shown["images"] == 0

    # A drain moves chat's replica to the other L4 node.
    old_node = serving[0]["nodes"][0]
    new_node = {"gpu-1": "gpu-2", "gpu-2": "gpu-1"}[old_node]
    drained = httpx.post(
        f"{fleet.control}/v1/admin/nodes/{old_node}/drain",
        headers=AUTH,
        json={},
        verify=fleet.tls,
    )
    assert drained.status_code == 200, drained.text
    wait_until(
        lambda: (
            page()["nodes"][old_node]["scheduling"] == "draining"
            and [r["nodes"] for r in page()["replicas"] if r["model"] == "chat"] == [[new_node]]
            and chat_serving()
        ),
        40,
        what="the page to show chat moved off the drained node",
    )

    # A killed agent: its node turns unreachable on the page.
    fleet.agents[old_node].signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(
        lambda: page()["nodes"][old_node]["status"].startswith("unreachable"),
        15,
        what="the page to show the node unreachable",
    )
    latency = time.monotonic() - killed
    print(f"kill to unreachable on the page: {latency:.2f} s")
    assert f"node {old_node}: reachable -> unreachable" in page()["recent"]
    assert latency < 5  # the stream pushes within a second of the control plane's change


# -- the files and the token, over real sockets ---------------------------------


def test_the_files_need_no_token_and_the_stream_does(fleet: Fleet) -> None:
    fleet.server(f'\n[admin]\ntoken_digest = "{DIGEST}"\n' + model("chat"))
    with httpx.Client(base_url=fleet.control, verify=fleet.tls, timeout=5) as client:
        for path, kind in (
            ("/ui", "text/html"),
            ("/ui/app.js", "text/javascript"),
            ("/ui/style.css", "text/css"),
        ):
            response = client.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
            assert "script-src 'self'" in response.headers["content-security-policy"]
        page = client.get("/ui").text
        # Every file is llmgw's own: no CDN (fleets are often offline).
        assert re.findall(r'(?:src|href)="([^"]*)"', page) == ["/ui/style.css", "/ui/app.js"]
        assert client.get("/ui/nothing.js").status_code == 404
        # (Any POST on the control port without a JSON body is refused first, with 415.)
        assert client.post("/ui", json={}).status_code == 405
        refused = client.get("/v1/admin/stream")
        assert refused.status_code == 401
        with client.stream("GET", "/v1/admin/stream", headers=AUTH) as response:
            assert response.headers["content-type"] == "application/x-ndjson"
            first = json.loads(next(response.iter_lines()))
        assert first["status"]["models"][0]["name"] == "chat" and first["recent"] == []


def test_open_status_needs_no_token(fleet: Fleet, browser: webdriver.Chrome) -> None:
    fleet.server(f'\n[admin]\ntoken_digest = "{DIGEST}"\nopen_status = true\n' + model("chat"))
    browser.get(fleet.control + "/ui")
    wait_until(
        lambda: (
            browser.find_element(By.ID, "fleet").is_displayed()
            and browser.find_elements(By.CSS_SELECTOR, '#models tr[data-model="chat"]')
        ),
        what="the page to show the fleet without asking for a token",
    )
    assert not browser.find_element(By.ID, "login").is_displayed()
    with (
        httpx.Client(base_url=fleet.control, verify=fleet.tls, timeout=5) as client,
        client.stream("GET", "/v1/admin/stream") as response,
    ):
        assert response.status_code == 200
        assert "status" in json.loads(next(response.iter_lines()))


AUTOSCALED = """
[[models]]
name = "chat"
[models.profile]
engine = "vllm"
model = "org/chat"
gpu_memory_gib = 20
[models.autoscale]
min = 1
max = 2
target_in_flight = 4
"""

# The autoscaled model's row and charts, as the page shows them.
READ_CHARTS = """
const row = document.querySelector('#models tr[data-model="chat"]');
const charts = [...document.querySelectorAll('#charts .chart-row[data-model="chat"] figure')];
return {
  autoscale: row ? row.querySelector('.autoscale').textContent : null,
  load_shown: !document.getElementById('load').hidden,
  charts: Object.fromEntries(charts.map((f) => [f.dataset.chart, {
    caption: f.querySelector('figcaption').textContent,
    points: (f.querySelector('polyline')?.getAttribute('points') || '').split(' ').filter(Boolean).length,
  }])),
};
"""


def test_the_page_charts_an_autoscaled_models_last_hour_live(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    fleet.server(
        f'\n[admin]\ntoken_digest = "{DIGEST}"\nopen_status = true\n' + AUTOSCALED,
        control="autoscale_interval_s = 0.5",
    )
    fleet.agent("gpu-1", "node-2xl4.toml")
    wait_until(lambda: fleet.serving("chat"), 30, what="a replica of chat")
    browser.get(fleet.control + "/ui")

    def charts() -> dict[str, Any]:
        data: dict[str, Any] = browser.execute_script(READ_CHARTS)
        return data

    first = wait_until(
        lambda: (c := charts())["load_shown"] and c["charts"].get("replicas", {}).get("points") and c,
        30,
        what="the page to chart chat",
    )
    assert "1 to 2 replicas; target 4 in flight a replica" in first["autoscale"]
    assert set(first["charts"]) == {"requests/s", "TTFT p90", "replicas"}
    # The first point may be from before the replica served (recorded at the first cycle).
    assert re.fullmatch(r"replicas: [01] now, [01] at most", first["charts"]["replicas"]["caption"])
    # Requests through the router: the next point (every 10 s) charts them, sent live.
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)
    for _ in range(20):
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    later = wait_until(
        lambda: (c := charts())["charts"]["requests/s"]["caption"] != "requests/s: 0 now, 0 at most"
        and c,
        30,
        what="a point with the requests",
    )
    assert later["charts"]["replicas"]["points"] > first["charts"]["replicas"]["points"]
    assert later["charts"]["replicas"]["caption"] == "replicas: 1 now, 1 at most"
    assert "ms now" in later["charts"]["TTFT p90"]["caption"]


# Each model's traffic as the page shows it, and which replicas stand out.
READ_TRAFFIC = """
const models = [...document.querySelectorAll('#traffic .traffic-model')];
const cell = document.querySelector('#models td.name');
return {
  models: Object.fromEntries(models.map((d) => [d.dataset.model, {
    rps: d.querySelector('.figures .rps').textContent,
    e4xx: d.querySelector('.figures .e4xx-rate').textContent,
    e5xx: d.querySelector('.figures .e5xx-rate').textContent,
    ttft: d.querySelector('.figures .ttft').textContent,
    badge: d.querySelector('h3 .failing-badge')?.textContent || '',
    failing: [...d.querySelectorAll('tr.failing')].map((tr) => tr.dataset.url),
    replicas: [...d.querySelectorAll('.replica-traffic tbody tr')].map((tr) => tr.dataset.url),
    captions: [...d.querySelectorAll('figcaption')].map((f) => f.textContent),
    axis_labels: d.querySelectorAll('.chart-axis').length,
  }])),
  placement_failing: [...document.querySelectorAll('#replicas tbody tr.failing')]
    .map((tr) => tr.dataset.replica),
  updated: document.getElementById('updated').textContent,
  recent: [...document.querySelectorAll('#recent li')].map((li) => li.textContent),
  model_wraps: cell ? getComputedStyle(cell).whiteSpace : null,
};
"""
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC[+-]\d\d:\d\d"


def test_the_page_shows_each_models_traffic_and_a_replica_answering_500s_stands_out(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    fleet.server(
        f'\n[admin]\ntoken_digest = "{DIGEST}"\nopen_status = true\n'
        + model("chat", extra="").replace("replicas = 1", "replicas = 3")
    )
    # Two nodes of two GPUs for three replicas: each node has one; gpu-2's answer 500s.
    fleet.agent("gpu-1", "node-2xl4.toml")
    fleet.agent("gpu-2", "node-2xl4.toml", env='LLMGW_MOCK_FAIL_STATUS = "500"')
    wait_until(lambda: len(fleet.serving("chat")) == 3, 60, what="three replicas of chat")
    bad = {r["replica_id"] for r in fleet.serving("chat") if r["shards"][0]["node"] == "gpu-2"}
    bad_urls = {r["url"] for r in fleet.serving("chat") if r["replica_id"] in bad}
    browser.get(fleet.control + "/ui")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0)

    def traffic() -> dict[str, Any]:
        data: dict[str, Any] = browser.execute_script(READ_TRAFFIC)
        return data

    def stands_out() -> dict[str, Any] | None:
        for _ in range(10):  # the router tries another replica: every client gets its answer
            client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
        shown = traffic()
        chat = shown["models"].get("chat")
        # Every failing replica, and only those: the page may show the first to fail
        # before the router has sent the other one a request (a CI run met that).
        failing = set(chat["failing"]) if chat else set()
        return shown if failing == bad_urls and set(shown["placement_failing"]) == bad else None

    shown = wait_until(stands_out, 90, what="the page to show chat's failing replicas, and only those")
    chat = shown["models"]["chat"]
    assert chat["badge"] == f"{len(bad)} answering 5xx"
    assert set(chat["replicas"]) == {r["url"] for r in fleet.serving("chat")}
    assert re.fullmatch(r"\d+(\.\d+)? req/s", chat["rps"]) and chat["rps"] != "0 req/s"
    assert re.fullmatch(r"5xx \d+(\.\d+)?/s( \(\d+(\.\d+)?%\))?", chat["e5xx"])
    assert re.fullmatch(r"TTFT p90 \d+ ms", chat["ttft"])
    # Readable charts: axes labelled, a window that fits the data (a few minutes old).
    assert chat["axis_labels"] >= 3 * 6
    assert all(re.search(r", last 5 min to " + STAMP + "$", c) for c in chat["captions"])
    assert [c.split(", last")[0] for c in chat["captions"]] == [
        "requests/s (all, 4xx, 5xx)", "TTFT p90", "in flight"
    ]
    # Timestamps carry their date and time zone; the Model column does not wrap.
    assert re.fullmatch("updated " + STAMP, shown["updated"])
    assert shown["recent"] and all(re.match(STAMP, line) for line in shown["recent"])
    assert shown["model_wraps"] == "nowrap"


# -- the demo, as `make demo` runs it -------------------------------------------


def test_the_page_shows_every_node_replica_and_model_of_the_demo_live(tmp_path: Path) -> None:
    port = free_pair()
    demo = start_demo(port, tmp_path)
    try:
        banner = read_banner(demo)
        # The demo keeps its certificates in the temporary directory the banner names.
        work = Path(found(r"removes (\S+) \(certificates", banner))
        assert work.parent == tmp_path
        control = f"https://127.0.0.1:{port + 1}"
        trust = ssl.create_default_context(cafile=str(work / "certs" / "ca.crt"))

        def demo_status() -> dict[str, Any]:
            # The demo has no [admin] section: its admin API is open on loopback.
            response = httpx.get(control + "/v1/admin/status", timeout=5, verify=trust)
            assert response.status_code == 200, response.text
            data: dict[str, Any] = response.json()
            return data

        def as_api(status: dict[str, Any]) -> dict[str, Any]:
            return {
                "nodes": {n["name"]: n["status"] for n in status["nodes"]},
                "replicas": {
                    r["replica_id"]: (r["model"], sorted(s["node"] for s in r["shards"]))
                    for r in status["replicas"]
                },
                "models": {m["name"] for m in status["models"]},
            }

        expected = as_api(demo_status())
        assert expected["nodes"] == {"sim-node-1": "reachable", "sim-node-2": "reachable"}
        assert expected["models"] == {"demo-model", "demo-big"}
        assert len(expected["replicas"]) == 3

        with headless_chromium(work / "certs" / "server.crt") as browser:

            def page() -> dict[str, Any]:
                data: dict[str, Any] = browser.execute_script(READ_PAGE)
                return data

            def as_shown(shown: dict[str, Any]) -> dict[str, Any]:
                return {
                    "nodes": {name: n["status"] for name, n in shown["nodes"].items()},
                    "replicas": {
                        r["id"]: (r["model"], sorted(r["nodes"])) for r in shown["replicas"]
                    },
                    "models": set(shown["models"]),
                }

            def same_as_api() -> dict[str, Any] | None:
                shown = page()
                if not shown["shown"] or as_shown(shown) != as_api(demo_status()):
                    return None
                if not all("serving" in r["phase"] for r in shown["replicas"]):
                    return None
                return shown

            browser.get(control + "/ui")
            shown = wait_until(
                same_as_api, what="the page to show the demo as its admin API has it"
            )
            assert as_shown(shown) == expected  # nothing moved since the banner
            assert not shown["login"] and not browser.find_element(By.ID, "login").is_displayed()
            assert browser.execute_script("return sessionStorage.length") == 0  # no token asked
            assert {n["scheduling"] for n in shown["nodes"].values()} == {"schedulable"}

            # A drain (no token either): the page shows it, and the replicas on the L4 node
            # (if the first placement put any there) move to the H100 node, serving.
            drained = "sim-node-1"
            moved = {rid for rid, (_, nodes) in expected["replicas"].items() if drained in nodes}
            asked = time.monotonic()
            response = httpx.post(
                f"{control}/v1/admin/nodes/{drained}/drain", json={}, timeout=5, verify=trust
            )
            assert response.status_code == 200, response.text
            wait_until(
                lambda: page()["nodes"][drained]["scheduling"] == "draining",
                10,
                what="the page to show the node draining",
            )
            print(f"drain to 'draining' on the page: {time.monotonic() - asked:.2f} s")

            def moved_off() -> dict[str, Any] | None:
                shown = same_as_api()
                if shown is None or len(shown["replicas"]) != 3:
                    return None
                if any(drained in r["nodes"] for r in shown["replicas"]):
                    return None
                return shown

            shown = wait_until(moved_off, 30, what="the page to show the replicas moved off")
            print(f"moved off {drained} on the page: {sorted(moved)}")
            models = {r["model"] for r in shown["replicas"]}
            assert (
                models == {"demo-model", "demo-big"}
                and shown["nodes"][drained]["status"] == "reachable"
            )
            if moved:
                # New replicas took their place, and the recent transitions show them start.
                new = {r["id"] for r in shown["replicas"]} - set(expected["replicas"])
                assert len(new) == len(moved) and moved.isdisjoint(
                    r["id"] for r in shown["replicas"]
                )
                assert all(f"replica {rid} rank 0 on" in shown["recent"] for rid in new)

        engines = [json.loads(record.read_text())["pid"] for record in work.glob("*/shards/*.json")]
        assert engines
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) == 0
        assert not work.exists() and list(tmp_path.iterdir()) == []
        for pid in engines:
            assert not engine_alive(pid), pid
    finally:
        if demo.poll() is None:  # a failed check: the demo still stops what it started
            demo.send_signal(signal.SIGTERM)
            try:
                demo.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
