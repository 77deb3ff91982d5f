-- lease.lua: take up to `want` units of a caller's fixed window for one gateway
-- to admit from locally (lease mode, `[[limits]] lease = N`).
--
-- Runs on the shard's primary. The units granted are counted in the window at
-- once, so the units admitted by all gateways together never exceed the quota:
-- a gateway admits only units it was granted here. Starts a window (like
-- apply.lua's CHARGE) when none is live and something is granted.
--
-- KEYS[1]  the window hash: fields `count` and `reset_at` (ms since epoch)
-- ARGV[1]  want: units asked for (>= 1)
-- ARGV[2]  quota: units per window for this caller's tier
-- ARGV[3]  window length, milliseconds
-- ARGV[4]  now, milliseconds since the Unix epoch, from the gateway's clock; 0
--          (store.clock = "redis"): this node's TIME, floored to milliseconds
--
-- Returns {granted, used, reset_at}: units granted (0 when the window is full),
-- the window's count after the grant, and its reset (now + window when no window
-- is live and nothing was granted).
local key = KEYS[1]
local want = tonumber(ARGV[1])
local quota = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if now == 0 then
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local fields = redis.call("HMGET", key, "count", "reset_at")
local used = tonumber(fields[1])
local reset_at = tonumber(fields[2])
local live = used and reset_at and reset_at > now
if not live then
  used = 0
  reset_at = now + window
end

local granted = math.min(want, quota - used)
if granted <= 0 then
  return {0, used, reset_at}
end
if live then
  used = redis.call("HINCRBY", key, "count", granted)
else
  used = granted
  redis.call("HSET", key, "count", granted, "reset_at", reset_at)
  redis.call("PEXPIREAT", key, reset_at + 1000)
end
return {granted, used, reset_at}
