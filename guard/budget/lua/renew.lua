-- ARGV: lease_ms, then grant ids. Extends each lease still held; returns how many were.
local lease_ms = tonumber(ARGV[1])
local now = now_ms()
local n = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', LEASES, ARGV[i]) then
    redis.call('ZADD', LEASES, now + lease_ms, ARGV[i])
    n = n + 1
  end
end
touch_leases(now)
return n
