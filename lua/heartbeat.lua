-- heartbeat.lua: this gateway is alive; how many gateways are (store.fleet_size = "auto").
--
-- Runs on each shard's primary every store.fleet_heartbeat. The gateways of a fleet
-- share one sorted set per shard, each member a gateway's id scored by when it was last
-- heard from (ms, this node's TIME, so that gateways' clocks need not agree). Members
-- not heard from within the TTL are dropped in the same call; the set itself expires
-- with the last gateway. The count read here while the shard answers is what
-- store.on_error = "local" divides each quota by once it does not.
--
-- KEYS[1]  the fleet's sorted set, e.g. tollgate:gateways
-- ARGV[1]  this gateway's id (an integer, random per process)
-- ARGV[2]  how long a gateway counts as alive without a heartbeat, ms
--
-- Returns {alive}: the gateways heard from within the TTL, this one included.
local ttl = tonumber(ARGV[2])
-- 1. Now, from this node's clock (seconds, microseconds) in ms.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- 2. This gateway is alive now.
redis.call("ZADD", KEYS[1], now, ARGV[1])
-- 3. Forget the gateways not heard from within the TTL.
redis.call("ZREMRANGEBYSCORE", KEYS[1], "-inf", now - ttl)
redis.call("PEXPIRE", KEYS[1], ttl)
-- 4. Those left are alive.
return {redis.call("ZCARD", KEYS[1])}
