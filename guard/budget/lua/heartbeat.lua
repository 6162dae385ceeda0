-- KEYS[1]: the live-guard zset (instance -> expiry ms), KEYS[2]: the epoch (a random value
-- the first guard to reach an empty Redis writes: a new epoch means the budgets were lost).
-- ARGV: instance id, ttl_ms, epoch candidate, epoch ttl_ms.
-- Records this guard as live; returns {guards live now, the epoch}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('SET', KEYS[2], ARGV[3], 'NX')
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2])}
