-- ARGV: tpm, rpm, max_concurrent (0 = unlimited), charge tokens, charge requests (what a guard
-- decided on its local share while Redis was unusable: taken first; negative gives back),
-- reserves: "grant tokens lease_ms grant tokens lease_ms ..." decided in order, finishes (see
-- finish_all: settled or released first). Two string arguments instead of one per field: the
-- client encodes two strings, not five values per request.
-- Returns {reclaimed leases, remaining tokens, remaining requests, decisions}: decisions is one
-- string, a word per request in order, "1" granted or "reason:retry_ms" (retry_ms -1 = never).
-- A denied request is charged nothing. The grants are written with one HSET and one ZADD.
local tpm, rpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local st = load_bucket(tpm, rpm, now)
credit(st, -tonumber(ARGV[4]), -tonumber(ARGV[5]), tpm, rpm)
finish_all(st, ARGV[7], tpm, rpm)
local reclaimed = reap(st, tpm, rpm, now)

local num_held = 0  -- leases held, those granted below included
if maxc > 0 then num_held = redis.call('ZCARD', LEASES) end
local first_expiry = nil  -- the earliest lease expiry (read once, on a concurrency denial)
local granted = {}  -- grant, tokens, ... (HSET) and expiry, grant, ... (ZADD)
local expiries = {}

local function earliest_expiry()
  if first_expiry == nil then
    local first = redis.call('ZRANGE', LEASES, 0, 0, 'WITHSCORES')
    first_expiry = first[2] and tonumber(first[2]) or math.huge
    for i = 1, #expiries, 2 do first_expiry = math.min(first_expiry, expiries[i]) end
  end
  return first_expiry
end

local function decide(grant, tokens, lease_ms)
  if maxc > 0 and num_held >= maxc then
    return 'concurrency_limit:' .. math.min(1000, math.max(1, earliest_expiry() - now))
  end
  if rpm > 0 and st.rl < 1 then
    return 'rpm_limit:' .. math.ceil((1 - st.rl) * REFILL_MS / rpm)
  end
  if tpm > 0 and tokens > tpm then
    return 'tpm_limit:-1'
  end
  if tpm > 0 and st.tl < tokens then
    return 'tpm_limit:' .. math.ceil((tokens - st.tl) * REFILL_MS / tpm)
  end
  credit(st, -tokens, -1, tpm, rpm)
  num_held = num_held + 1
  granted[#granted + 1] = grant
  granted[#granted + 1] = tokens
  expiries[#expiries + 1] = now + lease_ms
  expiries[#expiries + 1] = grant
  if first_expiry ~= nil then first_expiry = math.min(first_expiry, now + lease_ms) end
  return '1'
end

local decisions = {}
for grant, tokens, lease_ms in string.gmatch(ARGV[6], '(%S+) (%S+) (%S+)') do
  decisions[#decisions + 1] = decide(grant, tonumber(tokens), tonumber(lease_ms))
end
if #granted > 0 then
  redis.call('HSET', GRANTS, unpack(granted))
  redis.call('ZADD', LEASES, unpack(expiries))
end
save_bucket(st, tpm, rpm, now)
touch_leases(now)
return {reclaimed, tostring(st.tl), tostring(st.rl), table.concat(decisions, ' ')}
