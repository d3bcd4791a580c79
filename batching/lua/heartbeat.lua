-- A worker's heartbeat (batching/registry.py): records the worker at the node's time and
-- returns how many workers are live; with an empty name, only counts them.
-- KEYS[1]: live workers (zset: worker -> last heartbeat, ms)
-- ARGV[1]: worker name ('': count only), ARGV[2]: heartbeat timeout ms,
-- ARGV[3]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
-- #include common
local now = now_ms(ARGV[3])
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 10 * tonumber(ARGV[2]))
return redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[2]), '+inf')
