-- check.lua: read a caller's fixed window without changing it (a CHECK).
--
-- Safe to run on a replica: it never writes. A window whose stored reset_at
-- has passed is reported as empty even though Redis may still hold it
-- (replicas do not expire keys on their own; primaries expire lazily).
-- Expiry is judged by the gateway's clock (ARGV[1]), never by a Redis TTL.
--
-- KEYS[1]  the window hash: fields `count` (units used) and `reset_at` (ms since epoch)
-- ARGV[1]  now, milliseconds since the Unix epoch, from the gateway's clock
--
-- Returns {used, reset_at_ms}; {0, 0} when there is no live window.
local key = KEYS[1]
local now = tonumber(ARGV[1])

-- Read both fields in one call so they belong to the same window.
local fields = redis.call("HMGET", key, "count", "reset_at")
local used = tonumber(fields[1])
local reset_at = tonumber(fields[2])

-- Missing, half-written, or already past its reset: no live window.
if not used or not reset_at or reset_at <= now then
  return {0, 0}
end

return {used, reset_at}
