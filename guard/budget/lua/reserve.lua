-- ARGV: tpm, rpm, max_concurrent (0 = unlimited), charge tokens, charge requests (what a guard
-- decided on its local share while Redis was unusable: taken first; negative gives back), n,
-- then n requests (grant id, tokens, lease_ms) decided in order, then (grant id, used | -1)
-- pairs to finish first.
-- Returns {reclaimed leases, remaining tokens, remaining requests, then per request: granted
-- 0|1, reason, retry_ms (-1 = never)}. A denied request is charged nothing.
local tpm, rpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n = tonumber(ARGV[6])
local now = now_ms()
local st = load_bucket(tpm, rpm, now)
credit(st, -tonumber(ARGV[4]), -tonumber(ARGV[5]), tpm, rpm)
finish_all(st, 7 + 3 * n, tpm, rpm)
local reclaimed = reap(st, tpm, rpm, now)

local function decide(grant, tokens, lease_ms)
  if maxc > 0 and redis.call('ZCARD', LEASES) >= maxc then
    local first = redis.call('ZRANGE', LEASES, 0, 0, 'WITHSCORES')
    return {0, 'concurrency_limit', math.min(1000, math.max(1, tonumber(first[2]) - now))}
  end
  if rpm > 0 and st.rl < 1 then
    return {0, 'rpm_limit', math.ceil((1 - st.rl) * REFILL_MS / rpm)}
  end
  if tpm > 0 and tokens > tpm then
    return {0, 'tpm_limit', -1}
  end
  if tpm > 0 and st.tl < tokens then
    return {0, 'tpm_limit', math.ceil((tokens - st.tl) * REFILL_MS / tpm)}
  end
  credit(st, -tokens, -1, tpm, rpm)
  redis.call('HSET', GRANTS, grant, tokens)
  redis.call('ZADD', LEASES, now + lease_ms, grant)
  return {1, '', 0}
end

local out = {reclaimed, '', ''}
for i = 0, n - 1 do
  local base = 7 + 3 * i
  local r = decide(ARGV[base], tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]))
  out[#out + 1] = r[1]
  out[#out + 1] = r[2]
  out[#out + 1] = r[3]
end
save_bucket(st, tpm, rpm, now)
touch_leases(now)
out[2] = tostring(st.tl)
out[3] = tostring(st.rl)
return out
