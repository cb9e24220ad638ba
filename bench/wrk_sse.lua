-- wrk script for bench/ceiling.py: POSTs streaming chat requests and counts what came back.
--
--   wrk -t1 -c64 -d10s --timeout 60s -s bench/wrk_sse.lua http://127.0.0.1:8000 -- MODEL MAX_TOKENS PROMPTS
--
-- Each request is one of PROMPTS bodies (different ~100-word prompts, built once per thread), so a
-- prefix cache does not see the same prompt every time. Per completed response it counts the SSE events
-- that carry output (content, reasoning or completion text that is not empty), the output tokens (the
-- usage event's completion_tokens) and the non-200 answers; done() prints one JSON line with the totals.

local words = {"time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
               "child", "eye", "woman", "place", "work", "week", "case", "point", "government", "company",
               "number", "group", "problem", "fact", "river", "market", "letter", "mountain", "science"}
local threads = {}
local requests = {}
events, tokens, responses, bad = 0, 0, 0, 0

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  local model = args[1] or "builtin:tiny-gpt-oss"
  local max_tokens = tonumber(args[2] or "256")
  local n = tonumber(args[3] or "64")
  math.randomseed(12345)
  for i = 1, n do
    local prompt = {}
    for j = 1, 100 do
      prompt[j] = words[math.random(#words)]
    end
    local body = string.format('{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,'
      .. '"stream":true,"stream_options":{"include_usage":true},"temperature":0,"ignore_eos":true}',
      model, table.concat(prompt, " "), max_tokens)
    requests[i] = wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
  end
end

local next_request = 0

function request()
  next_request = next_request % #requests + 1
  return requests[next_request]
end

local keys = {'"content":"', '"reasoning_content":"', '"text":"'}

-- The number of events with output in one response body (each key at most once per event: a chunk
-- carries one delta).
local function output_events(body)
  local n = 0
  for _, key in ipairs(keys) do
    local at = 1
    while true do
      local i, j = string.find(body, key, at, true)
      if i == nil then break end
      if string.byte(body, j + 1) ~= 34 then  -- not an empty string
        n = n + 1
      end
      at = j + 1
    end
  end
  return n
end

function response(status, headers, body)
  responses = responses + 1
  if status ~= 200 then
    bad = bad + 1
    return
  end
  events = events + output_events(body)
  local used = string.match(body, '"completion_tokens":%s*(%d+)')
  if used then
    tokens = tokens + tonumber(used)
  end
end

function done(summary, latency, requests)
  local e, t, r, b = 0, 0, 0, 0
  for _, thread in ipairs(threads) do
    e = e + thread:get("events")
    t = t + thread:get("tokens")
    r = r + thread:get("responses")
    b = b + thread:get("bad")
  end
  io.write(string.format('WRK_RESULT {"duration_us":%d,"responses":%d,"bad":%d,"events":%d,"tokens":%d,'
    .. '"bytes":%d,"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
    .. '"latency_us":{"p50":%d,"p99":%d,"max":%d}}\n',
    summary.duration, r, b, e, t, summary.bytes, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.status, summary.errors.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
