-- The append of a request's items in one call (BatchAggregator.append_items): a request of
-- several items (n choices, a list of prompts), one the response cache may answer, or one of a
-- key near its request limit. A script only for these: a lone item far from its limit joins
-- by the plain MULTI (batching.join), which costs Redis less.
-- The rate counter first: with a limit, the request is refused, and nothing done, when the
-- counter would pass it (a request is served only if its own raise keeps the count within the
-- limit: exact whatever the number of web processes). Then each item in turn: its cached
-- answer when it names a digest and the cache is current for the caller's policy version
-- (no entry of an older version is served once a worker's heartbeat set a newer one), else
-- it joins the lane's open batch (opening one, `<id prefix>n<k>`, when there is none; a batch
-- found full or filled by it is closed at once, as close.lua does).
-- KEYS[1]: open pointer, KEYS[2]: pending items, KEYS[3]: unsealed batches (zset) of the lane,
-- KEYS[4]: hand-over due (zset), KEYS[5]: admission (hash), KEYS[6]: sent (zset),
-- KEYS[7]: lanes (zset), KEYS[8]: cache version (the workers' policy version),
-- KEYS[9]: rate counter (optional)
-- ARGV[1]: id prefix of the batches this request opens, ARGV[2]: their opening time (ms),
-- ARGV[3]: their maximum size, ARGV[4]: batch ttl ms, ARGV[5]: admission field to read
-- ('': none), ARGV[6]: count to add to the rate counter, ARGV[7]: the limit (0: none),
-- ARGV[8]: counter expiry ms (0: none set), ARGV[9]: the caller's policy version,
-- ARGV[10]: shard prefix, ARGV[11]: batch key prefix, ARGV[12]: dispatch grace ms,
-- ARGV[13]: lane, ARGV[14]: clock ms ('': the node's TIME), then per item ARGV[15..]: its
-- cache digest ('': none) and the item as the pending list holds it.
-- Returns {-1, the counter} when refused by the limit, else {the counter after its raise (0:
-- none), the admission figure (or false), then per item: batch id ('' for a cached answer),
-- index, 1 if this request opened the batch else 0, the cached answer ('' for none)}.
-- #include common
local counted = 0
if KEYS[9] then
  local count = tonumber(redis.call('GET', KEYS[9])) or 0
  local limit = tonumber(ARGV[7])
  if limit > 0 and count + tonumber(ARGV[6]) > limit then return {-1, count} end
  counted = redis.call('INCRBY', KEYS[9], tonumber(ARGV[6]))
  if tonumber(ARGV[8]) > 0 then redis.call('PEXPIRE', KEYS[9], tonumber(ARGV[8])) end
end
local current = tonumber(redis.call('GET', KEYS[8]))
local cache_current = not current or tonumber(ARGV[9]) >= current
local ttl, grace = tonumber(ARGV[4]), tonumber(ARGV[12])
local reply = {counted, false}
local bid, opened, max = open_batch(KEYS[1])
local made = 0
local function close_open()
  close_batch(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], bid, opened, max,
              ARGV[11], ttl, grace, ARGV[10], ARGV[13], now_ms(ARGV[14]))
  bid = nil
end
for i = 15, #ARGV, 2 do
  local cached = false
  if ARGV[i] ~= '' and cache_current then
    cached = redis.call('GET', ARGV[10] .. ':cache:' .. ARGV[i])
  end
  if cached then
    for _, value in ipairs({'', -1, 0, cached}) do table.insert(reply, value) end
  else
    if bid and redis.call('LLEN', KEYS[2]) >= max then close_open() end
    local opener = 0
    if not bid then
      bid, opened, max = ARGV[1] .. 'n' .. made, tonumber(ARGV[2]), tonumber(ARGV[3])
      made, opener = made + 1, 1
      redis.call('SET', KEYS[1], bid .. ' ' .. ARGV[2] .. ' ' .. ARGV[3], 'PX', ttl)
    end
    local length = redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    for _, value in ipairs({bid, length - 1, opener, ''}) do table.insert(reply, value) end
    if length >= max then close_open() end
  end
end
if ARGV[5] ~= '' then reply[2] = redis.call('HGET', KEYS[5], ARGV[5]) end
return reply
