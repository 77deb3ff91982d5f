-- refund.lua: give back units a gateway leased (or reserved) but did not use.
--
-- Runs on the shard's primary. The refund applies only to the window the units
-- were taken from: when that window has ended (its stored reset_at differs from
-- the one given), the units died with it and nothing changes. The count never
-- goes below 0.
--
-- KEYS[1]  the window hash: fields `count` and `reset_at` (ms since epoch)
-- ARGV[1]  units to give back (>= 1)
-- ARGV[2]  reset_at of the window the units came from, ms since the Unix epoch
--
-- Returns {used, reset_at} after the refund ({0, 0} when no such window is live).
local key = KEYS[1]
local units = tonumber(ARGV[1])
local from_reset_at = tonumber(ARGV[2])

local fields = redis.call("HMGET", key, "count", "reset_at")
local used = tonumber(fields[1])
local reset_at = tonumber(fields[2])
if not used or reset_at ~= from_reset_at then
  return {0, 0}
end
local back = math.min(units, used)
if back > 0 then
  used = redis.call("HINCRBY", key, "count", -back)
end
return {used, reset_at}
