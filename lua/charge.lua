-- charge.lua: add `cost` units to a caller's fixed window (a CHARGE).
--
-- Runs on the shard's primary. A window starts at the caller's first charge
-- and ends at reset_at = now + window; reset_at is stored beside the count so
-- every response in the window reports the same X-RateLimit-Reset (no TTL
-- arithmetic, no "wobble"). The key expires one second after reset_at so Redis
-- cleans up after the gateway has stopped trusting it.
--
-- KEYS[1]  the window hash: fields `count` (units used) and `reset_at` (ms since epoch)
-- ARGV[1]  cost, units to add (>= 1)
-- ARGV[2]  window length, milliseconds
-- ARGV[3]  now, milliseconds since the Unix epoch, from the gateway's clock
--
-- Returns {used, reset_at_ms} after the charge.
local key = KEYS[1]
local cost = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local now = tonumber(ARGV[3])

local fields = redis.call("HMGET", key, "count", "reset_at")
local used = tonumber(fields[1])
local reset_at = tonumber(fields[2])

if not used or not reset_at or reset_at <= now then
  -- No window, a half-written one, or one that has closed but not yet been
  -- cleaned up: start a fresh window at this charge.
  reset_at = now + window
  redis.call("HSET", key, "count", cost, "reset_at", reset_at)
  -- Let Redis clean up one second after the gateway stops trusting the window.
  redis.call("PEXPIREAT", key, reset_at + 1000)
  return {cost, reset_at}
end

-- A live window: add the cost (HINCRBY returns the new count).
used = redis.call("HINCRBY", key, "count", cost)
return {used, reset_at}
