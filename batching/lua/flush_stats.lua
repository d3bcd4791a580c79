-- A flush of statistics counts into their time buckets, applied once (telemetry/flush.py):
-- a flush sent again (same writer, a sequence not above the last one applied) changes
-- nothing. Seconds come by the writer's clock; they are moved by the writer's offset to this
-- node's clock (whole seconds), so every process counts by the node's time. A count that
-- lands in a minute already persisted to the database marks that minute dirty (its version up
-- one) for housekeeping to write again (operations/housekeeping.py).
-- KEYS[1]: applied sequences (hash: writer -> last sequence applied)
-- KEYS[2]: persisted minute (string: the last minute written to the database)
-- KEYS[3]: dirty minutes (hash: minute -> version)
-- ARGV[1]: writer id, ARGV[2]: sequence, ARGV[3]: the writer's time now (s)
-- ARGV[4]: counts (JSON: [[second, {field: count, ...}], ...], by the writer's clock)
-- ARGV[5]: bucket key prefix (QueueKeys.stats_bucket of granularity g, start s is
--          prefix .. g .. ':' .. s), ARGV[6]: TTL s of the 1-second buckets,
-- ARGV[7]: TTL s of the 10-second buckets (and of the applied and dirty hashes),
-- ARGV[8]: clock ms (optional: a test sets the time; '', the node's TIME)
-- ARGV[9]: keys' spend by month (JSON: month -> key id -> spend; '' for none),
-- ARGV[10]: the month totals' key prefix (prefix .. month: hash key id -> spend),
-- ARGV[11]: their TTL s
-- ARGV[12]: TTL s of the applied sequences (optional: '' or absent, ARGV[7]'s)
-- Returns {1 applied or 0 already applied, the offset applied (s)}
local function now_ms(clock)
  if clock and clock ~= '' then return tonumber(clock) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) <= last then return {0, 0} end
local shift = math.floor(now_ms(ARGV[8]) / 1000 - tonumber(ARGV[3]) + 0.5)
local persisted = tonumber(redis.call('GET', KEYS[2]) or '-1')
local ttl = tonumber(ARGV[7])
local granularities = { {1, tonumber(ARGV[6])}, {10, ttl} }
local dirty = {}
for _, entry in ipairs(cjson.decode(ARGV[4])) do
  local second = tonumber(entry[1]) + shift
  for _, g in ipairs(granularities) do
    local key = ARGV[5] .. g[1] .. ':' .. string.format('%d', second - second % g[1])
    for field, value in pairs(entry[2]) do
      redis.call('HINCRBY', key, field, string.format('%d', value))
    end
    redis.call('EXPIRE', key, g[2])
  end
  local minute = math.floor(second / 60)
  if minute <= persisted then dirty[minute] = true end
end
for minute in pairs(dirty) do
  redis.call('HINCRBY', KEYS[3], string.format('%d', minute), 1)
  redis.call('EXPIRE', KEYS[3], ttl)
end
if ARGV[9] and ARGV[9] ~= '' then
  for month, by_key in pairs(cjson.decode(ARGV[9])) do
    local key = ARGV[10] .. month
    for key_id, spend in pairs(by_key) do
      redis.call('HINCRBY', key, key_id, string.format('%d', spend))
    end
    redis.call('EXPIRE', key, tonumber(ARGV[11]))
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if ARGV[12] and ARGV[12] ~= '' then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[12]))
else
  redis.call('EXPIRE', KEYS[1], ttl)
end
return {1, shift}
