-- The node's time, for a web process's clock offset (batching/clock.py): {seconds,
-- microseconds}, as TIME returns it.
-- KEYS[1]: any key of the shard (it routes the call to the shard's node)
-- ARGV[1]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
if ARGV[1] and ARGV[1] ~= '' then
  local ms = tonumber(ARGV[1])
  return {math.floor(ms / 1000), (ms % 1000) * 1000}
end
return redis.call('TIME')
