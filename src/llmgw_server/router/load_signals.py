"""What an engine's own /metrics says about its load: pure, Prometheus text in, a LoadSignal out.

The names, checked against each engine:
- vLLM (vllm/v1/metrics/loggers.py): `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (0 to 1; `vllm:gpu_cache_usage_perc`, its name before 0.9, is read
  when the new one is absent);
- SGLang (python/sglang/srt/metrics/collector.py): `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage` (0 to 1);
- llama.cpp's llama-server started with `--metrics` (tools/server; read from the real
  server at commit 0c1e570): `llamacpp:requests_processing`, `llamacpp:requests_deferred`.
  It has no KV-cache gauge, and answers /metrics only with the engine key when it has one.

An engine may publish one series per engine core (vLLM's `engine` label under data
parallelism, SGLang's `dp_rank`): their requests are added up and the highest KV-cache use
is kept. Series from a tensor, pipeline or expert parallel rank other than 0 (`tp_rank`,
`pp_rank`, `moe_ep_rank`, ... any `*_rank` label but `dp_rank`) repeat rank 0's view of the
same batch and are skipped.
"""

from __future__ import annotations

import math
import re

import attrs

_RUNNING, _WAITING, _KV, _KV_OLD = range(4)
_NAMES: dict[str, tuple[str, int]] = {
    "vllm:num_requests_running": ("vllm", _RUNNING),
    "vllm:num_requests_waiting": ("vllm", _WAITING),
    "vllm:kv_cache_usage_perc": ("vllm", _KV),
    "vllm:gpu_cache_usage_perc": ("vllm", _KV_OLD),
    "sglang:num_running_reqs": ("sglang", _RUNNING),
    "sglang:num_queue_reqs": ("sglang", _WAITING),
    "sglang:token_usage": ("sglang", _KV),
    "llamacpp:requests_processing": ("llamacpp", _RUNNING),
    "llamacpp:requests_deferred": ("llamacpp", _WAITING),
}
_PREFIXES = ("vllm:", "sglang:", "llamacpp:")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@attrs.frozen
class LoadSignal:
    """One reading of an engine's queue and KV cache."""

    engine: str  # vllm | sglang | llamacpp: whose names the page used
    running: float  # requests in the running batch
    waiting: float  # requests queued behind it
    kv_usage: float | None = None  # 0 to 1; None where the engine publishes none

    @property
    def requests(self) -> float:
        return self.running + self.waiting


def parse_load(text: str) -> LoadSignal | None:
    """The load in a /metrics page; None when it has no running or waiting gauge we know."""
    sums = [0.0, 0.0]
    seen = [False, False]
    kv: list[float | None] = [None, None]  # the current name's, the pre-0.9 name's
    engine = ""
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        if 0 <= brace < space:
            name = line[:brace]
            end = line.rfind("}")
            if end < brace:
                continue
            if "rank=" in line[brace:end] and _other_rank(line[brace + 1 : end]):
                continue
            rest = line[end + 1 :].split()
        else:
            name = line[:space]
            rest = line[space:].split()
        known = _NAMES.get(name)
        if known is None or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        engine = engine or known[0]
        field = known[1]
        if field <= _WAITING:
            sums[field] += value
            seen[field] = True
        else:
            slot = field - _KV
            current = kv[slot]
            kv[slot] = value if current is None else max(current, value)
    if not any(seen):
        return None
    usage = kv[0] if kv[0] is not None else kv[1]
    if usage is not None:
        usage = min(usage, 1.0)
    return LoadSignal(engine=engine, running=sums[0], waiting=sums[1], kv_usage=usage)


def _other_rank(labels: str) -> bool:
    """Whether a series belongs to a parallel rank other than 0 (data parallel ranks count)."""
    for key, value in _LABEL.findall(labels):
        if key.endswith("_rank") and key != "dp_rank" and value != "0":
            return True
    return False
