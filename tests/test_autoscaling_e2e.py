"""Autoscaling end to end, as separate processes: a server, two agents with simulated GPUs
and mock engines that take a second to start. Under load the model scales up; after it,
down with drains; idle, to zero; and a request for it wakes it and is served. A request
loop runs through it all with a client that never retries, and sees no error."""

from __future__ import annotations

import threading
import time

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from fleet import Fleet, wait_until

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "scale me"}]
START_S = 1.0  # each engine's start, as the mock engine delays its readiness

MODEL = f"""
[[models]]
name = "chat"
[models.profile]
engine = "vllm"
model = "org/chat"
gpu_memory_gib = 20
args = ["--mock-tokens", "8", "--mock-tokens-per-second", "16", "--mock-startup-delay", "{START_S}"]
[models.autoscale]
min = 0
max = 3
target_in_flight = 2
scale_down_after_s = 3
idle_to_zero_s = 6
"""


class Loops:
    """Client threads sending chats back to back; every failure is kept."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.errors: list[str] = []
        self.done = 0
        self._stops: list[threading.Event] = []
        self._threads: list[threading.Thread] = []

    def start(self, count: int) -> None:
        for _ in range(count):
            stop = threading.Event()
            thread = threading.Thread(target=self._loop, args=(stop,), daemon=True)
            self._stops.append(stop)
            self._threads.append(thread)
            thread.start()

    def stop(self, count: int | None = None) -> None:
        """Stop the last `count` loops started (all by default) and wait for them."""
        count = len(self._stops) if count is None else count
        for _ in range(count):
            self._stops.pop().set()
            self._threads.pop().join(timeout=30)

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.client.chat.completions.create(model="chat", messages=CHAT)
                self.done += 1
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")


def models_status(fleet: Fleet) -> dict[str, object]:
    return next(m for m in fleet.status()["models"] if m["name"] == "chat")


def decided(autoscale: object) -> bool:
    """Status says why the autoscaler wants what it wants: its first cycle has run."""
    return isinstance(autoscale, dict) and autoscale["now"] is not None


def held_in_status(fleet: Fleet) -> int | None:
    """The requests held for chat, as status says; None while its reason does not say
    that a request woke it (the page read "steady: at its floor" beside "0 -> 1")."""
    autoscale = models_status(fleet)["autoscale"]
    assert isinstance(autoscale, dict)
    held = autoscale["held"]
    assert isinstance(held, int)
    woken = str(autoscale["now"]).startswith("a request woke it")
    return held if woken or not held else None


def test_a_model_scales_up_down_to_zero_and_wakes_without_a_failed_request(
    fleet: Fleet,
) -> None:
    fleet.server(MODEL, control="autoscale_interval_s = 0.5", workers=2)
    fleet.agent("gpu-1", "node-2xl4.toml")
    fleet.agent("gpu-2", "node-2xl4.toml")
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=60)
    wait_until(lambda: [m.id for m in client.models.list()] == ["chat"], what="the router")
    # At min 0 it starts at 0: no replica is loaded until a request wants one.
    wait_until(lambda: len(fleet.status()["nodes"]) == 2, what="both agents", timeout=30)
    wait_until(lambda: decided(models_status(fleet)["autoscale"]), what="its first cycle")
    assert models_status(fleet)["desired"] == 0 and not fleet.status()["replicas"]
    loops = Loops(client)
    try:
        # Six clients back to back: about six in flight, at two a replica: three.
        loops.start(6)
        wait_until(lambda: len(fleet.serving("chat")) == 3, what="scaling up to 3", timeout=40)
        status = models_status(fleet)
        assert status["desired"] == 3, status
        assert "in flight" in str(status["autoscale"]), status
        cli = fleet.cli("status")
        assert cli.returncode == 0, cli.stderr
        assert "AUTOSCALING" in cli.stdout and "0-3, target 2 in flight a replica" in cli.stdout
        # One client left: one replica does; the others drain while it sends.
        loops.stop(5)
        wait_until(lambda: len(fleet.serving("chat")) == 1, what="scaling down to 1", timeout=40)
        assert not loops.errors, loops.errors[:3]
        served = loops.done
        wait_until(lambda: loops.done > served + 3, what="requests after the scale-down")
    finally:
        loops.stop()
    assert not loops.errors, loops.errors[:3]
    # Idle: to zero, and the model is still listed (a request wakes it).
    wait_until(lambda: not fleet.status()["replicas"], what="scaling to zero", timeout=40)
    assert models_status(fleet)["desired"] == 0
    assert [m.id for m in client.models.list()] == ["chat"]
    # A streamed request wakes it: its client gets the head and a comment at once, and
    # status says the request is held (and why it scales) until a replica serves.
    started = time.monotonic()
    body = {"model": "chat", "stream": True, "messages": CHAT}
    with (
        httpx.Client(base_url=fleet.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        chunks = answer.iter_bytes()
        assert next(chunks) == b": waiting for a replica of chat to start\n\n"
        wait_until(lambda: held_in_status(fleet) == 1, what="status to show it held", timeout=10)
        rest = b"".join(chunks)
    waited = time.monotonic() - started
    assert rest.endswith(b"data: [DONE]\n\n") and b'"content"' in rest, rest[-300:]
    assert START_S <= waited < START_S + 15, waited
    # Routers report their load every LOAD_INTERVAL_S (at once only when they hold one):
    # status may show the answered request as held until the next report.
    wait_until(lambda: held_in_status(fleet) == 0, what="status to show none held", timeout=10)
    assert len(fleet.serving("chat")) == 1
    log = fleet.server_proc.output() if fleet.server_proc else ""
    assert "scaling chat from 0 to 1 replicas: 1 request(s) held" in log, log[-3000:]
