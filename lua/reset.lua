-- reset.lua: clear a caller's windows (POST /callers/{id}/reset on the admin listener).
--
-- Runs on the shard's primary. Every key given is deleted whatever it holds: a fixed
-- window's hash (with the lease records of every gateway), a sliding window's
-- counters, a sliding log, a GCRA arrival time. The next request of the caller starts
-- a fresh window, on every gateway, as for a caller never seen before. All keys of one
-- call share the subject's hash tag, so they live on one shard (one slot in a cluster).
--
-- KEYS[1..n]  the storage keys of the caller's windows, one per limit
--
-- Returns {deleted}: how many of the keys existed.
if #KEYS == 0 then
  return {0}
end
return {redis.call("DEL", unpack(KEYS))}
