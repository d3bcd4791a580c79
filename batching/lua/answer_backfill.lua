-- A worker answers the backfill items its seal took (batching.backfill.queue_answers): the
-- answers onto the done list and the items off the taken set, in one step, so that no crash
-- or failover between the two can lose a line or leave it answered and taken.
-- KEYS[1]: the shard's done list, KEYS[2]: the shard's taken set
-- ARGV[1]: how many answers follow (n), ARGV[2..n+1]: the answers, ARGV[n+2..]: the items
-- Returns how many items left the taken set
local count = tonumber(ARGV[1])
for first = 2, count + 1, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(ARGV, first, math.min(first + 999, count + 1)))
end
local removed = 0
for first = count + 2, #ARGV, 1000 do
  removed = removed + redis.call('ZREM', KEYS[2], unpack(ARGV, first, math.min(first + 999, #ARGV)))
end
return removed
