-- apply.lua: one operation on each of several limits (every limit algorithm).
--
-- The same rules as src/limiter/algorithm.rs, the reference model: the
-- store-contract tests replay random timelines against both and require the
-- same answers. Times are milliseconds since the Unix epoch, never a Redis TTL:
-- keys expire only as clean-up, after the rules have stopped trusting them.
-- "now" is the gateway's clock, passed in ARGV (store.clock = "gateway"), or,
-- when ARGV carries now = 0 (store.clock = "redis"), this node's TIME, read once
-- per call so that every key of the call sees the same instant. TIME is
-- non-deterministic; Redis 5 and later replicate a script's effects (its
-- writes), not the script, so a writing script may call it, and a read-only
-- one (a PEEK on a replica) always could.
--
-- Operations: 0 PEEK (read only: safe on a replica), 1 CHARGE (add whatever
-- the state), 2 RESERVE (add only if admitted; concurrency: take a slot),
-- 3 REFUND (undo a charge or reservation; concurrency: give the slot back),
-- 4 BLOCK (block_for limits, after a refusal, on the primary: a peek that, if
-- the window refuses, starts a block; see "Blocks" below).
--
-- One call handles any number of keys on one shard: every limit of a request
-- that lives there, and the operations of concurrent requests batched together
-- (src/limiter/store/redis/batch.rs).
--
-- KEYS[i]          one limit's state for one subject; by algorithm:
--                  0 fixed_window   hash  count, reset_at (+ block)
--                  1 sliding_window hash  start, prev, cur (+ block)
--                  2 sliding_log    zset  member "ID:COST", score = charge time
--                                         (+ member "block", score = -end)
--                  3 gcra           hash  tat (+ block)
--                  4 concurrency    zset  member "ID", score = slot expiry
--                  (block: a block_for block's end, epoch ms; see "Blocks")
-- ARGV[1]          10 integers per key, key by key, each 8 bytes, unsigned,
--                  little-endian (read with struct.unpack "<I8"): op,
--                  algorithm, quota, window ms, burst, align (0 first request,
--                  1 epoch multiples, 2 UTC month), block ms (block_for; 0:
--                  none), cost, now ms (0: read TIME), id (the entry / slot id
--                  for CHARGE and RESERVE; the epoch the charge reported for
--                  REFUND). One binary argument
--                  instead of 10 decimal ones per key: Redis makes a string
--                  object and a Lua string of each argument, and Lua's
--                  tonumber parses a decimal with strtod; packed, a call of
--                  15 keys costs Redis about a third less (BENCHMARKS.md,
--                  issue 16, twelfth round).
--
-- Returns 4 integers per key, key by key, packed into one string (8 bytes
-- each, signed, little-endian: struct.pack "<i8"):
--   admitted: used, reset_at ms, epoch (what a refund quotes), more_at ms;
--   refused:  -(used + 1), reset_at ms, retry_at ms, more_at ms.
-- (more_at: when the caller next has one unit more than now, RateLimit's t;
-- now when nothing is counted. retry_at is 0 when admitted and a refusal takes
-- nothing to refund, so six fields travel as four. One string instead of an array of integers: redis-rs
-- parses each value of a reply, about 800 instructions apiece, so a call of
-- one key costs it one value instead of three; BENCHMARKS.md, issue 16,
-- eighteenth round.) A refusal by a block answers -reset_at (the block's end,
-- which is also its retry_at and more_at),
-- and the BLOCK that started it also -retry_at.
--
-- Blocks (block ms > 0, [[limits]].block_for; the rule of
-- src/limiter/algorithm/block.rs). The block's end (epoch ms, never a TTL) is
-- kept in the limit's own key, so a call reads it with the state and the
-- packed ARGV keeps one key per limit: the hash's "block" field (fixed_window,
-- sliding_window, gcra) or, in the sorted sets, a member "block" whose score
-- is minus the end (entries' scores are times, > 0; clean-ups remove scores
-- from 0 up, so the member stays). A limit without block_for never reads or
-- writes it. While a block is on, PEEK, RESERVE and BLOCK are refused with the
-- block's end as reset and retry (used at least the limit) and write nothing;
-- CHARGE is still added (the request was served); REFUND is the algorithm's.
-- Otherwise a BLOCK is a PEEK that, refused, writes the block: now + block ms.
-- Every PEXPIREAT of a blocked key keeps it at least until the block's end
-- (`keep`, `expire`).

