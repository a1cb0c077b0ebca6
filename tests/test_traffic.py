"""The fleet page's traffic (issue 36): the control plane's pure store of what routers
report (llmgw_core.traffic), the router's meter (router.traffic_meter), their frames
(route_feed.messages.Traffic) and the hub that takes them."""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from llmgw_core.traffic import (
    ALERT_MIN_REQUESTS,
    BUCKET_S,
    MODEL_KEEP,
    MODEL_ROW,
    PAGE_REPLICAS,
    REPLICA_KEEP,
    Sample,
    TrafficStore,
)
from llmgw_server.route_feed.hub import RouteHub
from llmgw_server.route_feed.messages import (
    MAX_TRAFFIC_ROWS,
    PROTOCOL,
    FeedError,
    Hello,
    Traffic,
    decode_table,
    decode_up,
    encode,
)
from llmgw_server.router.traffic_meter import MAX_ROWS, TrafficMeter

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def row(replica: str, requests: int, e5xx: int = 0, ttft: float | None = None) -> Sample:
    return Sample("chat", replica, requests, 0, e5xx, ttft, 0)


def test_reports_add_up_in_buckets_and_the_slowest_routers_p90_is_the_buckets() -> None:
    store = TrafficStore()
    store.add(1000.0, 5.0, [row(MODEL_ROW, 10, ttft=80.0), row(A, 10, ttft=80.0)])
    store.add(1001.0, 5.0, [row(MODEL_ROW, 4, e5xx=1, ttft=120.0), row(A, 4, e5xx=1)])
    store.add(1012.0, 5.0, [row(MODEL_ROW, 6)])  # the next bucket
    view = store.view(1015.0)["models"]["chat"]
    assert [p[:5] for p in view["points"]] == [[1000.0, 14, 0, 1, 120.0], [1010.0, 6, 0, 0, None]]
    assert view["minute"]["requests"] == 20 and view["minute"]["rps"] == pytest.approx(20 / 60)
    assert view["minute"]["ttft_p90_ms"] == 120.0
    assert [r["url"] for r in view["replicas"]] == [A]


def test_in_flight_is_the_routers_total_averaged_over_the_bucket() -> None:
    store = TrafficStore()
    # Two routers, each reporting 3 in flight twice in a bucket (every 5 s): 6 in all.
    for at in (1000.0, 1000.5, 1005.0, 1005.5):
        store.add(at, 5.0, [Sample("chat", MODEL_ROW, 0, 0, 0, None, 3)])
    assert store.view(1009.0)["models"]["chat"]["points"][0][5] == 6.0


def test_a_replica_answering_5xx_is_failing_and_listed_first() -> None:
    store = TrafficStore()
    store.add(1000.0, 5.0, [row(A, 100), row(B, ALERT_MIN_REQUESTS, e5xx=ALERT_MIN_REQUESTS)])
    assert store.failing("chat", B, 1005.0) and not store.failing("chat", A, 1005.0)
    replicas = store.view(1005.0)["models"]["chat"]["replicas"]
    assert [(r["url"], r["failing"]) for r in replicas] == [(B, True), (A, False)]
    # A minute later its errors are past the window: it no longer stands out.
    assert not store.failing("chat", B, 1000.0 + 60 + BUCKET_S + 1)
    # Too few answers to judge: one 500 of two is no pattern.
    store.add(1000.0, 5.0, [Sample("other", A, 2, 0, 1, None, 0)])
    assert not store.failing("other", A, 1005.0)


def test_what_is_kept_is_bounded() -> None:
    store = TrafficStore(max_series=3)
    for i in range(MODEL_KEEP + 50):
        store.add(i * BUCKET_S, 5.0, [row(MODEL_ROW, 1), row(A, 1)])
    view = store.view((MODEL_KEEP + 50) * BUCKET_S)["models"]["chat"]
    assert len(view["points"]) == MODEL_KEEP
    assert view["replicas"][0]["points"] == []  # the page is sent a replica's figures only
    assert len(store._series[("chat", A)]) == REPLICA_KEEP
    store.add(0.0, 5.0, [row(B, 1), row("http://c:1", 1), row("http://d:1", 1)])
    assert store.dropped == 2  # a third series fits, the others are counted
    # A series with nothing for an hour goes.
    late = (MODEL_KEEP + 50) * BUCKET_S + MODEL_KEEP * BUCKET_S + BUCKET_S
    store.add(late, 5.0, [])
    assert store.view(late)["models"] == {}


def test_the_page_gets_the_worst_replicas_only() -> None:
    store = TrafficStore()
    rows = [row(f"http://10.0.0.{i}:8000", 1 + i) for i in range(PAGE_REPLICAS + 10)]
    store.add(1000.0, 5.0, rows)
    view = store.view(1001.0)["models"]["chat"]
    assert len(view["replicas"]) == PAGE_REPLICAS and view["replicas_left_out"] == 10
    assert view["replicas"][0]["minute"]["requests"] == PAGE_REPLICAS + 10


