-- The offline jobs that have an item anywhere in a shard's backfill (batching.backfill):
-- waiting in the lane, taken by a call, or answered and not collected yet. A job fed lines
-- that none of these holds lost them (a Redis restarted with its data, the last writes cut):
-- the feeder feeds them again (offline.feeder).
-- KEYS[1]: the shard's lane, KEYS[2]: its taken set, KEYS[3]: its done list
-- ARGV: none
-- Returns the distinct job ids
local seen, ids = {}, {}
local function add(id)
  if id and not seen[id] then
    seen[id] = true
    ids[#ids + 1] = id
  end
end
for _, item in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  add(string.match(item, '^([^ ]+) '))
end
for _, item in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  add(string.match(item, '^([^ ]+) '))
end
for _, item in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
  add(string.match(item, '^%["([^"]+)"'))
end
return ids
