-- A cancelled job's waiting items out of a shard's lane (batching.backfill.Backfill.withdraw),
-- in one pass over the lane: linear in its length, where one LREM per item was quadratic.
-- The others keep their order.
-- KEYS[1]: the shard's backfill lane
-- ARGV[1]: the job's prefix ("<job id> ")
-- Returns how many items were removed
local prefix = ARGV[1]
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local kept = {}
for _, item in ipairs(items) do
  if string.sub(item, 1, #prefix) ~= prefix then
    kept[#kept + 1] = item
  end
end
local removed = #items - #kept
if removed > 0 then
  redis.call('DEL', KEYS[1])
  for first = 1, #kept, 1000 do
    redis.call('RPUSH', KEYS[1], unpack(kept, first, math.min(first + 999, #kept)))
  end
end
return removed
