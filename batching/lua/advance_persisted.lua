-- Housekeeping takes the minutes up to ARGV[1] to write (operations/minutes.py): the
-- persisted-minute marker moves there and each minute it passes is marked dirty in the same
-- step, so that a crash before the rows are written leaves the minutes marked (written at
-- the next run), and a flush landing in one of them from now on marks it again.
-- With the marker missing (Redis lost its data), the rows already written for the minutes
-- taken come as seeds: added to each minute's first 10-second bucket in this same step, so
-- the buckets hold the minute's whole totals again; a marker found set (another process got
-- here first) takes no seeds.
-- KEYS[1]: persisted minute (string), KEYS[2]: dirty minutes (hash: minute -> version)
-- ARGV[1]: the newest minute that has ended, ARGV[2]: the oldest minute to take,
-- ARGV[3]: TTL s of the marker, the dirty minutes and the buckets seeded,
-- ARGV[4]: bucket key prefix (QueueKeys.stats_prefix), ARGV[5...]: seeds, three values
-- each: minute, field, count
-- Returns the number of minutes taken
local last = tonumber(ARGV[1])
local marker = redis.call('GET', KEYS[1])
local first = tonumber(ARGV[2])
if marker then
  first = math.max(first, tonumber(marker) + 1)
else
  for i = 5, #ARGV, 3 do
    local minute = tonumber(ARGV[i])
    if minute >= first and minute <= last then
      local key = ARGV[4] .. '10:' .. string.format('%d', minute * 60)
      redis.call('HINCRBY', key, ARGV[i + 1], ARGV[i + 2])
      redis.call('EXPIRE', key, ARGV[3])
    end
  end
end
if first > last then return 0 end
for minute = first, last do
  redis.call('HINCRBY', KEYS[2], string.format('%d', minute), 1)
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
return last - first + 1
