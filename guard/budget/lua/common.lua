-- Shared by every tenant script (prepended at load time). KEYS: the tenant's bucket hash,
-- lease zset (grant -> expiry ms) and grant hash (grant -> reserved tokens), all hash-tagged
-- kvguard:{tenant}:... so one script touches one Cluster slot. Time comes from Redis only.
local BUCKET, LEASES, GRANTS = KEYS[1], KEYS[2], KEYS[3]
local REFILL_MS = 60000       -- limits are per minute: an empty bucket is full again after this
local MAX_REAP = 1000          -- expired leases reclaimed per call (bounds the script's work)

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function refilled(level, stamp, cap, now)
  if cap <= 0 then return 0 end
  if not level then return cap end
  local v = tonumber(level) + (now - tonumber(stamp)) * cap / REFILL_MS
  if v > cap then return cap end
  return v
end

local function load_bucket(tpm, rpm, now)
  local r = redis.call('HMGET', BUCKET, 'tl', 'tt', 'rl', 'rt')
  return {tl = refilled(r[1], r[2], tpm, now), rl = refilled(r[3], r[4], rpm, now)}
end

local function clamp(v, cap)
  if v > cap then return cap end
  if v < -cap then return -cap end
  return v
end

-- Give back (or, negative, take) tokens and requests; a bucket never exceeds its limit.
local function credit(st, tokens, requests, tpm, rpm)
  if tpm > 0 then st.tl = clamp(st.tl + tokens, tpm) end
  if rpm > 0 then st.rl = clamp(st.rl + requests, rpm) end
end

-- Persist the bucket with a TTL equal to its time to refill; a full bucket is simply deleted.
local function save_bucket(st, tpm, rpm, now)
  local ttl = 0
  if tpm > 0 and st.tl < tpm then ttl = math.max(ttl, (tpm - st.tl) * REFILL_MS / tpm) end
  if rpm > 0 and st.rl < rpm then ttl = math.max(ttl, (rpm - st.rl) * REFILL_MS / rpm) end
  if ttl <= 0 then
    redis.call('DEL', BUCKET)
    return
  end
  redis.call('HSET', BUCKET, 'tl', tostring(st.tl), 'tt', now, 'rl', tostring(st.rl), 'rt', now)
  redis.call('PEXPIRE', BUCKET, math.ceil(ttl) + 1000)
end

-- Leases whose holder stopped renewing them: refund their tokens and their request.
local function reap(st, tpm, rpm, now)
  local gone = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, MAX_REAP)
  for _, g in ipairs(gone) do
    credit(st, tonumber(redis.call('HGET', GRANTS, g) or '0'), 1, tpm, rpm)
    redis.call('HDEL', GRANTS, g)
    redis.call('ZREM', LEASES, g)
  end
  return #gone
end

-- The lease keys live as long as their last lease plus one refill period (so a late reap
-- still refunds); empty ones are gone.
local function touch_leases(now)
  local last = redis.call('ZRANGE', LEASES, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', GRANTS)
    return
  end
  local ttl = math.max(1, tonumber(last[2]) - now) + REFILL_MS
  redis.call('PEXPIRE', LEASES, ttl)
  redis.call('PEXPIRE', GRANTS, ttl)
end

-- finishes: "grant used grant used ..." (used: tokens, or -1 to release), one string argument.
-- Settles (charge what was used, refund the rest) or releases (refund all) each grant still held
-- (the first mention of a grant counts); three Redis calls per FINISH_CHUNK grants.
local FINISH_CHUNK = 1000
local function finish_all(st, finishes, tpm, rpm)
  local ids, used, seen = {}, {}, {}
  for grant, u in string.gmatch(finishes, '(%S+) (%S+)') do
    if not seen[grant] then
      seen[grant] = true
      ids[#ids + 1] = grant
      used[#used + 1] = tonumber(u)
    end
  end
  local n = 0
  for first = 1, #ids, FINISH_CHUNK do
    local last = math.min(#ids, first + FINISH_CHUNK - 1)
    local reserved = redis.call('HMGET', GRANTS, unpack(ids, first, last))
    local held = {}
    for i = first, last do
      local tokens = reserved[i - first + 1]
      if tokens then
        if used[i] < 0 then
          credit(st, tonumber(tokens), 1, tpm, rpm)
        else
          credit(st, tonumber(tokens) - used[i], 0, tpm, rpm)
        end
        held[#held + 1] = ids[i]
      end
    end
    if #held > 0 then
      redis.call('HDEL', GRANTS, unpack(held))
      redis.call('ZREM', LEASES, unpack(held))
      n = n + #held
    end
  end
  return n
end
