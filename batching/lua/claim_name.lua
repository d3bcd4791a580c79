-- A worker process's claim on its name (batching/registry.py): one live process a name, so
-- that two workers started with the same Celery node name are not counted as one.
-- Claims the name for this process, or renews its claim; with a lifetime of 0, releases it
-- (only this process's own claim). Returns the token of the other process that holds the
-- name, or false (nil to the caller) when this one holds it now (or released it).
-- KEYS[1]: the name's owner (string: the owning process's token, expiring)
-- ARGV[1]: this process's token, ARGV[2]: how long the claim lasts unrenewed (ms; 0: release)
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return owner end
if tonumber(ARGV[2]) == 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return false
