-- The deciders that share the replicas' polling. KEYS[1]: zset decider id -> expiry ms.
-- ARGV: this decider's id, its ttl_ms ("0": leaving). Time comes from Redis only.
-- Returns the live deciders' ids (this one included unless it left).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = tonumber(ARGV[2])
if ttl_ms > 0 then
  redis.call('ZADD', KEYS[1], now + ttl_ms, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], math.max(ttl_ms, 1000) * 10)
return redis.call('ZRANGE', KEYS[1], 0, -1)
