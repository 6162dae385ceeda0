-- One replica's shared KV reservations. KEYS[1]: entries hash (guard|request id -> load),
-- KEYS[2]: lease zset (same field -> expiry ms); both tagged kvguard:{kv-<replica>}:... so one
-- script touches one Cluster slot. Time comes from Redis only.
-- ARGV: own prefix ("guard|"), lease_ms, n adds, then n (request id, load) pairs, m removes,
-- then m request ids, then request ids whose leases to renew.
-- Returns every other guard's live entry: field, load, field, load, ...
local ENTRIES, LEASES = KEYS[1], KEYS[2]
local prefix, lease_ms = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local gone = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, 1000)
for _, field in ipairs(gone) do
  redis.call('HDEL', ENTRIES, field)
  redis.call('ZREM', LEASES, field)
end

local n = tonumber(ARGV[3])
local i = 4
for _ = 1, n do
  redis.call('HSET', ENTRIES, prefix .. ARGV[i], ARGV[i + 1])
  redis.call('ZADD', LEASES, now + lease_ms, prefix .. ARGV[i])
  i = i + 2
end
local m = tonumber(ARGV[i])
i = i + 1
for _ = 1, m do
  redis.call('HDEL', ENTRIES, prefix .. ARGV[i])
  redis.call('ZREM', LEASES, prefix .. ARGV[i])
  i = i + 1
end
for j = i, #ARGV do
  if redis.call('ZSCORE', LEASES, prefix .. ARGV[j]) then
    redis.call('ZADD', LEASES, now + lease_ms, prefix .. ARGV[j])
  end
end

local last = redis.call('ZRANGE', LEASES, -1, -1, 'WITHSCORES')
if #last == 0 then
  redis.call('DEL', ENTRIES, LEASES)
  return {}
end
local ttl = math.max(1, tonumber(last[2]) - now) + 1000
redis.call('PEXPIRE', ENTRIES, ttl)
redis.call('PEXPIRE', LEASES, ttl)

local out = {}
local all = redis.call('HGETALL', ENTRIES)
for k = 1, #all, 2 do
  if string.sub(all[k], 1, #prefix) ~= prefix then
    out[#out + 1] = all[k]
    out[#out + 1] = all[k + 1]
  end
end
return out