@given(
    st.lists(
        st.tuples(
            st.floats(0, 7200),
            st.sampled_from([MODEL_ROW, A, B]),
            st.integers(0, 1000),
            st.integers(0, 1000),
        ),
        max_size=60,
    )
)
def test_no_request_is_lost_or_counted_twice_in_the_last_minute(
    reports: list[tuple[float, str, int, int]],
) -> None:
    store = TrafficStore()
    reports.sort()
    for at, replica, requests, e5xx in reports:
        store.add(at, 5.0, [Sample("chat", replica, requests, 0, e5xx, None, 0)])
    now = reports[-1][0] if reports else 0.0
    view = store.view(now)["models"]
    for replica in (MODEL_ROW, A, B):
        since = now - now % BUCKET_S - 60  # whole buckets overlapping the last minute
        expected = sum(r for at, rep, r, _ in reports if rep == replica and at >= since)
        doc = view.get("chat")
        if doc is None:
            assert expected == 0
            continue
        if replica == MODEL_ROW:
            got = doc["minute"]["requests"]
        else:
            got = sum(r["minute"]["requests"] for r in doc.get("replicas", []) if r["url"] == replica)
        assert got == expected


# -- the router's meter -----------------------------------------------------------


def test_the_meter_counts_by_model_and_replica_and_each_report_starts_afresh() -> None:
    meter = TrafficMeter()
    for ttfb in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        meter.finished("chat", A, 200, ttfb)
    meter.finished("chat", A, 404, 5.0)  # an error's time is no TTFT
    meter.failed("chat", B)  # tried on B first, which answered 500
    meter.finished("chat", None, 503, 0.0)  # refused by the router: the model's row only
    rows = {(s.model, s.replica): s for s in meter.report({("chat", A): 2})}
    assert rows[("chat", MODEL_ROW)] == Sample("chat", MODEL_ROW, 12, 1, 1, 900.0, 0)
    assert rows[("chat", A)] == Sample("chat", A, 11, 1, 0, 900.0, 2)
    assert rows[("chat", B)] == Sample("chat", B, 1, 0, 1, None, 0)
    assert meter.report({}) == ()  # nothing since, nothing in flight: nothing to say


def test_the_meter_is_bounded_and_keeps_the_models_and_the_failing_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    meter = TrafficMeter()
    for i in range(MAX_ROWS + 10):
        meter.finished("chat", f"http://10.0.{i // 250}.{i % 250}:1", 200, 0.1)
    assert meter.left_out == 11  # the model's row took one place
    assert [r.message for r in caplog.records].count(
        f"more than {MAX_ROWS} models and replicas answered within a traffic report's "
        "interval: the fleet page misses the others' (said once)"
    ) == 1
    meter.failed("chat", "http://10.0.0.0:1")
    rows = meter.report({}, limit=3)
    assert [r.replica for r in rows][:2] == [MODEL_ROW, "http://10.0.0.0:1"]


# -- the frames and the hub -------------------------------------------------------


def test_a_traffic_frame_round_trips_and_bad_ones_are_refused() -> None:
    message = Traffic(5.0, (row(MODEL_ROW, 3, e5xx=1, ttft=12.5), row(A, 3)))
    assert decode_up(encode(message)) == message
    good = json.loads(encode(message))
    for change, words in (
        ({"rows": [{**good["rows"][0], "requests": -1}]}, "negative"),
        ({"interval_s": 0}, "interval"),
        ({"rows": [good["rows"][1]] * (MAX_TRAFFIC_ROWS + 1)}, "over"),
    ):
        with pytest.raises(FeedError, match=words):
            decode_up(json.dumps({**good, **change}))


def test_tables_say_the_control_plane_takes_traffic_and_older_ones_do_not() -> None:
    hub = RouteHub()
    hub.publish({"chat": ()}, frozenset(), complete=True)
    assert decode_table(encode_routes(hub)).traffic
    older = json.loads(encode_routes(hub))
    del older["table"]["traffic"]
    assert not decode_table(json.dumps(older)).traffic


def encode_routes(hub: RouteHub) -> str:
    from llmgw_server.route_feed.messages import Routes

    return encode(Routes(hub.table))


class _Pipe:
    def __init__(self, frames: list[str]) -> None:
        self.frames = frames
        self.sent: list[str] = []

    async def send(self, text: str) -> None:
        self.sent.append(text)

    async def receive(self) -> str:
        if not self.frames:
            await trio.sleep_forever()
        return self.frames.pop(0)


async def test_the_hub_keeps_traffic_or_sums_it_for_its_relay(
    autojump_clock: trio.abc.Clock,
) -> None:
    frames = [
        encode(Hello(PROTOCOL, "r1")),
        encode(Traffic(5.0, (row(A, 3, e5xx=1, ttft=10.0),))),
        encode(Traffic(5.0, (row(A, 2, ttft=30.0),))),
    ]
    plane, relay = RouteHub(wall_clock=lambda: 1000.0), RouteHub(relays=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(plane.serve, _Pipe(list(frames)), "peer")
        nursery.start_soon(relay.serve, _Pipe(list(frames)), "peer")
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    replicas = plane.traffic.view(1001.0)["models"]["chat"]["replicas"]
    assert replicas[0]["minute"]["requests"] == 5 and replicas[0]["minute"]["e5xx"] == 1
    assert relay.take_traffic() == (row(A, 5, e5xx=1, ttft=30.0),)
    assert relay.take_traffic() == ()
    assert plane.take_traffic() == ()  # a control plane's hub keeps none for a relay
