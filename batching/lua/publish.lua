-- Publish a queue's policy (batching/policy.py `publish`). Never replaces a newer version, so
-- a process republishing what it read a moment ago cannot undo a save that just happened. It
-- reads no time, so it takes no clock.
-- KEYS[1]: the policy key
-- ARGV[1]: the policy's JSON, ARGV[2]: its version
-- Returns 1 when published, 0 when a newer version is.
local current = redis.call('GET', KEYS[1])
if current then
  local ok, decoded = pcall(cjson.decode, current)
  if ok and type(decoded) == 'table' and tonumber(decoded['version'])
     and tonumber(decoded['version']) > tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
