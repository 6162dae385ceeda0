-- ARGV: tpm, rpm, charge tokens, charge requests (taken first, as in reserve.lua), finishes
-- (see finish_all). Settles or releases each grant still held (unknown ids are ignored: settle
-- and release are idempotent). Returns {number finished, remaining tokens, remaining requests}:
-- the guard's fresh view of the shared bucket.
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local st = load_bucket(tpm, rpm, now)
credit(st, -tonumber(ARGV[3]), -tonumber(ARGV[4]), tpm, rpm)
local n = finish_all(st, ARGV[5], tpm, rpm)
save_bucket(st, tpm, rpm, now)
touch_leases(now)
return {n, tostring(st.tl), tostring(st.rl)}
