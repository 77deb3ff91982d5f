-- charge.lua: add cost to callers' fixed windows (a CHARGE).
--
-- Runs on the shard's primary. A window starts at the caller's first charge
-- and ends at reset_at = now + window; reset_at is stored beside the count so
-- every response in the window reports the same X-RateLimit-Reset (no TTL
-- arithmetic, no "wobble"). The key expires one second after reset_at so Redis
-- cleans up after the gateway has stopped trusting it.
--
-- One call charges any number of windows on one shard (every limit of a request
-- on this shard, and the CHARGEs of concurrent requests batched together).
--
-- KEYS[i]        a window hash: fields `count` (units used) and `reset_at` (ms since epoch)
-- ARGV[3i - 2]   cost for KEYS[i], units to add (>= 1)
-- ARGV[3i - 1]   window length for KEYS[i], milliseconds
-- ARGV[3i]       now for KEYS[i], milliseconds since the Unix epoch, from the gateway's clock
--
-- Returns {used_1, reset_at_1, used_2, reset_at_2, ...} after the charges.
local out = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local cost = tonumber(ARGV[3 * i - 2])
  local window = tonumber(ARGV[3 * i - 1])
  local now = tonumber(ARGV[3 * i])

  local fields = redis.call("HMGET", key, "count", "reset_at")
  local used = tonumber(fields[1])
  local reset_at = tonumber(fields[2])

  if not used or not reset_at or reset_at <= now then
    -- No window, a half-written one, or one that has closed but not yet been
    -- cleaned up: start a fresh window at this charge.
    used = cost
    reset_at = now + window
    redis.call("HSET", key, "count", cost, "reset_at", reset_at)
    -- Let Redis clean up one second after the gateway stops trusting the window.
    redis.call("PEXPIREAT", key, reset_at + 1000)
  else
    -- A live window: add the cost (HINCRBY returns the new count).
    used = redis.call("HINCRBY", key, "count", cost)
  end
  out[2 * i - 1] = used
  out[2 * i] = reset_at
end
return out
