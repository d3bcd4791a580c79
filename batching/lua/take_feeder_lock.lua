-- The feeder's lock taken (offline.feeder), and with it, in the same step, a generation above
-- every earlier holding's: a counter, never below the node's time in ms, so that a Redis
-- that lost the counter's last writes (an AOF cut) still gives a new holder a generation
-- above the fences (batching/lua/trim_done.lua) its predecessors wrote. Taken apart, a holder
-- that stalled between the two could get a generation above its successor's.
-- KEYS[1]: the feeder's lock, KEYS[2]: the generation counter
-- ARGV[1]: the lock's token, ARGV[2]: its TTL in ms
-- Returns the new generation, or 0 when another holds the lock
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local generation = redis.call('INCR', KEYS[2])
if generation < floor then
  redis.call('SET', KEYS[2], floor)
  generation = floor
end
return generation
