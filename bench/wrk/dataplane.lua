-- wrk script for the data-plane benchmark (bench/dataplane_bench.py).
--
-- POSTs OpenAI chat completions, plain or streamed, cycling through a fixed set of
-- conversations (one shared system prompt, then a user message of its own), so that a
-- cache-aware router has prefixes to learn and match, as with real traffic; every
-- gateway gets the same sequence. At the end it prints one machine-readable line:
--   BENCH {"requests": N, "duration_us": N, "bytes": N, "p50_us": N, ...}
--
-- Environment:
--   LLMGW_BENCH_MODEL          model name to ask for (default "bench")
--   LLMGW_BENCH_STREAM         "1" for a streamed answer (server-sent events)
--   LLMGW_BENCH_CONVERSATIONS  distinct conversations (default 64)
--   LLMGW_BENCH_DELAY_MS       a pause before each request on a connection (default none):
--                              a steady offered load below what the gateway can take
--   LLMGW_BENCH_KEY            an API key sent as Authorization: Bearer (default none)

local model = os.getenv("LLMGW_BENCH_MODEL") or "bench"
local stream = os.getenv("LLMGW_BENCH_STREAM") == "1"
local conversations = tonumber(os.getenv("LLMGW_BENCH_CONVERSATIONS") or "64")
local system = "You are a concise assistant for a benchmark. Answer in one short paragraph, "
  .. "plainly, without lists or headings, and never repeat the question back to the user."

local pause = tonumber(os.getenv("LLMGW_BENCH_DELAY_MS") or "0")
if pause > 0 then
  delay = function()
    return pause
  end
end

local prepared = {}
local next_one = 0

init = function(args)
  local headers = {
    ["Content-Type"] = "application/json",
    ["Accept"] = stream and "text/event-stream" or "application/json",
  }
  local key = os.getenv("LLMGW_BENCH_KEY") or ""
  if key ~= "" then
    headers["Authorization"] = "Bearer " .. key
  end
  for k = 1, conversations do
    local body = string.format(
      '{"model": "%s", "messages": [{"role": "system", "content": "%s"}, '
        .. '{"role": "user", "content": "Conversation %d: say something about foxes, '
        .. 'dogs and the number %d."}]%s}',
      model, system, k, k * 7919, stream and ', "stream": true' or '')
    prepared[k] = wrk.format("POST", "/v1/chat/completions", headers, body)
  end
end

request = function()
  next_one = next_one % conversations + 1
  return prepared[next_one]
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
