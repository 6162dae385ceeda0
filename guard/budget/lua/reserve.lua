-- ARGV: tpm, rpm, max_concurrent (0 = unlimited), tokens, lease_ms, grant id, then pending
-- (grant id, used | -1) pairs to finish first. Returns {granted 0|1, reason, retry_ms (-1 =
-- never), reclaimed leases, remaining tokens}. A denied request is charged nothing.
local tpm, rpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, lease_ms, grant = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local now = now_ms()
local st = load_bucket(tpm, rpm, now)
finish_all(st, 7, tpm, rpm)
local reclaimed = reap(st, tpm, rpm, now)

local function answer(ok, reason, retry_ms)
  save_bucket(st, tpm, rpm, now)
  touch_leases(now)
  return {ok, reason, retry_ms, reclaimed, tostring(st.tl)}
end

if maxc > 0 and redis.call('ZCARD', LEASES) >= maxc then
  local first = redis.call('ZRANGE', LEASES, 0, 0, 'WITHSCORES')
  return answer(0, 'concurrency_limit', math.min(1000, math.max(1, tonumber(first[2]) - now)))
end
if rpm > 0 and st.rl < 1 then
  return answer(0, 'rpm_limit', math.ceil((1 - st.rl) * REFILL_MS / rpm))
end
if tpm > 0 and tokens > tpm then
  return answer(0, 'tpm_limit', -1)
end
if tpm > 0 and st.tl < tokens then
  return answer(0, 'tpm_limit', math.ceil((tokens - st.tl) * REFILL_MS / tpm))
end
credit(st, -tokens, -1, tpm, rpm)
redis.call('HSET', GRANTS, grant, tokens)
redis.call('ZADD', LEASES, now + lease_ms, grant)
return answer(1, '', 0)
