-- A worker gives back the backfill items its seal took but its call leaves out (their shape
-- would lengthen the interactive call past its bound: workers.runner): each item off the
-- taken set and onto the lane's tail, in one step, so that a crash leaves it taken (and put
-- back in time by the feeder) or in the lane, never neither nor both.
-- KEYS[1]: the shard's backfill lane, KEYS[2]: the shard's taken set
-- ARGV: the items
-- Returns how many went back (an item the feeder already put back is not pushed twice)
local back = {}
for _, item in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[2], item) == 1 then
    table.insert(back, item)
  end
end
for first = 1, #back, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(back, first, math.min(first + 999, #back)))
end
return #back
