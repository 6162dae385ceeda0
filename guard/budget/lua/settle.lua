-- ARGV: tpm, rpm, then (grant id, used | -1) pairs. Settles or releases each grant still held
-- (unknown ids are ignored: settle and release are idempotent). Returns the number finished.
local tpm, rpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local st = load_bucket(tpm, rpm, now)
local n = finish_all(st, 3, tpm, rpm)
save_bucket(st, tpm, rpm, now)
touch_leases(now)
return n
