"""bench/tenancy_bench.py's arithmetic: percentiles with requests never answered, Jain's
index, the worst 60 s window of a limit, the access log's times, a stream's usage and a
429's reason."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import tenancy_bench as bench


def test_a_percentile_counts_requests_never_answered_as_infinite() -> None:
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench.percentile([float(x) for x in range(1, 101)], 99) == 99.0
    assert bench.percentile([1.0] * 98 + [math.inf] * 2, 99) == math.inf
    assert math.isnan(bench.percentile([], 99))


def test_jains_index_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert bench.jain([5.0, 5.0]) == 1.0
    assert bench.jain([1.0, 0.0]) == 0.5
    assert abs(bench.jain([1.0, 0.8]) - 3.24 / 3.28) < 1e-12


def test_the_worst_window_starts_at_an_event_and_is_half_open() -> None:
    events = [(0.0, 10.0), (30.0, 5.0), (59.999, 1.0), (60.0, 100.0), (200.0, 7.0)]
    assert bench.max_window(events) == (106.0, 30.0)
    assert bench.max_window([(0.0, 10.0), (60.0, 10.0)]) == (10.0, 0.0)
    assert bench.max_window([])[0] == 0.0


def test_the_limit_check_allows_one_reservation_per_router_process() -> None:
    lines = [
        {"t": 0.0, "tenant": "D", "status": 200, "prompt_tokens": 900, "completion_tokens": 100},
        {"t": 10.0, "tenant": "D", "status": 200, "prompt_tokens": 150, "completion_tokens": 0},
        {"t": 20.0, "tenant": "D", "status": 429, "prompt_tokens": None},
        {"t": 30.0, "tenant": "A", "status": 200, "prompt_tokens": 5000, "completion_tokens": 1},
    ]
    # 1,150 in a window against 1,000: 150 past it; 5% would allow 50, but one reservation
    # (40 tokens) per router process (4) allows 160.
    check = bench.limit_check(lines, "D", 1000.0, reserved_one=40)
    assert (check["answered"], check["worst_window_tokens"], check["allowance"]) == (2, 1150.0, 160)
    assert check["ok"]
    assert not bench.limit_check(lines, "D", 1000.0, reserved_one=30)["ok"]


def test_the_access_logs_time_is_read_as_utc_with_milliseconds(tmp_path: Path) -> None:
    assert bench.log_time("1970-01-01T00:01:40.250Z") == 100.25
    log = tmp_path / "access.jsonl"
    line = {"time": "2024-05-01T12:00:00.001Z", "tenant": "D", "status": 200}
    log.write_text(json.dumps(line) + "\nnot json\n")
    read = bench.read_access_logs([log, tmp_path / "missing.jsonl"])
    assert len(read) == 1 and abs(read[0]["t"] - 1714564800.001) < 1e-6


def test_a_streams_usage_and_a_refusals_reason_are_read() -> None:
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    stream = (
        b'data: {"choices": [{"delta": {"content": ""}}]}\n\n'
        b'data: {"choices": [{"delta": {"content": "abc"}}]}\n\n'
        b'data: {"choices": [], "usage": ' + json.dumps(usage).encode() + b"}\n\n"
        b"data: [DONE]\n\n"
    )
    assert bench.usage_of(stream) == usage
    assert bench.usage_of(b"data: [DONE]\n\n") is None
    assert bench.FIRST_CONTENT.search(stream[:50]) is None  # the role's empty content
    assert bench.FIRST_CONTENT.search(stream) is not None
    message = "rate limit reached for the tenant 'A': wait for this model's engines; try again"
    assert bench.refusal_reason(message) == "queue_timeout"
    assert bench.refusal_reason("tenant 'D': tokens per minute; try again in 3 s") == "tokens"


def test_what_a_worker_sent_on_while_a_request_of_b_waited_is_counted() -> None:
    def rec(rid: str, tenant: str, worker: str) -> bench.Rec:
        return bench.Rec(tenant, rid, 0.0, 0, worker=worker)

    recs = [rec("b", "B", "w1"), rec("c1", "C", "w1"), rec("c2", "C", "w1"), rec("a", "A", "w2")]
    lines = [
        {"request_id": "b", "tenant": "B", "status": 200, "t": 10.0, "queued_ms": 2000.0},
        {"request_id": "c1", "tenant": "C", "status": 200, "t": 5.0, "queued_ms": 6000.0},
        {"request_id": "c2", "tenant": "C", "status": 200, "t": 10.5, "queued_ms": 500.0},
        {"request_id": "a", "tenant": "A", "status": 200, "t": 1.0, "queued_ms": 10000.0},
        {"request_id": "x", "tenant": "C", "status": 200, "t": 10.0, "queued_ms": 0.0},
    ]
    # c1 (arrived before) and c2 (after) left w1's queue while b waited (10 s to 12 s);
    # a is another worker's, x no client's.
    ahead = bench.dispatched_ahead(lines, recs)
    assert ahead == {"requests": 1, "ahead": {"C": 2.0}, "arrived_later": {"C": 1.0}}


def test_a_refusal_while_the_fleet_answered_fewer_than_the_limit_is_counted_below_it() -> None:
    lines = [
        {"request_id": "r1", "tenant": "E", "status": 200, "t": 0.0},
        {"request_id": "r2", "tenant": "E", "status": 429, "t": 1.0},
        {"request_id": "r2", "tenant": "E", "status": 200, "t": 4.5},
        {"request_id": "r3", "tenant": "E", "status": 200, "t": 2.0},
        {"request_id": "r4", "tenant": "E", "status": 429, "t": 5.0},
    ]
    # At 1 s one answered (below a limit of 2); at 5 s three (not below).
    found = bench.client_refusals(lines, "E", 2)
    assert found == {"refused": 2, "below_limit": 1, "longest_gap_s": 3.5}
