-- The seal (BatchAggregator.seal): a worker's task takes the items of one batch of its shard.
-- Atomic with a request's push: a request lands either in this batch (and is returned here)
-- or, after the pointer is cleared, in a new batch.
--
-- Which batch: a task stands for one turn of a GPU on the shard, not for its own batch. The
-- highest lane with a batch ready (a closed, full one, or an open one that has waited `hold`
-- ms, HOLD_LATE_FACTOR times that while a lower lane has a closed batch ready) goes first (a
-- closed batch counts while one more turn can answer its newest item: in a lane served late,
-- the oldest batch still worth a call goes, not one whose members are gone); with none ready,
-- the lane whose open batch has the most items (the highest of those with as many): a call
-- spent on a small batch while another lane's is larger is capacity lost, and at light load
-- every batch is small anyway. Within the lane, the task's own batch when it is closed, or
-- open with no closed batch before it; else the lane's oldest closed batch, else its open one.
-- A task that seals another batch than its own hands its own over to that batch's task (sent,
-- or held by a worker): the hand-over entries move with it, and that batch is marked taken
-- over, so that its task, when it comes, seals a batch as a new task would. Every unsealed
-- batch still has a task coming; any other task whose batch is sealed is a duplicate, and
-- seals nothing. `exact` (a dispatcher abandoning its batch) seals the named batch or nothing.
--
-- The sealing worker also records when its call should end (a turn from now, in the shard's
-- call-ends: admission counts from it), refreshes the shard's admission and takes the shard's
-- batches due for a hand-over (it sends their tasks again): under load, no other round trip
-- is needed for any of them.
--
-- With `places` > 0, the seal tops its batch up from the backfill lane (batching.backfill)
-- into the places its items leave empty, up to `places` in all. `places` may list sizes
-- ("16,32,64,100": a GPU's graph buckets): the batch is topped up to the smallest of them
-- that holds its items, never past it (a larger call would cost more). A backfill turn (lane
-- {{BACKFILL_TURN}}: a worker whose GPU would be idle) seals as a task whose batch was taken
-- over does, and with no batch to take, takes a whole batch of backfill items.
--
-- KEYS[1]: lanes (zset), KEYS[2]: hand-over due (zset), KEYS[3]: admission (hash),
-- KEYS[4]: sent (zset), KEYS[5]: taken over (zset), KEYS[6]: backfill (list),
-- KEYS[7]: backfill taken (zset)
-- ARGV[1]: the task's batch id, ARGV[2]: batch key prefix, ARGV[3]: held suffix,
-- ARGV[4]: workers, ARGV[5]: turn ms, ARGV[6]: shards, ARGV[7]: window ms,
-- ARGV[8]: inputs ttl ms, ARGV[9]: dispatch grace ms, ARGV[10]: hand-overs at most,
-- ARGV[11]: ttl ms, ARGV[12]: shard prefix, ARGV[13]: the task's lane (-1: not known),
-- ARGV[14]: exact (1: that batch or none), ARGV[15]: hold ms,
-- ARGV[16]: places (the batch's, backfill included; 0: no backfill), or ascending sizes
-- separated by commas,
-- ARGV[17]: clock ms (optional: a test sets the time; absent or '', the node's TIME)
-- Returns {now ms, opened-at ms (or -1), the sealed batch's id ('' for none), its lane (-1 for
-- none), number of hand-overs h, h batch ids due for a hand-over, number of backfill items b,
-- backfill items left in the lane, items..., b backfill items}.
-- #include common

local LANES, DUE, ADMISSION, SENT, TAKEN_OVER = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local BACKFILL, BACKFILL_TAKEN = KEYS[6], KEYS[7]

-- Each lane's open batch {id, opened ms, max size} and oldest closed batch still worth a
-- call (its newest item can be answered after one more turn); the lane of the task's own
-- batch (nil: sealed, expired or taken over) and whether that batch is the lane's open one.
local function survey(prefix, lanes, batch_prefix, task_bid, now, stale, turn_ms)
  local opens, oldest = {}, {}
  local task_lane, task_open = nil, false
  for _, lane in ipairs(lanes) do
    local bid, opened, max = open_batch(lane_key(prefix, 'open', lane))
    if bid then opens[lane] = {bid, opened, max} end
    local unsealed_key = lane_key(prefix, 'unsealed', lane)
    for _, closed in ipairs(redis.call('ZRANGEBYSCORE', unsealed_key, stale, '+inf', 'LIMIT', 0,
                                       {{VIABLE_SCAN}})) do
      local last = redis.call('LINDEX', batch_prefix .. closed, -1)
      if last and tonumber(string.match(last, '^%d+')) >= now + turn_ms then
        oldest[lane] = closed
        break
      end
    end
    if not task_lane then
      if bid == task_bid then
        task_lane, task_open = lane, true
      elseif redis.call('ZSCORE', unsealed_key, task_bid) then
        task_lane = lane
      end
    end
  end
  return opens, oldest, task_lane, task_open
end

-- The highest lane with a batch ready (nil: none): a closed one, or an open one that has
-- waited its hold (longer while a lower lane has a closed batch that can take the turn whole).
local function ready_lane(lanes, opens, oldest, now, hold)
  local full_below, any_full = {}, false
  for index = #lanes, 1, -1 do
    full_below[lanes[index]] = any_full
    if oldest[lanes[index]] then any_full = true end
  end
  for _, lane in ipairs(lanes) do
    local wait = full_below[lane] and hold * {{HOLD_LATE_FACTOR}} or hold
    if oldest[lane] or (opens[lane] and now - opens[lane][2] >= wait) then return lane end
  end
  return nil
end

-- The turn was left to every lane below the one that claimed it (every lane, when none did):
-- the lanes' running shares of the shard's turns, for admission.
local function count_shares(lanes, claimed, now)
  local shares = {}
  for _, lane in ipairs(lanes) do
    local left = (not claimed or lane >= claimed) and 1 or 0
    local share = tonumber(redis.call('HGET', ADMISSION, 'share:' .. lane) or 1)
    table.insert(shares, 'share:' .. lane)
    table.insert(shares, share + {{SHARE_WEIGHT}} * (left - share))
    if left == 1 then
      table.insert(shares, 'avail_at:' .. lane)
      table.insert(shares, now)
    end
  end
  if #shares > 0 then redis.call('HSET', ADMISSION, unpack(shares)) end
end

-- The lane whose open batch has the most items (nil: no lane has one).
local function largest_open_lane(prefix, lanes, opens)
  local lane, most = nil, 0
  for _, each in ipairs(lanes) do
    if opens[each] then
      local length = redis.call('LLEN', lane_key(prefix, 'pending', each))
      if length > most then lane, most = each, length end
    end
  end
  return lane
end

-- The batch of `lane` to seal, and whether it is the lane's open one.
local function choose_batch(lane, task, opens, oldest)
  if not lane then return nil, false end
  if lane == task.lane and (task.exact or not task.open or not oldest[lane]) then
    return task.bid, task.open
  elseif oldest[lane] then
    return oldest[lane], false
  end
  return opens[lane][1], true
end

-- Take the chosen batch's items (its open pointer and pending list, or its own list) and its
-- opening time.
local function take_items(prefix, batch_prefix, lane, chosen, chosen_open, opens, stale)
  local unsealed_key = lane_key(prefix, 'unsealed', lane)
  local items, opened_at
  if chosen_open then
    local pending_key = lane_key(prefix, 'pending', lane)
    opened_at = opens[lane][2]
    items = redis.call('LRANGE', pending_key, 0, opens[lane][3] - 1)
    redis.call('DEL', pending_key, lane_key(prefix, 'open', lane))
  else
    opened_at = tonumber(redis.call('ZSCORE', unsealed_key, chosen) or -1)
    local batch_key = batch_prefix .. chosen
    items = redis.call('LRANGE', batch_key, 0, -1)
    redis.call('DEL', batch_key)
  end
  redis.call('ZREM', unsealed_key, chosen)
  redis.call('ZREMRANGEBYSCORE', unsealed_key, '-inf', stale)
  return items, opened_at
end

local function inherit(zset, from, to)
  local score = redis.call('ZSCORE', zset, from)
  if score then redis.call('ZADD', zset, score, to) else redis.call('ZREM', zset, to) end
end

-- A task that sealed another batch than its own hands its own over to the chosen batch's task:
-- the chosen batch's sent and hand-over entries move to the task's batch. The chosen batch
-- needs no hand-over any more.
local function hand_over(chosen, task, held, now)
  if chosen ~= task.bid and task.lane then
    redis.call('ZADD', TAKEN_OVER, now, chosen)
    inherit(SENT, chosen, task.bid)
    inherit(DUE, chosen, task.bid)
    inherit(DUE, chosen .. held, task.bid .. held)
  end
  redis.call('ZREM', SENT, chosen)
  redis.call('ZREM', DUE, chosen, chosen .. held)
end

-- Drop the entries of a task's batch that is gone, and every entry older than a batch lives.
local function forget_stale(task, held, now, stale, ttl)
  if not task.lane then
    redis.call('ZREM', SENT, task.bid)
    redis.call('ZREM', DUE, task.bid, task.bid .. held)
  end
  redis.call('ZREMRANGEBYSCORE', SENT, '-inf', stale)
  redis.call('ZREMRANGEBYSCORE', DUE, '-inf', stale)
  redis.call('ZREMRANGEBYSCORE', TAKEN_OVER, '-inf', stale)
  redis.call('ZREMRANGEBYSCORE', LANES, '-inf', now - {{LANE_KEEP_TTLS}} * ttl)
end

local batch_prefix, held, prefix = ARGV[2], ARGV[3], ARGV[12]
local turn_ms, ttl, hold = tonumber(ARGV[5]), tonumber(ARGV[11]), tonumber(ARGV[15])
local now = now_ms(ARGV[17])
local stale = now - ttl
local task = {bid = ARGV[1], exact = ARGV[14] == '1'}
local task_lane = tonumber(ARGV[13])
local backfill_turn = task_lane == {{BACKFILL_TURN}}
if task_lane > 0 then redis.call('ZADD', LANES, now, task_lane) end
local lanes = lanes_of(prefix, now, {{LANE_KEEP_TTLS}} * ttl)
local opens, oldest
opens, oldest, task.lane, task.open = survey(prefix, lanes, batch_prefix, task.bid, now, stale,
                                             turn_ms)

local lane = task.lane
local taken_over = not task.lane and redis.call('ZREM', TAKEN_OVER, task.bid) == 1
if not task.exact and (task.lane or taken_over or backfill_turn) then
  local claimed = ready_lane(lanes, opens, oldest, now, hold)
  count_shares(lanes, claimed, now)
  lane = claimed or largest_open_lane(prefix, lanes, opens)
end

local chosen, chosen_open = choose_batch(lane, task, opens, oldest)
local items, opened_at = {}, -1
if chosen then
  items, opened_at = take_items(prefix, batch_prefix, lane, chosen, chosen_open, opens, stale)
  if lane > 0 then redis.call('ZADD', LANES, now, lane) end
  hand_over(chosen, task, held, now)
end
forget_stale(task, held, now, stale, ttl)

local due = take_due(DUE, prefix, lanes, SENT, batch_prefix, now, tonumber(ARGV[9]),
                     tonumber(ARGV[10]))
-- The backfill lane fills the places left: of the batch taken, or of a backfill turn's own.
local backfill, left = {}, 0
local places = 0
for size in string.gmatch(ARGV[16], '%-?%d+') do
  if tonumber(size) >= #items then
    places = tonumber(size) - #items
    break
  end
end
if places > 0 and not task.exact and (chosen or backfill_turn) then
  backfill = redis.call('LPOP', BACKFILL, places) or {}
  if #backfill > 0 then  -- one ZADD: a call of 100 items is the seal's largest part
    local scored = {}
    for _, item in ipairs(backfill) do
      scored[#scored + 1] = now
      scored[#scored + 1] = item
    end
    redis.call('ZADD', BACKFILL_TAKEN, unpack(scored))
  end
  left = redis.call('LLEN', BACKFILL)
end
local workers = tonumber(ARGV[4])
if workers > 0 then
  set_admission_inputs(ADMISSION, ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
  if (chosen or #backfill > 0) and turn_ms > 0 and tonumber(ARGV[6]) == 1 then
    -- A backfill turn's id is its worker's count: numbered too, or two workers' would be one.
    local call_id = chosen or (task.bid .. '#' .. redis.call('HINCRBY', ADMISSION, 'calls', 1))
    record_call(prefix, call_id, now, turn_ms, workers, ttl)
  end
end
refresh_admission(prefix, lanes, ADMISSION, now)
local reply = {now, opened_at, chosen or '', lane or -1, #due}
for _, due_bid in ipairs(due) do table.insert(reply, due_bid) end
table.insert(reply, #backfill)
table.insert(reply, left)
for _, item in ipairs(items) do table.insert(reply, item) end
for _, item in ipairs(backfill) do table.insert(reply, item) end
return reply
