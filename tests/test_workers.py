"""`[server] workers = N`: the parent's pure decisions, then real processes on one port."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from fleet import Fleet, wait_until
from llmgw_server.router.metrics_merge import merge_pages, with_label
from llmgw_server.router.worker import (
    CONFIG,
    FEED,
    ChannelError,
    FrameReader,
    frame,
    tagged,
    untagged,
)
from llmgw_server.router.workers import (
    RestartPolicy,
    own_page,
    quick_exits_after,
    restart_delay_s,
)
from procs import Proc, Procs, metric, models_toml

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello workers"}]

# -- pure ------------------------------------------------------------------------------


def test_a_worker_that_ran_a_while_is_replaced_at_once_one_that_keeps_dying_backs_off() -> None:
    policy = RestartPolicy(stable_after_s=10, base_s=0.5, cap_s=4)
    quick = 0
    delays = []
    for _ in range(7):  # exits right after each start
        quick = quick_exits_after(quick, 0.2, policy)
        delays.append(restart_delay_s(quick, policy))
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    quick = quick_exits_after(quick, 11.0, policy)  # then it ran long enough: a fresh count
    assert (quick, restart_delay_s(quick, policy)) == (1, 0.0)


def test_labels_go_first_into_every_form_of_sample() -> None:
    assert with_label('a_total{model="m"} 3', "worker", "0") == 'a_total{worker="0",model="m"} 3'
    assert with_label("a_total 3", "worker", "1") == 'a_total{worker="1"} 3'
    assert with_label("a_total{} 3", "worker", "1") == 'a_total{worker="1"} 3'
    # A label value holding braces and spaces is left as it was.
    assert with_label('a{path="/x {y} z"} 1', "worker", "0") == 'a{worker="0",path="/x {y} z"} 1'


def test_merged_pages_hold_each_family_once_with_every_workers_samples_together() -> None:
    def page(n: int) -> str:
        return (
            "# HELP r_total Requests.\n# TYPE r_total counter\n"
            f'r_total{{status="200"}} {n}\n'
            "# HELP h_seconds Latency.\n# TYPE h_seconds histogram\n"
            f'h_seconds_bucket{{le="+Inf"}} {n}\nh_seconds_sum 0.5\nh_seconds_count {n}\n'
            "# HELP empty_total Nothing yet.\n# TYPE empty_total counter\n"
        )

    text = merge_pages({"0": page(3), "1": page(4)}, own=own_page(2, Counter({1: 2}), 2)).decode()
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("# TYPE")] == [
        "# TYPE r_total counter",
        "# TYPE h_seconds histogram",
        "# TYPE empty_total counter",
        "# TYPE llmgw_workers gauge",
        "# TYPE llmgw_worker_restarts_total counter",
    ]
    at = lines.index("# TYPE h_seconds histogram")
    assert lines[at + 1 : at + 7] == [
        'h_seconds_bucket{worker="0",le="+Inf"} 3',
        'h_seconds_sum{worker="0"} 0.5',
        'h_seconds_count{worker="0"} 3',
        'h_seconds_bucket{worker="1",le="+Inf"} 4',
        'h_seconds_sum{worker="1"} 0.5',
        'h_seconds_count{worker="1"} 4',
    ]
    assert 'r_total{worker="0",status="200"} 3' in lines
    assert "llmgw_workers 2" in lines and 'llmgw_worker_restarts_total{worker="1"} 2' in lines
    assert len(lines) == len(set(lines))


def test_frames_come_out_whole_however_the_bytes_are_cut() -> None:
    data = frame(CONFIG, tagged(7, b"x" * 1000)) + frame(FEED, b'{"type":"routes"}') + frame(FEED)
    for cut in (1, 3, 5, 700, len(data)):
        reader = FrameReader()
        got = []
        for at in range(0, len(data), cut):
            got += reader.feed(data[at : at + cut])
        assert got == [(CONFIG, tagged(7, b"x" * 1000)), (FEED, b'{"type":"routes"}'), (FEED, b"")]
    assert untagged(tagged(12, b"page\nmore")) == (12, b"page\nmore")
    with pytest.raises(ChannelError, match="unknown frame kind"):
        FrameReader().feed(struct.pack(">IB", 0, ord("z")))
    with pytest.raises(ChannelError, match="exceeds"):
        FrameReader().feed(struct.pack(">IB", 1 << 30, ord("f")))
    with pytest.raises(ChannelError, match="without its number"):
        untagged(b"nope\n")


# -- real processes ----------------------------------------------------------------------


def served_by(headers: Any) -> tuple[int, int]:
    """(worker index, pid) from the x-llmgw-worker header: "0; pid=1234"."""
    index, _, pid = headers["x-llmgw-worker"].partition("; pid=")
    return int(index), int(pid)


def client(url: str, *, keep_alive: bool = True) -> openai.OpenAI:
    limits = httpx2.Limits(max_keepalive_connections=None if keep_alive else 0)
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="x",
        max_retries=0,
        timeout=20,
        http_client=httpx2.Client(limits=limits, timeout=20),  # openai is typed against its fork
    )


def ask(c: openai.OpenAI, model: str = "m") -> tuple[int, int]:
    raw = c.chat.completions.with_raw_response.create(model=model, messages=CHAT)
    assert raw.parse().choices[0].message.content
    return served_by(raw.headers)


def totals(text: str, name: str) -> Counter[str]:
    """The sum of a family's samples per worker label."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            worker = labels.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] += int(float(value))
    return out


