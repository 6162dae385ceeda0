-- One replica's shared snapshot, written by the decider that polled it. KEYS[1]: hash
-- t (Redis ms when written), by (decider id), k (state kind), n (version of v), v (the
-- snapshot, JSON), e (why the last poll failed, "" when it did not).
-- ARGV: decider id, kind, snapshot ("" with e "": unchanged, only t moves), error, expire_ms.
-- Returns t.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 't', now, 'by', ARGV[1], 'k', ARGV[2], 'e', ARGV[4])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'v', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'n', 1)
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return now
