-- Functions shared by the aggregator's scripts, included by `-- #include common` (see
-- batching/scripts.py). Not a script: it has no KEYS nor ARGV of its own. A name in double
-- braces is a constant of Python's (batching/lanes.py SCRIPT_CONSTANTS), substituted when
-- the script is loaded.

-- now_ms(clock): the time in ms: `clock` when given (a test sets the time), else the node's
-- TIME.
local function now_ms(clock)
  if clock and clock ~= '' then return tonumber(clock) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- open_batch(open pointer): the open batch's id, opening time (ms) and maximum size, or nil.
local function open_batch(open_key)
  local value = redis.call('GET', open_key)
  if not value then return nil end
  local bid, opened, max = string.match(value, '^(%S+) ?(%d*) ?(%d*)')
  return bid, tonumber(opened) or 0, tonumber(max) or {{MAX_BATCH_SIZE}}
end

-- lane_key(shard prefix, name, lane): a lane's key, named as ShardKeys.lane_key names it.
local function lane_key(prefix, name, lane)
  if lane == 0 then return prefix .. ':' .. name end
  return prefix .. ':' .. name .. ':' .. lane
end

-- lanes_of(shard prefix, now, keep ms): the shard's lanes used within `keep ms`, highest
-- first; lane 0 always (the lanes' keys live on the shard's slot, built here from its prefix).
local function lanes_of(prefix, now, keep_ms)
  local lanes = {0}
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', prefix .. ':lanes', now - keep_ms,
                                     '+inf')) do
    local lane = tonumber(member)
    if lane and lane > 0 then table.insert(lanes, lane) end
  end
  table.sort(lanes, function(a, b) return a > b end)
  return lanes
end

-- predicted_ms(ahead, workers, turn ms, frees): batching.admission.predicted_ms, in Lua: nil
-- where the Python one returns None. `frees`: ms until each known running call ends, soonest
-- first. Lua numbers are doubles; ahead and workers are integers.
local function predicted_ms(ahead, workers, turn_ms, frees)
  if workers <= 0 or turn_ms <= 0 or ahead < workers then return nil end
  local rounds, slot = math.floor(ahead / workers), ahead % workers
  local free = turn_ms
  if frees[slot + 1] then
    free = math.min(turn_ms, math.max(0, frees[slot + 1])
                      + math.min({{ADMISSION_MARGIN_TURNS}} * turn_ms, {{ADMISSION_MARGIN_MAX_MS}}))
  end
  return free + (rounds + {{WORST_CASE_EXTRA_TURNS}} - 1) * turn_ms
end

-- call_frees(shard prefix, workers, shards, now): ms until each of the shard's latest
-- `workers` calls ends, as their seals predicted, soonest first (record_call). Empty on
-- several shards: a shard sees only its own seals, not every running call.
local function call_frees(prefix, workers, shards, now)
  local frees = {}
  if shards ~= 1 or workers <= 0 then return frees end
  local ends = redis.call('ZREVRANGE', prefix .. ':call-ends', 0, workers - 1, 'WITHSCORES')
  for i = 2, #ends, 2 do
    table.insert(frees, tonumber(ends[i]) - now)
  end
  table.sort(frees)
  return frees
end

-- record_call(shard prefix, call id, now, turn ms, workers, ttl ms): a call sealed now ends
-- a turn from now; the latest `workers` ends are kept. On one shard only (call_frees).
local function record_call(prefix, call_id, now, turn_ms, workers, ttl)
  local key = prefix .. ':call-ends'
  redis.call('ZADD', key, now + turn_ms, call_id)
  redis.call('ZREMRANGEBYRANK', key, 0, -(workers + 1))
  redis.call('PEXPIRE', key, ttl)
end