local PEEK, CHARGE, RESERVE, REFUND, BLOCK = 0, 1, 2, 3, 4
local CONCURRENCY_RETRY_MS = 1000

-- The current item's block end + 1000 while it is on, else 0: clean-up expiries
-- never drop a blocked key before its block ends.
local keep = 0
local function expire(key, at)
  redis.call("PEXPIREAT", key, math.max(at, keep))
end

-- Days since 1970-01-01 -> year, month (Howard Hinnant's civil_from_days).
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y, m
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function new_window_end(window, align, now)
  if align == 1 then
    return (math.floor(now / window) + 1) * window
  elseif align == 2 then
    local y, m = civil_from_days(math.floor(now / 86400000))
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    return days_from_civil(y, m, 1) * 86400000
  end
  return now + window
end

-- Fixed windows read in this call, by key, in the order first read: the hash's count
-- and reset_at as the items so far left them, whether a new window replaced the
-- stored one (fresh) and whether count changed (dirty). Read once and written once
-- per key and call (write_windows), however many items of the call share the key:
-- a hot caller's batched requests cost Redis one HMGET and one HSET, not one
-- HMGET and one write each. Every item sees what the ones before it left, so the
-- answers are those of the items applied one by one.
local windows, window_keys = {}, {}

-- The fixed window of `key` in this call (read on first use; its block too when
-- the limit has one).
local function fixed_entry(key, block)
  local w = windows[key]
  if not w then
    local f
    if block > 0 then
      f = redis.call("HMGET", key, "count", "reset_at", "block")
    else
      f = redis.call("HMGET", key, "count", "reset_at")
    end
    w = { count = tonumber(f[1]), reset_at = tonumber(f[2]), block = tonumber(f[3]) or 0,
          fresh = false, dirty = false, block_dirty = false }
    windows[key] = w
    window_keys[#window_keys + 1] = key
  end
  return w
end

local function fixed_window(key, op, quota, window, align, block, cost, now, id)
  local w = fixed_entry(key, block)
  local used, reset_at = w.count, w.reset_at
  local live = used and reset_at and reset_at > now
  if not live then
    used, reset_at = 0, new_window_end(window, align, now)
  end
  local admitted = used + cost <= quota
  if op == PEEK or (op == RESERVE and not admitted) then
    -- nothing written
  elseif op == REFUND then
    if live and reset_at == id then
      used = math.max(used - cost, 0)
      w.count, w.dirty = used, true
    end
    admitted = true
  else
    used = used + cost
    if live then
      w.count, w.dirty = used, true
    else
      -- A new window: nothing of an old one (lease records included) carries over.
      w.count, w.reset_at, w.fresh, w.dirty = used, reset_at, true, true
    end
  end
  local retry = 0
  if not admitted then retry = reset_at end
  local more = now
  if used > 0 then more = reset_at end
  return admitted, used, reset_at, retry, reset_at, more
end

-- Write what the call's items did to each fixed window (see `windows`).
local function write_windows()
  for _, key in ipairs(window_keys) do
    local w = windows[key]
    if w.fresh then
      redis.call("DEL", key)
      if w.block > 0 then
        redis.call("HSET", key, "count", w.count, "reset_at", w.reset_at, "block", w.block)
      else
        redis.call("HSET", key, "count", w.count, "reset_at", w.reset_at)
      end
      redis.call("PEXPIREAT", key, math.max(w.reset_at, w.block) + 1000)
    else
      if w.dirty then
        redis.call("HSET", key, "count", w.count)
      end
      if w.block_dirty then
        redis.call("HSET", key, "block", w.block)
        redis.call("PEXPIREAT", key, math.max(w.reset_at or 0, w.block) + 1000)
      end
    end
  end
end

local function sliding_window(key, op, quota, w, cost, now, id)
  local f = redis.call("HMGET", key, "start", "prev", "cur")
  local s, p, c = tonumber(f[1]), tonumber(f[2]), tonumber(f[3])
  local start = math.floor(now / w) * w
  local prev, cur = 0, 0
  if s and p and c then
    if s == start then
      prev, cur = p, c
    elseif s + w == start then
      prev, cur = c, 0
    end
  end
  local function estimate(pv, cu)
    return pv * (w - (now - start)) / w + cu
  end
  local function reset_of(pv, cu)
    if cu > 0 then return start + 2 * w end
    if pv > 0 then return start + w end
    return now
  end
  -- When a cost of `cost` fits: retry_at, and with remaining + 1, more_at.
  local function retry_of(pv, cu, cost)
    if cost > quota then return reset_of(pv, cu) end
    local room = quota - cost - cu
    if room >= 0 and pv > 0 then
      return math.max(math.ceil((start + w) - room * w / pv), now)
    end
    if cu == 0 then return now end
    return math.max(math.ceil((start + 2 * w) - (quota - cost) * w / cu), now)
  end
  local admitted = estimate(prev, cur) + cost <= quota
  local retry = 0
  if op == PEEK or (op == RESERVE and not admitted) then
    if not admitted then retry = retry_of(prev, cur, cost) end
  elseif op == REFUND then
    local wrote = true
    if id == start then
      cur = math.max(cur - cost, 0)
    elseif id + w == start then
      prev = math.max(prev - cost, 0)
    else
      wrote = false
    end
    if wrote and s then
      redis.call("HSET", key, "start", start, "prev", prev, "cur", cur)
    end
    admitted = true
  else
    cur = cur + cost
    redis.call("HSET", key, "start", start, "prev", prev, "cur", cur)
    expire(key, start + 2 * w + 1000)
    if not admitted then retry = reset_of(prev, cur) end
  end
  local used = math.ceil(estimate(prev, cur))
  local more = now
  if used > 0 then more = retry_of(prev, cur, quota - math.min(used, quota) + 1) end
  return admitted, used, reset_of(prev, cur), retry, start, more
end

-- The member of one entry: "ID:COST", both written as integers.
local function log_member(id, cost)
  return string.format("%d:%d", id, cost)
end

local function sliding_log(key, op, quota, w, cost, now, id)
  local entries = redis.call("ZRANGEBYSCORE", key, "(" .. (now - w), "+inf", "WITHSCORES")
  local times, costs = {}, {}
  local used, newest = 0, nil
  for i = 1, #entries, 2 do
    local t = tonumber(entries[i + 1])
    local n = tonumber(string.match(entries[i], ":(%d+)$")) or 0
    times[#times + 1] = t
    costs[#costs + 1] = n
    used = used + n
    if not newest or t > newest then newest = t end
  end
  local function reset_of()
    if newest then return newest + w end
    return now
  end
  local admitted = used + cost <= quota
  local function retry_of()
    if cost > quota then return reset_of() end
    local acc = used
    -- ZRANGEBYSCORE answers oldest first.
    for i = 1, #times do
      acc = acc - costs[i]
      if acc + cost <= quota then return times[i] + w end
    end
    return reset_of()
  end
  -- When the oldest entries have freed one unit of the `u` counted; a charge
  -- just added counts as an entry at now (after every one not later than now).
  local function more_of(u, added)
    if u == 0 then return now end
    local below, acc = math.min(u, quota) - 1, u
    for i = 1, #times do
      if added and times[i] > now then
        acc = acc - added
        if acc <= below then return now + w end
        added = nil
      end
      acc = acc - costs[i]
      if acc <= below then return times[i] + w end
    end
    if added then
      acc = acc - added
      if acc <= below then return now + w end
    end
    return reset_of()
  end
  if op == PEEK or (op == RESERVE and not admitted) then
    local retry = 0
    if not admitted then retry = retry_of() end
    return admitted, used, reset_of(), retry, 0, more_of(used)
  elseif op == REFUND then
    -- The live entry of this id gives back up to `cost` units (part of them when
    -- a reservation is settled to a smaller cost: the entry is written again
    -- with what is left, at its time); an entry left with nothing is removed.
    local prefix = string.format("%d:", id)
    for i = 1, #entries, 2 do
      local member = entries[i]
      if string.sub(member, 1, #prefix) == prefix then
        local n = costs[(i + 1) / 2]
        local back = math.min(cost, n)
        costs[(i + 1) / 2] = n - back
        redis.call("ZREM", key, member)
        if n - back > 0 then
          redis.call("ZADD", key, entries[i + 1], log_member(id, n - back))
        end
        used = used - back
        break
      end
    end
    redis.call("ZREMRANGEBYSCORE", key, 0, now - w)
    -- The newest entry may have been the one refunded.
    local last = redis.call("ZRANGEBYSCORE", key, "(" .. (now - w), "+inf", "WITHSCORES")
    newest = nil
    for i = 2, #last, 2 do
      local t = tonumber(last[i])
      if not newest or t > newest then newest = t end
    end
    return true, used, reset_of(), 0, 0, more_of(used)
  end
  redis.call("ZREMRANGEBYSCORE", key, 0, now - w)
  redis.call("ZADD", key, now, log_member(id, cost))
  expire(key, now + w + 1000)
  used = used + cost
  if not newest or now > newest then newest = now end
  local retry = 0
  if not admitted then retry = reset_of() end
  return admitted, used, reset_of(), retry, id, more_of(used, cost)
end

local function gcra(key, op, quota, w, burst, cost, now)
  local t = math.max(math.ceil(w / math.max(quota, 1)), 1)
  local cap = burst * t
  local stored = tonumber(redis.call("HGET", key, "tat")) or 0
  local base = math.max(stored, now)
  local new_tat = base + cost * t
  local admitted = new_tat - now <= cap
  local function answer(adm, tat)
    tat = math.max(tat, now)
    local retry = 0
    if not adm then retry = math.max(new_tat - cap, now) end
    local used = math.ceil((tat - now) / t)
    local more = now
    if used > 0 then more = math.max(tat - (math.min(used, burst) - 1) * t, now) end
    return adm, used, tat, retry, 0, more
  end
  if op == PEEK or (op == RESERVE and not admitted) then
    return answer(admitted, base)
  elseif op == REFUND then
    if stored <= now then return answer(true, now) end
    local tat = math.max(stored - cost * t, now)
    redis.call("HSET", key, "tat", tat)
    expire(key, tat + 1000)
    return answer(true, tat)
  end
  redis.call("HSET", key, "tat", new_tat)
  expire(key, new_tat + 1000)
  return answer(admitted, new_tat)
end

local function concurrency(key, op, quota, w, now, id)
  -- The slot's member: the id written as an integer (a Lua number would be
  -- written with 14 significant digits).
  local slot = string.format("%d", id)
  if op ~= PEEK and op ~= CHARGE then
    redis.call("ZREMRANGEBYSCORE", key, 0, now)
  end
  if op == REFUND then
    redis.call("ZREM", key, slot)
  end
  local used = redis.call("ZCOUNT", key, "(" .. now, "+inf")
  local admitted = used < quota
  local epoch = 0
  if op == RESERVE and admitted then
    redis.call("ZADD", key, now + w, slot)
    expire(key, now + w + 1000)
    used = used + 1
    epoch = id
  end
  if op == REFUND then admitted = true end
  local reset_at = now
  local top = redis.call("ZREVRANGEBYSCORE", key, "+inf", "(" .. now, "WITHSCORES", "LIMIT", 0, 1)
  if #top == 2 then reset_at = tonumber(top[2]) end
  local retry = 0
  if not admitted then retry = now + CONCURRENCY_RETRY_MS end
  return admitted, used, reset_at, retry, epoch, reset_at
end

-- now = 0 in ARGV: this node's clock, TIME (seconds, microseconds) floored to
-- milliseconds, read at most once per call.
local redis_now
local function now_of(n)
  if n ~= 0 then return n end
  if not redis_now then
    local t = redis.call("TIME")
    redis_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return redis_now
end

-- One operation of one algorithm (BLOCK is read as a PEEK here).
local function run(key, op, alg, quota, window, burst, align, block, cost, now, id)
  if op == BLOCK then op = PEEK end
  if alg == 0 then
    return fixed_window(key, op, quota, window, align, block, cost, now, id)
  elseif alg == 1 then
    return sliding_window(key, op, quota, window, cost, now, id)
  elseif alg == 2 then
    return sliding_log(key, op, quota, window, cost, now, id)
  elseif alg == 3 then
    return gcra(key, op, quota, window, burst, cost, now)
  end
  return concurrency(key, op, quota, window, now, id)
end

-- The stored block's end of `key` (ms; 0: none), by algorithm.
local function read_block(key, alg, block)
  if alg == 0 then
    return fixed_entry(key, block).block
  elseif alg == 2 or alg == 4 then
    local score = redis.call("ZSCORE", key, "block")
    return score and -tonumber(score) or 0
  end
  return tonumber(redis.call("HGET", key, "block")) or 0
end

-- Start a block of `key` until `until_at`; the key lives until the later of the
-- block's end and the state's (`reset_at`, as the refusing peek reported it).
local function write_block(key, alg, until_at, reset_at)
  if alg == 0 then
    local w = windows[key]
    w.block, w.block_dirty = until_at, true
    return
  elseif alg == 2 or alg == 4 then
    redis.call("ZADD", key, -until_at, "block")
  else
    redis.call("HSET", key, "block", until_at)
  end
  redis.call("PEXPIREAT", key, math.max(reset_at, until_at) + 1000)
end

local FIELDS = "<I8I8I8I8I8I8I8I8I8I8"
local VERDICT = "<i8i8i8i8"
local args, at = ARGV[1] or "", 1
if #args ~= 80 * #KEYS then
  return redis.error_reply("apply.lua: ARGV[1] holds " .. #args .. " bytes for " .. #KEYS .. " keys (80 a key)")
end
local out = {}
for i = 1, #KEYS do
  local op, alg, quota, window, burst, align, block, cost, now_ms, id, next_at = struct.unpack(FIELDS, args, at)
  at = next_at
  local now = now_of(now_ms)
  local key = KEYS[i]
  local admitted, used, reset_at, retry, epoch, more
  local blocked, started = false, false
  if block == 0 then
    admitted, used, reset_at, retry, epoch, more = run(key, op, alg, quota, window, burst, align, block, cost, now, id)
  else
    local until_at = read_block(key, alg, block)
    keep = 0
    if until_at > now then keep = until_at + 1000 end
    if until_at > now and op ~= REFUND then
      local o = PEEK
      if op == CHARGE then o = CHARGE end
      admitted, used = run(key, o, alg, quota, window, burst, align, block, cost, now, id)
      blocked = true
    else
      admitted, used, reset_at, retry, epoch, more = run(key, op, alg, quota, window, burst, align, block, cost, now, id)
      if op == BLOCK and not admitted then
        until_at = now + block
        write_block(key, alg, until_at, reset_at)
        blocked, started = true, true
      end
    end
    keep = 0
    if blocked then
      local limit = quota
      if alg == 3 then limit = burst end
      admitted, used, reset_at, retry, more = false, math.max(used, limit), until_at, until_at, until_at
    end
  end
  if admitted then
    out[i] = struct.pack(VERDICT, used, reset_at, epoch, more)
  elseif blocked then
    if started then retry = -retry end
    out[i] = struct.pack(VERDICT, -used - 1, -reset_at, retry, more)
  else
    out[i] = struct.pack(VERDICT, -used - 1, reset_at, retry, more)
  end
end
write_windows()
return table.concat(out)
