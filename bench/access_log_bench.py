#!/usr/bin/env python3
"""The access log's CPU cost per request: router_bench's plain case, side by side.

    .venv/bin/python bench/access_log_bench.py                  # about 1 minute
    .venv/bin/python bench/access_log_bench.py --baseline HEAD~1 --source HEAD

One mock engine; routers in front of it that differ only in `[server] access_log`
(on, the default: logfmt lines to stderr, which goes to a file here as it would to
journald; and off), and with --baseline a router from another revision of src/ (for
example the commit before the access log). Each round measures every router once per
connection count, in a new random order, with bench/router_bench.py's `measure` (wrk,
plain chat completions, router CPU from /proc); the medians over the rounds are
compared. The issue's budget: the log may cost at most 10% of the router's CPU per
request. Results are printed; process logs go to bench/results/router-logs/.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import router_bench as rb

BUDGET = 0.10


def export_source(rev: str, into: Path) -> Path:
    """src/ as it is at `rev`, in a directory of its own."""
    archive = subprocess.run(
        ["git", "-C", str(rb.ROOT), "archive", rev, "src"], capture_output=True, check=True
    )
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def start_router(name: str, engine_url: str, source: Path, server_lines: str) -> rb.Proc:
    config = rb.LOG_DIR / f"{name}.toml"
    rb.LOG_DIR.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:0"\nshutdown_grace_s = 2\n{server_lines}\n'
        f'\n[[models]]\nname = "{rb.MODEL}"\nendpoints = ["{engine_url}"]\n'
    )
    # The source tree comes first on sys.path, whatever PYTHONPATH router_bench sets.
    boot = f"import sys; sys.path.insert(0, {str(source)!r}); from llmgw_server.__main__ import cli; cli()"
    proc = rb.Proc(
        name,
        [sys.executable, "-c", boot, "--config", str(config)],
        r"listening on (http://127\.0\.0\.1:\d+)",
    )
    proc.wait_url()
    deadline = time.monotonic() + 15
    while rb.http_request("GET", proc.url + "/readyz")[0] != 200:
        if time.monotonic() > deadline or not proc.alive():
            raise rb.BenchError(f"{name} never became ready:\n{proc.log_tail()}")
        time.sleep(0.05)
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=int, default=3, help="seconds per wrk run (default 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--conns", default="1,32")
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument("--source", help="a git revision whose src/ the on/off routers run")
    p.add_argument("--baseline", help="a git revision whose src/ runs as a third router")
    args = p.parse_args()
    args.conns = [int(c) for c in args.conns.split(",")]
    if shutil.which("wrk") is None:
        print("access_log_bench: wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    rb.raise_nofile_limit()
    work = Path(tempfile.mkdtemp(prefix="llmgw-access-bench-"))
    try:
        source = rb.ROOT / "src"
        if args.source:
            source = export_source(args.source, work / "source")
        engine = rb.start_mock("engine", "--mock-tokens", str(rb.STREAM_TOKENS))
        routers = {
            "log on": start_router("router-log-on", engine.url, source, ""),
            "log off": start_router("router-log-off", engine.url, source, "access_log = false"),
        }
        if args.baseline:
            base = export_source(args.baseline, work / "baseline")
            routers[f"{args.baseline}"] = start_router("router-baseline", engine.url, base, "")
        cpu: dict[tuple[str, int], list[float]] = {(n, c): [] for n in routers for c in args.conns}
        rps: dict[tuple[str, int], list[float]] = {(n, c): [] for n in routers for c in args.conns}
        for round_no in range(args.rounds):
            print(f"round {round_no + 1}/{args.rounds}", flush=True)
            for conns in args.conns:
                order = list(routers)
                random.shuffle(order)
                for name in order:
                    router = routers[name]
                    print(f"  {name:>10}:", end="", flush=True)
                    row = rb.measure("router", router.url, "plain", conns, args, engine, router)
                    assert row.router_ms is not None
                    if row.wrk.error_count:
                        raise rb.BenchError(f"{name}: wrk errors {row.wrk.errors}")
                    cpu[(name, conns)].append(row.router_ms)
                    rps[(name, conns)].append(row.wrk.rps)
        for proc in rb.STARTED:
            proc.stop()  # a router writes the lines it still holds as it stops
        lines = access_log_lines(routers["log on"])
        print(f"\n## Access log cost, plain chat completions ({args.rounds} rounds, medians)\n")
        print("| router | conns | req/s | router CPU ms/req | vs log off |")
        print("|---|--:|--:|--:|--:|")
        for conns in args.conns:
            off = statistics.median(cpu[("log off", conns)])
            for name in routers:
                ms = statistics.median(cpu[(name, conns)])
                share = f"{(ms - off) / off * 100:+.1f}%"
                print(
                    f"| {name} | {conns} | {statistics.median(rps[(name, conns)]):.0f} "
                    f"| {ms:.3f} | {share} |"
                )
        print(f"\nThe router with the log on wrote {lines} access log lines.")
        for conns in args.conns:
            on = statistics.median(cpu[("log on", conns)])
            off = statistics.median(cpu[("log off", conns)])
            verdict = "PASS" if on <= off * (1 + BUDGET) else "OVER"
            print(f"c={conns}: the log costs {(on - off) / off * 100:+.1f}% (budget +10%): {verdict}")
    except rb.BenchError as exc:
        print(f"access_log_bench: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in rb.STARTED:
            if proc.alive():
                proc.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def access_log_lines(router: rb.Proc) -> int:
    return sum(line.startswith("time=") for line in router.log_path.read_text().splitlines())


if __name__ == "__main__":
    sys.exit(main())
