-- check.lua: read callers' fixed windows without changing them (a CHECK).
--
-- Safe to run on a replica: it never writes. A window whose stored reset_at
-- has passed is reported as empty even though Redis may still hold it
-- (replicas do not expire keys on their own; primaries expire lazily).
-- Expiry is judged by the gateway's clock (ARGV), never by a Redis TTL.
--
-- One call reads any number of windows on one shard: every limit of a request
-- that lives on this shard, and the CHECKs of concurrent requests that the
-- gateway batched together (see src/limiter/store/redis/batch.rs).
--
-- KEYS[i]  a window hash: fields `count` (units used) and `reset_at` (ms since epoch)
-- ARGV[i]  now for KEYS[i], milliseconds since the Unix epoch, from the gateway's clock
--
-- Returns {used_1, reset_at_1, used_2, reset_at_2, ...}; {0, 0} for a key with no
-- live window.
local out = {}
for i = 1, #KEYS do
  local now = tonumber(ARGV[i])
  -- Both fields in one call so they belong to the same window.
  local fields = redis.call("HMGET", KEYS[i], "count", "reset_at")
  local used = tonumber(fields[1])
  local reset_at = tonumber(fields[2])
  -- Missing, half-written, or already past its reset: no live window.
  if not used or not reset_at or reset_at <= now then
    used = 0
    reset_at = 0
  end
  out[2 * i - 1] = used
  out[2 * i] = reset_at
end
return out
