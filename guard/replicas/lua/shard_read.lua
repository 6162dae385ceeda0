-- One replica's shared snapshot as a reader sees it. KEYS[1]: the hash shard_publish writes.
-- ARGV: the version n the reader holds ("-1": none).
-- Returns {Redis ms now, t, by, k, n, e, v}; v only when n differs from the reader's, else "".
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 't', 'by', 'k', 'n', 'e')
if not h[1] then
  return {now}
end
local v = ''
if h[4] ~= ARGV[1] then
  v = redis.call('HGET', KEYS[1], 'v') or ''
end
return {now, h[1], h[2], h[3], h[4] or '0', h[5] or '', v}
