-- lease.lua: take up to `want` units of a caller's fixed window for one gateway
-- to admit from locally (lease mode, `[[limits]] lease = N`), and keep a record
-- of the units that gateway holds, with a lifetime (`lease_ttl`).
--
-- Runs on the shard's primary. The units granted are counted in the window at
-- once, so the units admitted by all gateways together never exceed the quota:
-- a gateway admits only units it was granted here. Starts a window (like
-- apply.lua's CHARGE) when none is live and something is granted.
--
-- Each gateway's unused units are recorded in the window hash (`h:ID`, with
-- `t:ID` the time they lapse). A gateway reports the units it still holds on
-- each call (the rest of its earlier grants it has used: they stay counted), and
-- gives unused units back with refund.lua. A record not renewed by its lapse time
-- belongs to a gateway that died (kill -9): its units go back to the window, so a
-- crash strands at most one lease for at most lease_ttl.
--
-- KEYS[1]  the window hash: fields `count` and `reset_at` (ms since epoch), and
--          `h:ID` / `t:ID` per gateway holding units
-- ARGV[1]  want: units asked for (>= 0; 0 renews the record only)
-- ARGV[2]  quota: units per window for this caller's tier
-- ARGV[3]  window length, milliseconds
-- ARGV[4]  now, milliseconds since the Unix epoch, from the gateway's clock; 0
--          (store.clock = "redis"): this node's TIME, floored to milliseconds
-- ARGV[5]  the gateway's id (an integer, random per process)
-- ARGV[6]  lease_ttl, milliseconds
-- ARGV[7]  units this gateway still holds, unused, of earlier grants
-- ARGV[8]  reset_at of the window those units belong to (0: none)
--
-- Returns {granted, used, reset_at}: units granted (0 when the window is full),
-- the window's count after the grant, and its reset (now + window when no window
-- is live and nothing was granted).
local key = KEYS[1]
local want = tonumber(ARGV[1])
local quota = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local gateway = ARGV[5]
local ttl = tonumber(ARGV[6])
local kept = tonumber(ARGV[7])
local kept_reset_at = tonumber(ARGV[8])
if now == 0 then
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local fields = redis.call("HMGET", key, "count", "reset_at")
local used = tonumber(fields[1])
local reset_at = tonumber(fields[2])
local live = used and reset_at and reset_at > now
if live then
  -- Give back the units of gateways not heard from within lease_ttl.
  local all = redis.call("HGETALL", key)
  local reaped = 0
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, 2) == "t:" and tonumber(all[i + 1]) <= now then
      local id = string.sub(f, 3)
      reaped = reaped + (tonumber(redis.call("HGET", key, "h:" .. id)) or 0)
      redis.call("HDEL", key, f, "h:" .. id)
    end
  end
  if reaped > 0 then
    used = math.max(used - reaped, 0)
    redis.call("HSET", key, "count", used)
  end
else
  used = 0
  reset_at = now + window
  kept = 0
end
if kept_reset_at ~= reset_at then
  kept = 0
end

local granted = math.max(math.min(want, quota - used), 0)
if granted == 0 and not live then
  return {0, used, reset_at}
end
if granted > 0 then
  if live then
    used = redis.call("HINCRBY", key, "count", granted)
  else
    -- A new window: nothing of an old one (lease records included) carries over.
    used = granted
    redis.call("DEL", key)
    redis.call("HSET", key, "count", granted, "reset_at", reset_at)
    redis.call("PEXPIREAT", key, reset_at + 1000)
  end
end
local held = kept + granted
if held > 0 then
  redis.call("HSET", key, "h:" .. gateway, held, "t:" .. gateway, now + ttl)
else
  redis.call("HDEL", key, "h:" .. gateway, "t:" .. gateway)
end
return {granted, used, reset_at}
