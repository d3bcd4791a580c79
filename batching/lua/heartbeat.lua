-- A worker's heartbeat (batching/registry.py): records the worker at the node's time and
-- returns how many workers are live, and how many of them read an item's whole deadline;
-- with an empty name, only counts them.
-- KEYS[1]: live workers (zset: worker -> last heartbeat, ms), KEYS[2]: the same, of the
-- workers that read an item's whole deadline (this release's workers are)
-- ARGV[1]: worker name ('': count only), ARGV[2]: heartbeat timeout ms,
-- ARGV[3]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
-- Returns {live workers, live workers that read an item's whole deadline}
-- #include common
local now = now_ms(ARGV[3])
local timeout = tonumber(ARGV[2])
local counts = {}
for i = 1, 2 do
  if ARGV[1] ~= '' then redis.call('ZADD', KEYS[i], now, ARGV[1]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - 10 * timeout)
  counts[i] = redis.call('ZCOUNT', KEYS[i], now - timeout, '+inf')
end
return counts
