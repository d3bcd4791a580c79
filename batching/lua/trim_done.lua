-- The feeder fences a shard's done list (batching.backfill.Backfill): its holding's
-- generation is raised into the shard's fence before it reads answers, and it trims the
-- answers it wrote only while no later holder has raised the fence. A feeder that stalled
-- past its lock's TTL then cannot trim answers that only its successor read.
-- KEYS[1]: the shard's done list, KEYS[2]: the shard's fence (the highest generation seen)
-- ARGV[1]: the feeder's generation, ARGV[2]: how many answers to trim from the head (0: none)
-- Returns the count trimmed, or -1 when a later generation holds the fence
local generation = tonumber(ARGV[1])
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
if fence > generation then
  return -1
end
if fence < generation then
  redis.call('SET', KEYS[2], ARGV[1])
end
local count = tonumber(ARGV[2])
if count > 0 then
  redis.call('LTRIM', KEYS[1], count, -1)
end
return count
