-- refund.lua: give back units a gateway leased but did not use.
--
-- Runs on the shard's primary. The refund applies only to the window the units
-- were taken from: when that window has ended (its stored reset_at differs from
-- the one given), the units died with it and nothing changes. Only units the
-- gateway's lease record still holds go back: units whose record lapsed were
-- given back by lease.lua already (lease_ttl), and must not be given back twice.
-- The count never goes below 0.
--
-- KEYS[1]  the window hash: fields `count`, `reset_at` (ms since epoch), and
--          `h:ID` / `t:ID` per gateway holding units (see lease.lua)
-- ARGV[1]  units to give back (>= 1)
-- ARGV[2]  reset_at of the window the units came from, ms since the Unix epoch
-- ARGV[3]  the gateway's id (as in lease.lua)
--
-- Returns {used, reset_at} after the refund ({0, 0} when no such window is live).
local key = KEYS[1]
local units = tonumber(ARGV[1])
local from_reset_at = tonumber(ARGV[2])
local gateway = ARGV[3]

local fields = redis.call("HMGET", key, "count", "reset_at", "h:" .. gateway)
local used = tonumber(fields[1])
local reset_at = tonumber(fields[2])
local held = tonumber(fields[3]) or 0
if not used or reset_at ~= from_reset_at then
  return {0, 0}
end
local back = math.min(units, used, held)
if back > 0 then
  used = redis.call("HINCRBY", key, "count", -back)
end
if held - back > 0 then
  redis.call("HSET", key, "h:" .. gateway, held - back)
else
  redis.call("HDEL", key, "h:" .. gateway, "t:" .. gateway)
end
return {used, reset_at}
