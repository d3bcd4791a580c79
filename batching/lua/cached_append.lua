-- The append of a request the response cache may answer (BatchAggregator.append with
-- `cache`): its answer when cached (and nothing joins a batch), else the MULTI's commands. A
-- script only for these requests, with the cache on: the plain MULTI costs Redis less. It
-- reads no time (the pointer carries the caller's), so it takes no clock.
-- KEYS[1]: cached answer, KEYS[2]: open pointer, KEYS[3]: pending items, KEYS[4]: admission
--          (hash), KEYS[5]: rate counter (optional)
-- ARGV[1]: pointer if this request opens a batch, ARGV[2]: item, ARGV[3]: batch ttl ms,
-- ARGV[4]: admission field to read ('': none), ARGV[5]: counter expiry ms (0: none set)
-- Returns {1, the cached answer, (the counter)} or {0, the pointer before, the pending list's
-- length, (the admission figure), (the counter)}.
local reply
local cached = redis.call('GET', KEYS[1])
if cached then
  reply = {1, cached}
else
  local joined = redis.call('SET', KEYS[2], ARGV[1], 'NX', 'GET', 'PX', tonumber(ARGV[3]))
  reply = {0, joined, redis.call('RPUSH', KEYS[3], ARGV[2])}
  if ARGV[4] ~= '' then table.insert(reply, redis.call('HGET', KEYS[4], ARGV[4])) end
end
if KEYS[5] then
  table.insert(reply, redis.call('INCR', KEYS[5]))
  if tonumber(ARGV[5]) > 0 then redis.call('PEXPIRE', KEYS[5], tonumber(ARGV[5])) end
end
return reply