def two_workers(procs: Procs, engine: Proc, more: str = "") -> Proc:
    return procs.router(
        "[router]\nhealth_interval_s = 0.5\n" + models_toml({"m": [engine.url]}),
        server=f"workers = 2\nshutdown_grace_s = 5\n{more}",
    )


def test_two_workers_serve_one_port_and_metrics_count_every_request_once(procs: Procs) -> None:
    engine = procs.mock("m")
    router = two_workers(procs, engine)
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def loop(n: int) -> None:
        c = client(router.url, keep_alive=False)  # a connection per request: any worker
        for _ in range(n):
            index, _ = ask(c)
            with lock:
                seen[index] += 1

    threads = [threading.Thread(target=loop, args=(15,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(seen.values()) == 60
    # Both workers answer on the one port (each asked while the other is paused: which
    # one the kernel wakes for a connection is not this test's business).
    for index in (0, 1):
        with only_worker_accepts(router, index):
            assert ask(client(router.url, keep_alive=False))[0] == index
        seen[index] += 1
    page = httpx.get(router.url + "/metrics", timeout=10).text
    # Scraped from either worker, the page holds both, and counts each request once.
    assert totals(page, "llmgw_requests_total") == Counter({"0": seen[0], "1": seen[1]})
    assert metric(page, "llmgw_workers") == 2
    assert page.count("# TYPE llmgw_requests_total counter") == 1
    assert metric(page, "llmgw_replica_available", worker="1", model="m") == 1
    for _ in range(4):  # every scrape, wherever it lands, says the same
        again = httpx.get(router.url + "/metrics", timeout=10).text
        assert totals(again, "llmgw_requests_total") == totals(page, "llmgw_requests_total")


class Loop(threading.Thread):
    """Requests one after another, never retried; each outcome kept with its time."""

    def __init__(self, url: str, *, keep_alive: bool) -> None:
        super().__init__(daemon=True)
        self.client = client(url, keep_alive=keep_alive)
        self.outcomes: list[tuple[float, tuple[int, int] | str]] = []
        self.stopping = False

    def run(self) -> None:
        while not self.stopping:
            try:
                outcome: tuple[int, int] | str = ask(self.client)
            except (openai.APIError, AssertionError) as exc:
                outcome = repr(exc)
            self.outcomes.append((time.monotonic(), outcome))

    def answers(self) -> list[tuple[int, int]]:
        return [o for _, o in self.outcomes if isinstance(o, tuple)]

    def errors(self) -> list[str]:
        return [o for _, o in self.outcomes if isinstance(o, str)]


def test_a_worker_killed_under_load_is_replaced_and_the_port_never_stops_answering(
    procs: Procs,
) -> None:
    engine = procs.mock("m", "--mock-tokens", "4", "--mock-tokens-per-second", "200")
    router = two_workers(procs, engine)
    # Kept-alive connections stay with the worker that accepted them; a loop that opens
    # a connection per request reaches whichever worker accepts it. Two loops are pinned
    # to each worker, each started while the other worker is paused.
    fresh = Loop(router.url, keep_alive=False)
    pinned: list[Loop] = []
    loops = [fresh]
    fresh.start()
    try:
        for index in (0, 1, 0, 1):
            with only_worker_accepts(router, index):
                pinned.append(Loop(router.url, keep_alive=True))
                loops.append(pinned[-1])
                pinned[-1].start()
                wait_until(lambda: pinned[-1].outcomes, what="a first answer")
            assert [i for i, _ in pinned[-1].answers()[:1]] == [index], pinned[-1].outcomes
        wait_until(lambda: all(len(loop.answers()) >= 3 for loop in loops), what="answers")
        first = {loop: loop.answers()[0] for loop in pinned}
        assert {index for index, _ in first.values()} == {0, 1}, first
        victim = next(pid for index, pid in first.values() if index == 0)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        # The replacement serves under the same index, as a new process.
        wait_until(
            lambda: any(
                index == 0 and pid != victim for loop in loops for index, pid in loop.answers()
            ),
            what="the replacement worker",
        )
        counts = {loop: len(loop.outcomes) for loop in loops}
        wait_until(lambda: all(len(loop.outcomes) >= counts[loop] + 3 for loop in loops))
    finally:
        for loop in loops:
            loop.stopping = True
        for loop in loops:
            loop.join(30)
    for loop, (index, pid) in first.items():
        if index == 1:
            # On the other worker's connections the port answered throughout.
            assert loop.errors() == [] and {p for _, p in loop.answers()} == {pid}
        else:
            # At most the request the killed worker had in flight, then a new connection.
            assert len(loop.errors()) <= 1, loop.errors()
            assert isinstance(loop.outcomes[-1][1], tuple)
    assert len(fresh.errors()) <= 1, fresh.errors()
    # Requests went on being answered while the killed worker was being replaced.
    assert any(at > killed_at for loop in pinned for at, o in loop.outcomes if isinstance(o, tuple))
    page = httpx.get(router.url + "/metrics", timeout=10).text
    # Each exit the parent saw, with its cause, for a count that is not the one kill.
    exits = [line for line in router.output().splitlines() if "llmgw.workers worker " in line]
    assert metric(page, "llmgw_worker_restarts_total", worker="0") == 1, exits
    assert metric(page, "llmgw_worker_restarts_total", worker="1") == 0, exits
    assert metric(page, "llmgw_workers") == 2
    assert "worker 0 exited (killed by SIGKILL)" in router.output()


def worker_pids(router: Proc) -> set[int]:
    return {
        int(line.rsplit("(pid ", 1)[1].rstrip(")"))
        for line in router.output().splitlines()
        if "llmgw.workers worker " in line and " started (pid " in line
    }


def serving_workers(router: Proc) -> int:
    """How many workers the parent has seen ready (their READY frame read)."""
    return sum(
        "llmgw.workers worker " in line and line.endswith(" serving")
        for line in router.output().splitlines()
    )


def worker_pid(router: Proc, index: int) -> int:
    """The pid of worker `index` as last started."""
    started = f"llmgw.workers worker {index} started (pid "
    lines = [line for line in router.output().splitlines() if started in line]
    return int(lines[-1].rsplit("(pid ", 1)[1].rstrip(")"))


@contextmanager
def only_worker_accepts(router: Proc, index: int) -> Iterator[None]:
    """Every other worker stopped (SIGSTOP) for the block: a connection made in it is
    accepted by worker `index`, whatever order the kernel would wake them in."""
    others = [worker_pid(router, i) for i in (0, 1) if i != index]
    for pid in others:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: all(process_state(pid) == "T" for pid in others), what="a pause")
        yield
    finally:
        for pid in others:
            os.kill(pid, signal.SIGCONT)


def process_state(pid: int) -> str:
    """R, S, T (stopped)...: the third field of /proc/PID/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Stream(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = client(url, keep_alive=False)
        self.worker: int | None = None
        self.chunks = 0
        self.first = threading.Event()
        self.error: str | None = None
        self.finished = False

    def run(self) -> None:
        try:
            raw = self.client.chat.completions.with_raw_response.create(
                model="m",
                messages=CHAT,
                stream=True,
            )
            self.worker = served_by(raw.headers)[0]
            for chunk in raw.parse():
                self.chunks += 1
                self.first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finished = True
        except openai.APIError as exc:
            self.error = repr(exc)
        finally:
            self.first.set()


def test_sigterm_drains_every_worker_then_leaves_no_process(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "20", "--mock-tokens-per-second", "10")
    router = two_workers(procs, engine)
    pids = worker_pids(router)
    assert len(pids) == 2
    # One stream in flight on each worker: each started while the other worker is paused
    # (which worker the kernel hands a connection is not this test's business).
    streams: list[Stream] = []
    for index in (0, 1):
        with only_worker_accepts(router, index):
            streams.append(Stream(router.url))
            streams[-1].start()
            assert streams[-1].first.wait(20)
        assert streams[-1].worker == index
    router.signal(signal.SIGTERM)
    for s in streams:
        s.join(30)
    assert [(s.error, s.finished) for s in streams] == [(None, True)] * len(streams)
    assert router.popen.wait(15) == 0
    wait_until(lambda: all(gone(pid) for pid in pids), timeout=10, what="workers to exit")
    out = router.output()
    assert out.count("shutting down: no new connections") == 2 and "requests still in" not in out


def test_workers_whose_parent_is_killed_drain_and_exit(procs: Procs) -> None:
    engine = procs.mock("m", "--mock-tokens", "10", "--mock-tokens-per-second", "10")
    router = two_workers(procs, engine)
    # /readyz answers once one worker serves. Killed before it has read the other's
    # READY, the parent leaves that worker a reset channel ("the channel to the parent
    # broke"), or no second worker at all: both are right, and not what this test asks.
    wait_until(lambda: serving_workers(router) == 2, what="both workers serving")
    pids = worker_pids(router)
    stream = Stream(router.url)
    stream.start()
    assert stream.first.wait(20)
    router.signal(signal.SIGKILL)
    stream.join(30)
    assert (stream.error, stream.finished) == (None, True)  # its worker finished it first
    wait_until(lambda: all(gone(pid) for pid in pids), timeout=15, what="workers to exit")
    assert router.output().count("the parent is gone: stopping") == 2


def test_one_worker_is_the_single_process_as_before(procs: Procs) -> None:
    engine = procs.mock("m")
    router = procs.router(models_toml({"m": [engine.url]}), server="workers = 1")
    raw = client(router.url).chat.completions.with_raw_response.create(model="m", messages=CHAT)
    assert "x-llmgw-worker" not in raw.headers
    assert worker_pids(router) == set()
    page = httpx.get(router.url + "/metrics").text
    assert 'llmgw_requests_total{model="m",status="200"} 1' in page and "worker=" not in page


# -- with a control plane ----------------------------------------------------------------


def port_of(replica: dict[str, Any]) -> str:
    """A replica as the engine names itself in its answers' system_fingerprint."""
    return "mock:" + str(replica["url"]).rsplit(":", 1)[1]


def fresh_client(url: str) -> openai.OpenAI:
    return client(url, keep_alive=False)


def test_with_a_control_plane_both_workers_follow_the_replicas_and_sessions_keep_theirs(
    fleet: Fleet,
) -> None:
    from test_fleet_e2e import model

    fleet.server(model("chat", replicas=2), workers=2)
    fleet.agent("gpu-1", "node-2xl4.toml")
    serving = wait_until(
        lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None,
        what="two replicas",
    )
    urls = {r["url"] for r in serving}

    def followed() -> bool:
        page = httpx.get(fleet.url + "/metrics", timeout=10).text
        return all(
            metric(page, "llmgw_replica_available", worker=w, model="chat", endpoint=url) == 1
            for w in ("0", "1")
            for url in urls
        )

    wait_until(followed, what="both workers to follow both replicas")
    c = fresh_client(fleet.url)

    def ask_session(session: str) -> tuple[int, str]:
        raw = c.chat.completions.with_raw_response.create(
            model="chat",
            messages=CHAT,
            extra_headers={"x-session-id": session},
        )
        return served_by(raw.headers)[0], raw.parse().system_fingerprint or ""

    replicas: dict[str, set[str]] = {}
    # Each worker in turn takes every session (the other paused meanwhile).
    assert fleet.server_proc is not None
    for index in (0, 1):
        with only_worker_accepts(fleet.server_proc, index):
            for n in range(8):
                worker, replica = ask_session(f"session-{n}")
                assert worker == index
                replicas.setdefault(f"session-{n}", set()).add(replica)
    # Whichever worker a request lands on, a session stays with its replica.
    assert all(len(r) == 1 for r in replicas.values()), replicas
    assert len(set().union(*replicas.values())) == 2  # sessions spread over both replicas


def test_with_workers_a_drain_moves_replicas_and_a_request_loop_sees_no_error(
    fleet: Fleet,
) -> None:
    from test_fleet_e2e import RequestLoop, model

    fleet.server(model("chat", replicas=2), workers=2)
    slow = 'LLMGW_MOCK_STARTUP_DELAY = "1.5", LLMGW_MOCK_TPS = "40"'
    fleet.agent("gpu-1", "node-2xl4.toml", env=slow)
    old = wait_until(
        lambda: fleet.serving("chat") if len(fleet.serving("chat")) == 2 else None,
        what="both replicas on gpu-1",
    )
    fleet.agent("gpu-2", "node-2xl4.toml", env=slow)
    wait_until(lambda: fleet.node("gpu-2")["status"] == "reachable", what="gpu-2 to register")
    wait_until(
        lambda: [m.id for m in fresh_client(fleet.url).models.list()] == ["chat"],
        what="the workers to follow",
    )
    loops = [RequestLoop(fresh_client(fleet.url)) for _ in range(3)]  # on either worker
    for loop in loops:
        loop.__enter__()
    old_ports = {port_of(r) for r in old}

    def served() -> set[str]:
        return set().union(*(loop.served_by for loop in loops))

    def workers_served() -> set[str]:
        page = httpx.get(fleet.url + "/metrics", timeout=10).text
        chat = "\n".join(line for line in page.splitlines() if 'model="chat"' in line)
        return set(totals(chat, "llmgw_requests_total"))

    try:
        # Which replica a worker picks, and which worker the kernel hands a connection,
        # are theirs to choose: on a starved machine a few requests can all go one way.
        # So the loops run until each old replica and both workers have served (not for
        # a fixed count), and after the drain until each new replica has.
        wait_until(
            lambda: all(loop.done >= 4 for loop in loops) and served() >= old_ports,
            what="requests on both old replicas before the drain",
        )
        drain = fleet.cli("drain", "gpu-1", timeout=60)
        assert drain.returncode == 0, drain.stderr
        new = fleet.serving("chat")
        assert [r["shards"][0]["node"] for r in new] == ["gpu-2", "gpu-2"]
        new_ports = {port_of(r) for r in new}
        after = [loop.done for loop in loops]
        wait_until(
            lambda: (
                all(loop.done >= n + 4 for loop, n in zip(loops, after, strict=True))
                and served() >= new_ports
                and workers_served() == {"0", "1"}
            ),
            what="requests on both new replicas, and both workers serving",
        )
    finally:
        for loop in loops:
            loop.__exit__()
    assert [loop.errors for loop in loops] == [[], [], []]
    assert drain.stdout.splitlines()[-1] == "gpu-1: drained, no replica left on it"
    # The loops ran on the old replicas, then on the new ones, and on no other.
    assert served() == old_ports | new_ports


# -- a router apart with workers: the parent's relay, in one process -----------------------


async def test_the_relay_hands_tables_down_and_the_workers_counts_up_under_the_planes_version() -> (
    None
):
    import trio

    from llmgw_core.catalog import Endpoint
    from llmgw_core.config import parse_config
    from llmgw_server.route_feed.connection import local_pair
    from llmgw_server.route_feed.follower import Follower
    from llmgw_server.route_feed.hub import RouteHub
    from llmgw_server.route_feed.relay import TableRelay
    from llmgw_server.router.front import Router
    from llmgw_server.router.replica import Replica

    a, b = Endpoint("127.0.0.1", 9001, api_key="k"), Endpoint("127.0.0.1", 9002)
    config = parse_config({"models": [{"name": "static", "endpoints": ["http://s:1"]}]}, "t.toml")
    plane, local = RouteHub(), RouteHub()  # the control plane's, the parent's for its workers
    for n in range(3):  # the plane's versions run ahead of the relay's hub's
        plane.publish({f"other-{n}": (b,)}, frozenset(), complete=True)
    relay = TableRelay(local, "relay")
    routers = [Router(config), Router(config)]  # two workers

    def chat_replica(router: Router) -> Replica:
        found = router.served.replica("chat", a)
        assert found is not None
        return found

    async def until(check: Any, hub: RouteHub) -> None:
        with trio.fail_after(5):
            while not check():
                await hub.wait_reported()

    async with trio.open_nursery() as nursery:
        up_plane, up_relay = local_pair()
        nursery.start_soon(plane.serve, up_plane, "relay")
        nursery.start_soon(relay.follow, up_relay)
        for i, router in enumerate(routers):
            hub_end, worker_end = local_pair()
            nursery.start_soon(local.serve, hub_end, f"worker {i}")
            nursery.start_soon(Follower(router.served, f"worker {i}").follow, worker_end)
        version = plane.publish({"chat": (a, b)}, frozenset(), complete=True)
        await until(lambda: plane.caught_up(version) and local.followers == 2, plane)
        await until(lambda: local.caught_up(local.table.version), local)
        for router in routers:
            assert [r.endpoint for r in router.served.balancers["chat"].replicas] == [a, b]
        # A drain: the plane sees the sum of what both workers have in flight on it.
        chat_replica(routers[0]).outstanding = 2
        chat_replica(routers[1]).outstanding = 1
        version = plane.publish({"chat": (a, b)}, frozenset({a}), complete=True)
        await until(lambda: plane.caught_up(version) and plane.in_flight(a) == 3, plane)
        assert local.table.draining == {a} and local.table.version < version  # its own numbers
        assert all(chat_replica(r).draining for r in routers)
        chat_replica(routers[0]).outstanding = 0
        chat_replica(routers[1]).outstanding = 0
        await until(lambda: plane.in_flight(a) == 0, plane)
        nursery.cancel_scope.cancel()
    assert relay.table is not None and relay.table.draining == frozenset({a})
