-- Housekeeping wrote a dirty minute's totals (operations/housekeeping.py): its mark goes,
-- unless a flush landed in the minute since it was read (its version moved: written again
-- at the next run).
-- KEYS[1]: dirty minutes (hash: minute -> version)
-- ARGV[1]: minute, ARGV[2]: the version read before the minute's buckets were read
-- Returns 1 when the mark went, 0 when it stays
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
