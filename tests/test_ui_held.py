"""The fleet page while a model wakes from zero (issue 36): it says how many requests
the routers hold for it, and why it scales, consistently with its last change ("now:
steady: at its floor" stood beside "last change: 0 -> 1" before). In headless Chromium
against a control plane, an agent with simulated GPUs and a mock engine that takes
START_S to start; the waking request is streamed, and gets the engine's events."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from selenium import webdriver

from fleet import Fleet, wait_until
from test_ui import DIGEST, headless_chromium

START_S = 4.0  # the engine's start: the request is held that long at least

WAKING = f"""
[admin]
token_digest = "{DIGEST}"
open_status = true

[[models]]
name = "chat"
[models.profile]
engine = "vllm"
model = "org/chat"
gpu_memory_gib = 20
args = ["--mock-tokens", "4", "--mock-startup-delay", "{START_S}"]
[models.autoscale]
min = 0
max = 1
target_in_flight = 4
"""

READ_AUTOSCALING = """
const row = document.querySelector('#models tr[data-model="chat"]');
return row ? row.querySelector('.autoscale').textContent : null;
"""


@pytest.fixture
def browser(fleet: Fleet) -> Iterator[webdriver.Chrome]:
    with headless_chromium(fleet.certs / "server.crt") as chrome:
        yield chrome


def test_the_page_shows_the_requests_held_while_a_model_wakes(
    fleet: Fleet, browser: webdriver.Chrome
) -> None:
    fleet.server(WAKING, control="autoscale_interval_s = 0.5")
    fleet.agent("gpu-1", "node-2xl4.toml")
    browser.get(fleet.control + "/ui")

    def shown() -> str:
        text = browser.execute_script(READ_AUTOSCALING)
        return text if isinstance(text, str) else ""

    at_zero = wait_until(lambda: "now: steady" in (t := shown()) and t, 30, what="chat at zero")
    assert "now: steady: at its floor (0)" in at_zero and "held" not in at_zero, at_zero
    streamed: list[bytes] = []

    def ask() -> None:
        body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, timeout=60) as r:
            streamed.append(b"".join(r.iter_bytes()))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    waking = wait_until(lambda: "1 request held" in (t := shown()) and t, 20, what="held shown")
    assert "now: a request woke it: 1 request(s) held" in waking, waking
    assert "last change: 0 -> 1 (a request woke it" in waking, waking
    thread.join(timeout=30)
    assert streamed and streamed[0].startswith(b": waiting for a replica of chat to start\n\n")
    assert streamed[0].endswith(b"data: [DONE]\n\n"), streamed[0][-200:]
    wait_until(
        lambda: "waiting for a replica" not in shown(), 20, what="the page to show none held"
    )