-- refresh_admission(shard prefix, lanes, admission hash, now): recompute the figure a request
-- of each lane reads, `predicted` (lane 0) or `predicted:<lane>` (ms until a batch joined now
-- would finish; 0: admit), from the inputs the workers keep in the admission hash (none: admit
-- everything). Run when a batch closes or is sealed, and on every heartbeat: never per
-- request. A lane's backlog is this shard's closed batches of its lane and the lanes above
-- opened within the window, times the shards (requests are spread evenly over them, and the
-- workers take every shard's batches from one queue), and the other shards' open batches of
-- those lanes; not its own open batch, which a newcomer joins.
--
-- Below the highest lane, the lanes above keep sending batches that go first, so the backlog
-- alone admits requests that then wait past their deadline. There a lane gets the turns the
-- lanes above leave it: its share of the shard's recent turns (`share:<lane>`, kept by the
-- seals; a turn counts for every lane when no lane claimed it with a ready batch), one every
-- turn x shards / workers / share ms. Its next turn is due that long after its last one
-- (`avail_at:<lane>`), its closed batches take one such interval each, and the newcomer's
-- batch then runs its own call after the running one, with one turn to spare for the figure's
-- age: a newcomer that cannot be answered in time is refused at once. At light load every
-- turn is every lane's (share 1), and the figure is the backlog's.
-- Returns lane 0's figure.
local function refresh_admission(prefix, lanes, admission_key, now)
  local inputs = redis.call('HMGET', admission_key, 'workers', 'turn_ms', 'shards', 'window_ms')
  local workers = tonumber(inputs[1])
  if not workers then return 0 end
  local turn_ms, shards, window_ms = tonumber(inputs[2]), tonumber(inputs[3]), tonumber(inputs[4])
  local since = now - window_ms
  local frees  -- read once, at the first backlog: none at light load
  local ahead, lane_zero = 0, 0
  for rank, lane in ipairs(lanes) do
    local unsealed_key = lane_key(prefix, 'unsealed', lane)
    local closed = redis.call('ZCOUNT', unsealed_key, since, '+inf')
    ahead = ahead + closed * shards
    if redis.call('EXISTS', lane_key(prefix, 'open', lane)) == 1 then
      ahead = ahead + shards - 1
    end
    if not frees and workers > 0 and ahead >= workers then
      frees = call_frees(prefix, workers, shards, now)
    end
    local predicted = predicted_ms(ahead, workers, turn_ms, frees or {}) or 0
    if rank > 1 and workers > 0 then
      local left = redis.call('HMGET', admission_key, 'share:' .. lane, 'avail_at:' .. lane)
      local share = tonumber(left[1])
      if share then
        local interval = turn_ms * shards / workers / math.max(share, {{MIN_SHARE}})
        local next_turn = math.max(now, (tonumber(left[2]) or now) + interval)
        predicted = math.max(predicted, next_turn - now + closed * interval
                                        + ({{WORST_CASE_EXTRA_TURNS}} + 1) * turn_ms)
      end
    end
    if lane == 0 then
      redis.call('HSET', admission_key, 'predicted', predicted)
      lane_zero = predicted
    else
      redis.call('HSET', admission_key, 'predicted:' .. lane, predicted)
    end
  end
  return lane_zero
end

-- set_admission_inputs(admission hash, workers, turn ms, shards, window ms, ttl ms): the
-- workers' figures, kept while workers heartbeat (a shard whose workers are all gone admits
-- everything, as a queue without workers does).
local function set_admission_inputs(key, workers, turn_ms, shards, window_ms, ttl_ms)
  redis.call('HSET', key, 'workers', workers, 'turn_ms', turn_ms, 'shards', shards,
             'window_ms', window_ms)
  redis.call('PEXPIRE', key, ttl_ms)
end

-- take_due(due key, shard prefix, lanes, sent key, batch prefix, now, grace ms, limit): the ids
-- of up to `limit` batches due for a hand-over in zset `due key`, each taken by this caller
-- alone. A lane's open batch is due once its dispatcher has not confirmed its send (`sent`)
-- for a grace after it opened. A batch whose dispatch is not confirmed is re-armed (one caller
-- at a time sends its task again, until it is confirmed or sealed); a held batch is taken
-- once: its holder may only be slower than it expected (a call longer than its estimate), and
-- a task sent again queues like any other. A member whose batch is gone (sealed, expired) is
-- dropped.
local function take_due(key, prefix, lanes, sent_key, batch_prefix, now, grace, limit)
  local open_bids = {}
  for _, lane in ipairs(lanes) do
    local open_bid, opened = open_batch(lane_key(prefix, 'open', lane))
    if open_bid then
      open_bids[open_bid] = true
      if opened + grace <= now and not redis.call('ZSCORE', sent_key, open_bid)
         and not redis.call('ZSCORE', key, open_bid) then
        redis.call('ZADD', key, now, open_bid)
      end
    end
  end
  local taken = {}
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', now, 'LIMIT', 0, limit)) do
    local due_bid = string.match(member, '^[^:]+')
    if open_bids[due_bid] or redis.call('EXISTS', batch_prefix .. due_bid) == 1 then
      table.insert(taken, due_bid)
      if due_bid == member then
        redis.call('ZADD', key, now + grace, member)
      else
        redis.call('ZREM', key, member)
      end
    else
      redis.call('ZREM', key, member)
    end
  end
  return taken
end

-- close_batch(open pointer, pending, unsealed, hand-over due, admission, sent, lanes, batch id,
-- opened ms, max size, batch prefix, ttl ms, grace ms, shard prefix, lane, now): close the
-- lane's open batch `bid` (the caller checked it is the open one): its first max-size items
-- move to the batch's own list to wait for the seal (pushes beyond are dropped: their requests
-- join the next batch), it joins the backlog, and the next request opens a new batch. A batch
-- whose send is not confirmed yet is due for a hand-over a grace after it opened.
local function close_batch(open_key, pending_key, unsealed_key, due_key, admission_key, sent_key,
                           lanes_key, bid, opened, max, batch_prefix, ttl, grace, prefix, lane,
                           now)
  local batch_key = batch_prefix .. bid
  redis.call('DEL', open_key)
  if redis.call('EXISTS', pending_key) == 1 then
    redis.call('RENAME', pending_key, batch_key)
    redis.call('LTRIM', batch_key, 0, max - 1)
    redis.call('PEXPIRE', batch_key, ttl)
  end
  redis.call('ZADD', unsealed_key, opened, bid)
  if not redis.call('ZSCORE', sent_key, bid) then
    redis.call('ZADD', due_key, opened + grace, bid)
  end
  redis.call('ZADD', lanes_key, now, lane)
  refresh_admission(prefix, lanes_of(prefix, now, {{LANE_KEEP_TTLS}} * ttl), admission_key, now)
end
