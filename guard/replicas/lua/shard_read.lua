-- Replicas' shared snapshots as a reader sees them. KEYS: the hashes shard_publish writes.
-- ARGV: for each key, the version n the reader holds ("-1": none).
-- Returns {Redis ms now, then per key {} (nothing published) or {t, by, k, n, e, v}}, v only
-- when n differs from the reader's, else "".
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 't', 'by', 'k', 'n', 'e')
  if not h[1] then
    out[i + 1] = {}
  else
    local v = ''
    if h[4] ~= ARGV[i] then
      v = redis.call('HGET', key, 'v') or ''
    end
    out[i + 1] = {h[1], h[2], h[3], h[4] or '0', h[5] or '', v}
  end
end
return out
