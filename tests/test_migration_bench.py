"""bench/migration_bench.py: its parsing of a stream (the seam's gap, what failed), and a
small run end to end: no stream fails with migration on, some do with it off, and the
results file holds the figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import migration_bench as bench

from llmgw_mock_engine.engine import answer_text

ROOT = Path(__file__).resolve().parent.parent


def data(content: str | None = None, **extra: object) -> bytes:
    event: dict[str, object] = {"choices": [{"index": 0, "delta": {"content": content}}]}
    if content is None:
        event = {"choices": [], **extra}
    return b"data: " + json.dumps(event).encode()


def test_events_are_split_on_blank_lines_and_a_part_is_kept() -> None:
    assert bench.split_events(b"data: 1\n\n: c\n\ndata: 2") == ([b"data: 1", b": c"], b"data: 2")
    assert bench.split_events(b"") == ([], b"")


def test_the_seams_gap_is_taken_less_the_streams_median_gap() -> None:
    stamped = [
        (0.00, data("a")),
        (0.10, data(" b")),
        (0.20, data(" c")),
        (0.25, b": migrated"),
        (0.65, data(" d")),
        (0.75, data(" e")),
        (0.85, b"data: [DONE]"),
    ]
    items = bench.items_of(stamped)
    assert bench.chat_text(items) == "a b c d e"
    (gap,) = bench.seam_gaps(items)
    assert (gap.before, gap.after) == (0.20, 0.65)
    assert math.isclose(gap.usual, 0.10) and math.isclose(gap.added, 0.35)
    assert bench.seam_gaps(bench.items_of([(0.0, data("a")), (0.1, data(" b"))])) == []


def test_a_streams_failure_is_what_the_client_would_see() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    text = answer_text(body, 3)
    words = text.split(" ")
    whole = [(0.0, data(words[0]))] + [(0.0, data(" " + w)) for w in words[1:]]
    usage = [(0.0, data(usage={"completion_tokens": 3}))]
    done = [(0.0, b"data: [DONE]")]

    def failure(events: list[tuple[float, bytes]], status: int = 200) -> str | None:
        return bench.failure_of(status, None, bench.items_of(events), text, 3)

    assert failure(whole + usage + done) is None
    assert failure(whole + usage) == "no [DONE]"
    assert failure(whole[:-1] + usage + done) == "wrong text"
    assert failure(whole + done) == "wrong usage"
    assert failure([*whole, (0.0, b'data: {"error": {"message": "broke"}}')]) == "error event"
    assert failure(whole + usage + done, status=502) == "status"
    assert bench.failure_of(None, "ReadError: reset", [], text, 3) == "connection error"


@pytest.mark.long
def test_a_small_run_fails_no_stream_with_migration_and_some_without(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "migration_bench.py"), "--quick",
         "--streams", "9", "--tokens", "45", "--keep-streams", "6", "--keep-tokens", "400",
         "--keep-rate", "200", "--keep-stagger-s", "0.5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    out = json.loads((tmp_path / "migration.json").read_text())
    assert (tmp_path / "migration.md").read_text().startswith("# Stream migration benchmark")
    assert "--quick" in out["command"] and out["parameters"]["streams"] == 9
    kill, keep = out["summary"]["kill"], out["summary"]["keep"]
    assert kill["on"]["failed"] == 0, kill
    assert kill["off"]["failed"] > 0 and kill["off"]["migrated_streams"] == 0, kill
    assert kill["on"]["migrated_streams"] > 0, kill
    assert kill["on"]["router_migrations"].get("continued") == kill["on"]["seams"], kill
    for field in ("seam_added_p50_ms", "seam_added_p99_ms", "kill_to_next_p50_ms"):
        assert isinstance(kill["on"][field], float), kill
    for variant in ("on", "off"):
        assert keep[variant]["failed"] == 0, keep
        assert keep[variant]["tokens"] == 6 * 400
        assert keep[variant]["router_cpu_s"] > 0 and keep[variant]["idle_rss_bytes"] > 0
    per = out["summary"]["per_kept_stream"]
    assert set(per) == {"rss_bytes", "peak_bytes", "cpu_us_per_token"}
