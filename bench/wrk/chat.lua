-- wrk script for the router benchmark (bench/router_bench.py).
--
-- POSTs one OpenAI chat completion per request, plain or streamed (or, for the
-- static kind, GETs the URL as it is), and at the end prints one
-- machine-readable line that the benchmark parses:
--   BENCH {"requests": N, "duration_us": N, "bytes": N, "p50_us": N, ...}
--
-- Environment:
--   LLMGW_BENCH_MODEL   model name to ask for (default "bench")
--   LLMGW_BENCH_STREAM  "1" for a streamed answer (server-sent events)
--   LLMGW_BENCH_GET     "1" to send a plain GET instead (a static page, for calibration)
--   LLMGW_BENCH_TOKENS  optional max_tokens for the answer

local model = os.getenv("LLMGW_BENCH_MODEL") or "bench"
local stream = os.getenv("LLMGW_BENCH_STREAM") == "1"
local tokens = os.getenv("LLMGW_BENCH_TOKENS")

local body = '{"model": "' .. model .. '", "messages": [{"role": "user", "content": '
  .. '"Say something about foxes and dogs."}]'
if stream then
  body = body .. ', "stream": true'
end
if tokens and tokens ~= "" then
  body = body .. ', "max_tokens": ' .. tokens
end
body = body .. '}'

if os.getenv("LLMGW_BENCH_GET") == "1" then
  wrk.method = "GET"
else
  wrk.method = "POST"
  wrk.body = body
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Accept"] = stream and "text/event-stream" or "application/json"
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests": %d, "duration_us": %d, "bytes": %d, '
      .. '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, "mean_us": %.1f, '
      .. '"err_connect": %d, "err_read": %d, "err_write": %d, "err_status": %d, '
      .. '"err_timeout": %d}\n',
    summary.requests, summary.duration, summary.bytes,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout))
end
