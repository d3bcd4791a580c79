"""The Redis batch aggregator shared by every web process and every worker of one queue.

A queue's requests join open batches: one per shard (SAMPLING_SHARDS, one by default), each
shard's keys under its own hash tag so that a Redis cluster spreads the shards over its
masters. A request joins its shard's open batch with one MULTI of plain commands (`append`:
SET NX GET of the open pointer, RPUSH onto the shard's pending list, now and then an HGET of
the admission figure), the only Redis round trip of a request: no Lua on the request path, whose
cold call costs a Redis core about as much as the rest of the request. The pointer names the
batch, its opening time and its maximum size; the request whose SET NX set it opened the
batch and dispatches the batch's Celery task at once, with the batch id as task id, so every
member knows which result to wait on before the batch is sealed; its index is the list's
length. The request that fills the batch closes it (`close`: its items move to the batch's
own list; pushes beyond the maximum are dropped and their requests join the next batch). The
worker seals the batch (SEAL) when it starts the task, i.e. when a GPU is free, and takes
every item appended so far: while the GPUs are busy new requests pile into the open batches,
so the batch size follows the load with no timer.

Priority tiers: each lane (a tier's priority; 0 for the anonymous tier and for everything
before tiers, whose keys keep their names) has its own open batch per shard, so a batch holds
one tier only, and its task carries the lane's Celery priority. A task is one turn of a GPU on
its shard: the seal takes the highest lane's ready batch, which may be another than the
task's own (see SEAL_LUA), and the worker answers the batch it sealed.

Admission control (batching.admission) is decided from one figure per shard and lane,
`predicted`, which the per-batch scripts (close, seal) and the workers' heartbeats recompute;
a request compares the figure its process read last with its budget (see `append`).

A batch whose task was never sent cannot be sealed, so a batch not confirmed as sent
(`dispatched`, which also counts it in admission's backlog) is due for a hand-over
DISPATCH_GRACE_MS after it opened. If the send fails, the dispatcher closes the batch
(`abandon`) and answers its members at once. If the dispatcher dies between the two, a worker
hands the batch over: the next seal of the shard, or a worker's scan when no seal comes,
sends its task again (a duplicate task finds the batch sealed and answers nothing). A worker
that receives a batch's task while its GPU is still busy (workers.pipeline takes the next
task before the running call ends) marks the batch held (`hold`), due for a hand-over a grace
after the worker expects to seal it: a worker killed before the seal loses only the batch it
was running, not the one it held.

Times are the Redis node's (TIME in the scripts; a web process keeps its offset to each
shard's node), so web and GPU nodes need no shared clock. Keys come from batching.keys. This
module knows nothing of Django or models: it takes a redis client (a cluster client works
alike) and numbers.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from batching import stats
from batching.admission import ADMISSION_LUA, WORST_CASE_EXTRA_TURNS
from batching.generation import SampleRequest
from batching.keys import LaneKeys, QueueKeys, ShardKeys, shard_tags, tag_of
from batching.policy import MAX_BATCH_SIZE, Policy
from batching.topology import is_cluster

log = logging.getLogger(__name__)

# A dispatcher confirms its send within this long, or its batch is handed over; a worker
# seals a batch it holds within this long after it expected to, or the batch is handed over.
DISPATCH_GRACE_MS = 100
# The hand-over member of a batch that a worker holds (see `hold`), after the batch's id.
HELD_SUFFIX = ":held"
# A worker that has not sealed a batch of a shard for this long looks for the shard's batches
# due for a hand-over (a seal takes them too): all of a dead worker's clients may be waiting
# in the batch it held, and then no request comes to move anything.
HANDOVER_SCAN_MS = 100
# A seal takes at most this many batches due for a hand-over.
HANDOVERS_PER_SEAL = 10
# A worker that has not heartbeated for this long is not counted (admission, /readyz).
HEARTBEAT_TIMEOUT_MS = 5000
# A process refuses requests from the admission figure its last call read for this long; then
# it reads the figure again before it refuses.
ADMISSION_FRESH_S = 0.1
# A request's call reads the figure again when its process read it over this long ago: under
# load, one request in several carries the HGET.
ADMISSION_REFRESH_S = 0.01
# A process reads a shard's Redis time this often (its clock offset; see `_redis_now_ms`),
# with this many TIME round trips, keeping the tightest.
CLOCK_REFRESH_S = 10.0
CLOCK_SAMPLES = 3
# A request that finds its batch full joins the next; this many tries, then a RedisError.
APPEND_ATTEMPTS = 8
# The last batch records kept for operators, tests and the benchmark.
BATCH_LOG_LENGTH = 1000
# A lane not used for this many batch lifetimes (ttl) is forgotten by the seals.
LANE_KEEP_TTLS = 10
# A lane's open batch is ready to be sealed ahead of a lower lane's full batch once it has
# waited this fraction of the deadline: long enough to fill up under load (a tier sending 30%
# of a GPU's capacity fills a batch in about 2 calls), short enough to leave it the rest of
# its deadline. A full batch is always ready.
HOLD_DEADLINE_FRACTION = 0.25
# ... and this many holds while a lower lane has a full batch that can take the turn whole: a
# partial batch sealed then costs the GPU its empty places, and under overload the higher
# lanes' partial batches were most of what it lost (`bench.tiers`, one session, 2026-11-24:
# 94.3% of the limit served with 1.0, 96.2% with 1.4, enterprise's p99 216 then 241 ms of 300).
HOLD_LATE_FACTOR = 1.4
# A seal looks this far into a lane's closed batches for the oldest one whose newest item can
# still be answered in time (the others' members time out at their deadline, without a call).
VIABLE_SCAN = 10
# Weight of each seal in a lane's running share of the shard's turns that no higher lane
# claimed with a ready batch (the turns left to it): about the last 10 turns count.
SHARE_WEIGHT = 0.1
# The smallest share admission divides by: a lane left no turn at all waits "forever".
MIN_SHARE = 0.01

_NOW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_NOW_FUNCTION_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# open_batch(open pointer): the open batch's id, opening time (ms) and maximum size, or nil.
_OPEN_BATCH_LUA = f"""
local function open_batch(open_key)
  local value = redis.call('GET', open_key)
  if not value then return nil end
  local bid, opened, max = string.match(value, '^(%S+) ?(%d*) ?(%d*)')
  return bid, tonumber(opened) or 0, tonumber(max) or {MAX_BATCH_SIZE}
end
"""

# lane_key(shard prefix, name, lane): a lane's key, named as ShardKeys.lane_key names it.
# lanes_of(shard prefix, now, keep ms): the shard's lanes used within `keep ms`, highest
# first; lane 0 always (the lanes' keys live on the shard's slot, built here from its prefix).
_LANES_LUA = """
local function lane_key(prefix, name, lane)
  if lane == 0 then return prefix .. ':' .. name end
  return prefix .. ':' .. name .. ':' .. lane
end
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
"""

# take_due(due key, shard prefix, lanes, sent key, batch prefix, now, grace ms, limit): the ids
# of up to `limit` batches due for a hand-over in zset `due key`, each taken by this caller
# alone. A lane's open batch is due once its dispatcher has not confirmed its send (`sent`)
# for a grace after it opened. A batch whose dispatch is not confirmed is re-armed (one caller
# at a time sends its task again, until it is confirmed or sealed); a held batch is taken
# once: its holder may only be slower than it expected (a call longer than its estimate), and
# a task sent again queues like any other. A member whose batch is gone (sealed, expired) is
# dropped.
_TAKE_DUE_LUA = """
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
"""

# refresh_admission(shard prefix, lanes, admission hash, now): recompute the figure a request
# of each lane reads, `predicted` (lane 0) or `predicted:<lane>` (ms until a batch joined now
# would finish; 0: admit), from the inputs the workers keep in the admission hash (none: admit
# everything). Run when a batch closes or is sealed, and on every heartbeat: never per
# request. A lane's backlog is this shard's closed batches of its lane and the lanes above
# opened within the window, times the shards (requests are spread evenly over them, and the
# workers take every shard's batches from one queue), and the other shards' open batches of
# those lanes; not its own open batch, which a newcomer joins.
#
# Below the highest lane, the lanes above keep sending batches that go first, so the backlog
# alone admits requests that then wait past their deadline. There a lane gets the turns the
# lanes above leave it: its share of the shard's recent turns (`share:<lane>`, kept by the
# seals; a turn counts for every lane when no lane claimed it with a ready batch), one every
# turn x shards / workers / share ms. Its next turn is due that long after its last one
# (`avail_at:<lane>`), its closed batches take one such interval each, and the newcomer's
# batch then runs its own call after the running one, with one turn to spare for the figure's
# age: a newcomer that cannot be answered in time is refused at once. At light load every
# turn is every lane's (share 1), and the figure is the backlog's.
# Returns lane 0's figure.
_REFRESH_ADMISSION_LUA = (
    ADMISSION_LUA
    + """
local function refresh_admission(prefix, lanes, admission_key, now)
  local inputs = redis.call('HMGET', admission_key, 'workers', 'turn_ms', 'shards', 'window_ms')
  local workers = tonumber(inputs[1])
  if not workers then return 0 end
  local turn_ms, shards, window_ms = tonumber(inputs[2]), tonumber(inputs[3]), tonumber(inputs[4])
  local since = now - window_ms
  local ahead, lane_zero = 0, 0
  for rank, lane in ipairs(lanes) do
    local unsealed_key = lane_key(prefix, 'unsealed', lane)
    local closed = redis.call('ZCOUNT', unsealed_key, since, '+inf')
    ahead = ahead + closed * shards
    if redis.call('EXISTS', lane_key(prefix, 'open', lane)) == 1 then
      ahead = ahead + shards - 1
    end
    local predicted = predicted_ms(ahead, workers, turn_ms) or 0
    if rank > 1 and workers > 0 then
      local left = redis.call('HMGET', admission_key, 'share:' .. lane, 'avail_at:' .. lane)
      local share = tonumber(left[1])
      if share then
        local interval = turn_ms * shards / workers / math.max(share, MIN_SHARE)
        local next_turn = math.max(now, (tonumber(left[2]) or now) + interval)
        predicted = math.max(predicted, next_turn - now + closed * interval
                                        + (WORST_CASE_EXTRA_TURNS + 1) * turn_ms)
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
""".replace("WORST_CASE_EXTRA_TURNS", str(WORST_CASE_EXTRA_TURNS)).replace(
        "MIN_SHARE", str(MIN_SHARE)
    )
)

# KEYS: cached answer, open pointer, pending items, admission (hash), [rate counter]
# ARGV: pointer if this request opens a batch, item, batch ttl ms, admission field to read
#       ('': none), counter expiry ms (0: none set)
# The append of a request the response cache may answer (`append` with `cache`): its answer
# when cached (and nothing joins a batch), else the MULTI's commands. A script only for these
# requests, with the cache on: the plain MULTI costs Redis less.
CACHED_APPEND_LUA = """
local reply
local cached = redis.call('GET', KEYS[1])
if cached then
  reply = {1, cached}
else
  local joined = redis.call('SET', KEYS[2], ARGV[1], 'NX', 'GET', 'PX', tonumber(ARGV[3]))
  reply = {0, joined, redis.call('RPUSH', KEYS[3], ARGV[2])}
  if ARGV[4] ~= '' then table.insert(reply, redis.call('HGET', KEYS[4], ARGV[4])) end
end
if KEYS[5] then
  table.insert(reply, redis.call('INCR', KEYS[5]))
  if tonumber(ARGV[5]) > 0 then redis.call('PEXPIRE', KEYS[5], tonumber(ARGV[5])) end
end
return reply
"""

# KEYS: any key of the shard (for routing). Redis time, for a process's clock offset.
CLOCK_LUA = "return redis.call('TIME')"

# KEYS: open pointer, pending items, unsealed batches (zset) of the lane, hand-over due (zset),
#       admission, sent (zset), lanes (zset)
# ARGV: batch id, batch key prefix, ttl ms, dispatch grace ms, shard prefix, lane
# A request that filled its lane's open batch (or found it full) closes it: its first max-size
# items move to the batch's own list to wait for the seal (pushes beyond, made in the
# meantime, are dropped: their requests saw they were too many and join the next batch), it
# joins the backlog, and the next request opens a new batch. A closed batch whose send is not
# confirmed yet is due for a hand-over a grace after it opened. Returns 1, or 0 when the batch
# was not open (closed or sealed already).
CLOSE_LUA = (
    _NOW_FUNCTION_LUA
    + _OPEN_BATCH_LUA
    + _LANES_LUA
    + _REFRESH_ADMISSION_LUA
    + """
local now = now_ms()
local open_bid, opened, max = open_batch(KEYS[1])
if open_bid ~= ARGV[1] then return 0 end
local batch_key = ARGV[2] .. open_bid
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('RENAME', KEYS[2], batch_key)
  redis.call('LTRIM', batch_key, 0, max - 1)
  redis.call('PEXPIRE', batch_key, tonumber(ARGV[3]))
end
redis.call('ZADD', KEYS[3], opened, open_bid)
if not redis.call('ZSCORE', KEYS[6], open_bid) then
  redis.call('ZADD', KEYS[4], opened + tonumber(ARGV[4]), open_bid)
end
redis.call('ZADD', KEYS[7], now, ARGV[6])
refresh_admission(ARGV[5], lanes_of(ARGV[5], now, LANE_KEEP_TTLS * tonumber(ARGV[3])),
                  KEYS[5], now)
return 1
"""
).replace("LANE_KEEP_TTLS", str(LANE_KEEP_TTLS))

# set_admission_inputs(admission hash, workers, turn ms, shards, window ms, ttl ms): the
# workers' figures, kept while workers heartbeat (a shard whose workers are all gone admits
# everything, as a queue without workers does).
_ADMISSION_INPUTS_LUA = """
local function set_admission_inputs(key, workers, turn_ms, shards, window_ms, ttl_ms)
  redis.call('HSET', key, 'workers', workers, 'turn_ms', turn_ms, 'shards', shards,
             'window_ms', window_ms)
  redis.call('PEXPIRE', key, ttl_ms)
end
"""

# KEYS: lanes (zset), hand-over due (zset), admission (hash), sent (zset), taken over (zset)
# ARGV: the task's batch id, batch key prefix, held suffix, workers, turn ms, shards, window
#       ms, inputs ttl ms, dispatch grace ms, hand-overs at most, ttl ms, shard prefix, the
#       task's lane (-1: not known), exact (1: that batch or none), hold ms
# Returns {now ms, opened-at ms (or -1), the sealed batch's id ('' for none), its lane (-1 for
# none), number of hand-overs h, h batch ids due for a hand-over, items...}. Atomic with a
# request's push: a request lands either in this batch (and is returned here) or, after the
# pointer is cleared, in a new batch.
#
# Which batch: a task stands for one turn of a GPU on the shard, not for its own batch. The
# highest lane with a batch ready (a closed, full one, or an open one that has waited `hold`
# ms, HOLD_LATE_FACTOR times that while a lower lane has a closed batch ready) goes first (a
# closed batch counts while one more turn can answer its newest item: in a
# lane served late, the oldest batch still worth a call goes, not one whose members are gone);
# with none ready, the lane whose open batch has the most items (the highest
# of those with as many): a call spent on a small batch while another lane's is larger is
# capacity lost, and at light load every batch is small anyway. Within the lane, the task's
# own batch when it is closed, or open with no closed batch before it; else the lane's oldest
# closed batch, else its open one. A task that seals another batch
# than its own hands its own over to that batch's task (sent, or held by a worker): the
# hand-over entries move with it, and that batch is marked taken over, so that its task, when
# it comes, seals a batch as a new task would. Every unsealed batch still has a task coming;
# any other task whose batch is sealed is a duplicate, and seals nothing. `exact` (a
# dispatcher abandoning its batch) seals the named batch or nothing.
#
# The sealing worker also refreshes the shard's admission and takes the shard's batches due for
# a hand-over (it sends their tasks again): under load, no other round trip is needed for
# either.
SEAL_LUA = (
    _NOW_FUNCTION_LUA
    + _OPEN_BATCH_LUA
    + _LANES_LUA
    + _REFRESH_ADMISSION_LUA
    + _ADMISSION_INPUTS_LUA
    + _TAKE_DUE_LUA
    + """
local function inherit(zset, from, to)
  local score = redis.call('ZSCORE', zset, from)
  if score then redis.call('ZADD', zset, score, to) else redis.call('ZREM', zset, to) end
end
local now = now_ms()
local task_bid, held, prefix = ARGV[1], ARGV[3], ARGV[12]
local task_lane, exact, hold = tonumber(ARGV[13]), ARGV[14] == '1', tonumber(ARGV[15])
local ttl = tonumber(ARGV[11])
local stale = now - ttl
local turn_ms = tonumber(ARGV[5])
if task_lane > 0 then redis.call('ZADD', KEYS[1], now, task_lane) end
local lanes = lanes_of(prefix, now, LANE_KEEP_TTLS * ttl)
local opens, oldest = {}, {}
local task_lane_found, task_open = nil, false
for _, lane in ipairs(lanes) do
  local bid, opened, max = open_batch(lane_key(prefix, 'open', lane))
  if bid then opens[lane] = {bid, opened, max} end
  local unsealed_key = lane_key(prefix, 'unsealed', lane)
  for _, bid in ipairs(redis.call('ZRANGEBYSCORE', unsealed_key, stale, '+inf', 'LIMIT', 0,
                                  VIABLE_SCAN)) do
    local last = redis.call('LINDEX', ARGV[2] .. bid, -1)
    if last and tonumber(string.match(last, '^%d+')) >= now + turn_ms then
      oldest[lane] = bid
      break
    end
  end
  if not task_lane_found then
    if bid == task_bid then
      task_lane_found, task_open = lane, true
    elseif redis.call('ZSCORE', unsealed_key, task_bid) then
      task_lane_found = lane
    end
  end
end
local taken_over = not task_lane_found and redis.call('ZREM', KEYS[5], task_bid) == 1
local lane, claimed
if exact or not (task_lane_found or taken_over) then
  lane = task_lane_found
else
  local full_below, any_full = {}, false
  for index = #lanes, 1, -1 do
    full_below[lanes[index]] = any_full
    if oldest[lanes[index]] then any_full = true end
  end
  for _, each in ipairs(lanes) do
    local wait = full_below[each] and hold * HOLD_LATE_FACTOR or hold
    if oldest[each] or (opens[each] and now - opens[each][2] >= wait) then
      lane, claimed = each, each
      break
    end
  end
  -- The turn was left to every lane below the one that claimed it (every lane, when none
  -- did): the lanes' shares of the shard's turns, for admission.
  local shares = {}
  for _, each in ipairs(lanes) do
    local left = (not claimed or each >= claimed) and 1 or 0
    local share = tonumber(redis.call('HGET', KEYS[3], 'share:' .. each) or 1)
    table.insert(shares, 'share:' .. each)
    table.insert(shares, share + SHARE_WEIGHT * (left - share))
    if left == 1 then
      table.insert(shares, 'avail_at:' .. each)
      table.insert(shares, now)
    end
  end
  if #shares > 0 then redis.call('HSET', KEYS[3], unpack(shares)) end
  if not lane then
    local most = 0
    for _, each in ipairs(lanes) do
      if opens[each] then
        local length = redis.call('LLEN', lane_key(prefix, 'pending', each))
        if length > most then lane, most = each, length end
      end
    end
  end
end
local chosen, chosen_open = nil, false
if lane then
  if lane == task_lane_found and (exact or not task_open or not oldest[lane]) then
    chosen, chosen_open = task_bid, task_open
  elseif oldest[lane] then
    chosen = oldest[lane]
  else
    chosen, chosen_open = opens[lane][1], true
  end
end
local items = {}
local opened_at = -1
if chosen then
  local unsealed_key = lane_key(prefix, 'unsealed', lane)
  if chosen_open then
    local pending_key = lane_key(prefix, 'pending', lane)
    opened_at = opens[lane][2]
    items = redis.call('LRANGE', pending_key, 0, opens[lane][3] - 1)
    redis.call('DEL', pending_key, lane_key(prefix, 'open', lane))
  else
    opened_at = tonumber(redis.call('ZSCORE', unsealed_key, chosen) or -1)
    local batch_key = ARGV[2] .. chosen
    items = redis.call('LRANGE', batch_key, 0, -1)
    redis.call('DEL', batch_key)
  end
  redis.call('ZREM', unsealed_key, chosen)
  redis.call('ZREMRANGEBYSCORE', unsealed_key, '-inf', stale)
  if lane > 0 then redis.call('ZADD', KEYS[1], now, lane) end
  if chosen ~= task_bid and task_lane_found then
    redis.call('ZADD', KEYS[5], now, chosen)
    inherit(KEYS[4], chosen, task_bid)
    inherit(KEYS[2], chosen, task_bid)
    inherit(KEYS[2], chosen .. held, task_bid .. held)
  end
  redis.call('ZREM', KEYS[4], chosen)
  redis.call('ZREM', KEYS[2], chosen, chosen .. held)
end
if not task_lane_found then
  redis.call('ZREM', KEYS[4], task_bid)
  redis.call('ZREM', KEYS[2], task_bid, task_bid .. held)
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', stale)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', stale)
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', stale)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - LANE_KEEP_TTLS * ttl)
if tonumber(ARGV[4]) > 0 then
  set_admission_inputs(KEYS[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
end
refresh_admission(prefix, lanes, KEYS[3], now)
local due = take_due(KEYS[2], prefix, lanes, KEYS[4], ARGV[2], now, tonumber(ARGV[9]),
                     tonumber(ARGV[10]))
local reply = {now, opened_at, chosen or '', lane or -1, #due}
for _, due_bid in ipairs(due) do table.insert(reply, due_bid) end
for _, item in ipairs(items) do table.insert(reply, item) end
return reply
"""
)
for name, value in {
    "LANE_KEEP_TTLS": LANE_KEEP_TTLS,
    "SHARE_WEIGHT": SHARE_WEIGHT,
    "VIABLE_SCAN": VIABLE_SCAN,
    "HOLD_LATE_FACTOR": HOLD_LATE_FACTOR,
}.items():
    SEAL_LUA = SEAL_LUA.replace(name, str(value))

# KEYS: hand-over due (zset), sent (zset), lanes (zset)
# ARGV: batch key prefix, dispatch grace ms, at most this many, shard prefix, ttl ms
# The batches due for a hand-over, for a worker that has not sealed a batch of this shard for
# HANDOVER_SCAN_MS: a batch is handed over even when no worker seals anything.
TAKE_DUE_LUA = (
    _NOW_FUNCTION_LUA
    + _OPEN_BATCH_LUA
    + _LANES_LUA
    + _TAKE_DUE_LUA
    + """
local now = now_ms()
local lanes = lanes_of(ARGV[4], now, LANE_KEEP_TTLS * tonumber(ARGV[5]))
return take_due(KEYS[1], ARGV[4], lanes, KEYS[2], ARGV[1], now, tonumber(ARGV[2]),
                tonumber(ARGV[3]))
"""
).replace("LANE_KEEP_TTLS", str(LANE_KEEP_TTLS))

# KEYS: admission (hash), lanes (zset)
# ARGV: workers, turn ms, shards, window ms, inputs ttl ms, shard prefix, ttl ms
# The workers' figures for a shard's admission (every heartbeat), and lane 0's refreshed figure.
ADMISSION_LUA_SCRIPT = (
    _NOW_FUNCTION_LUA
    + _OPEN_BATCH_LUA
    + _LANES_LUA
    + _REFRESH_ADMISSION_LUA
    + _ADMISSION_INPUTS_LUA
    + """
local now = now_ms()
set_admission_inputs(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
return refresh_admission(ARGV[6], lanes_of(ARGV[6], now, LANE_KEEP_TTLS * tonumber(ARGV[7])),
                         KEYS[1], now)
"""
).replace("LANE_KEEP_TTLS", str(LANE_KEEP_TTLS))

# KEYS: live workers (zset); ARGV: worker name, heartbeat timeout ms
# Records the heartbeat at Redis time and returns how many workers are live.
HEARTBEAT_LUA = (
    _NOW_LUA
    + """
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 10 * tonumber(ARGV[2]))
return redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[2]), '+inf')
"""
)


class BatchIds:
    """Unique batch ids without uuid4's os.urandom call per request (~4% of a /sample's CPU):
    96 random bits per process, then a counter. Drawn again in a forked child, which would
    otherwise repeat its parent's ids."""

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._count = itertools.count()

    def next(self) -> str:
        if os.getpid() != self._pid:
            self._pid, self._prefix = os.getpid(), secrets.token_hex(12)
            self._count = itertools.count()
        return f"{self._prefix}{next(self._count):x}"


@dataclass(frozen=True)
class Ticket:
    """A request's place in a batch, or its refusal by admission control."""

    batch_id: str
    index: int
    opened: bool
    rejected: bool = False
    predicted_ms: int = 0
    counted: int = 0  # the rate counter after this request (0: none was raised)
    cached: bytes | None = None  # the answer from the response cache (no batch joined)
    lane: int = 0  # the lane (tier priority) of the batch joined


@dataclass(frozen=True)
class Item:
    deadline_ms: int
    prompt: str  # a /sample request's prompt ("" for a request with its own settings)
    request: SampleRequest | None = None  # the prompt and settings of an API request
    key_id: int = 0  # the API key it was sent with (0: anonymous), charged its tokens
    cache: str = ""  # the digest its answer is cached under (batching.cache), "" for none


@dataclass(frozen=True)
class RateCounter:
    """A request rate counter that an append raises (INCR) in its MULTI; `expire_ms` also
    sets its expiry (the first raise of a window by this process)."""

    key: str
    expire_ms: int = 0


@dataclass(frozen=True)
class SealedBatch:
    now_ms: int
    opened_at_ms: int  # -1: no record of its opening (sealed already, or expired)
    items: list[Item]
    # Batches of the shard due for a hand-over, taken by this seal: the sealer sends their
    # tasks again.
    handovers: list[str] = field(default_factory=list)
    # The batch sealed, whose members wait for these items' answers: the task's own, or the
    # batch of a higher lane it chose ("": none, every batch of the shard sealed already).
    batch_id: str = ""
    lane: int = -1

    @property
    def sealed_before(self) -> bool:
        """Nothing to answer: the task's batch was sealed by an earlier task (a duplicate sent
        by a hand-over), or it expired, and the shard had no other batch waiting."""
        return not self.batch_id and not self.items


@dataclass(frozen=True)
class AdmissionInputs:
    """What a worker knows that admission needs, passed with every seal and heartbeat."""

    workers: int
    turn_ms: float


def item_of(deadline_ms: int, prompt: str | SampleRequest, key_id: int = 0, cache: str = "") -> str:
    """An item as a pending list holds it: its deadline (Redis ms) and, for a keyed request,
    "/<key id>", and for a request whose answer is to be cached "/<key id>/<digest>"; then a
    space and the bare prompt of a /sample request (the queue's settings), or a colon and a
    request's JSON."""
    head = f"{deadline_ms}/{key_id}" if key_id or cache else str(deadline_ms)
    if cache:
        head += f"/{cache}"
    if isinstance(prompt, str):
        return f"{head} {prompt}"
    return f"{head}:{prompt.to_json()}"


def _parse_item(raw: bytes) -> Item:
    space, colon = raw.find(b" "), raw.find(b":")
    sample = colon < 0 or 0 <= space < colon  # the head is followed by one of the two
    end = space if sample else colon
    deadline, _, rest = raw[:end].partition(b"/")
    key, _, digest = rest.partition(b"/")
    key_id, cache = int(key) if key else 0, digest.decode()
    if sample:
        return Item(int(deadline), raw[space + 1 :].decode("utf-8"), key_id=key_id, cache=cache)
    return Item(int(deadline), "", SampleRequest.from_json(raw[colon + 1 :]), key_id, cache)


def _worker_info(raw: bytes | None) -> dict[str, Any]:
    try:
        info = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def batch_ttl_ms(deadline_ms: int) -> int:
    """How long a batch's data lives: a few deadlines, long enough for any batch a live
    caller waits on, short enough that an abandoned batch (no worker) does not linger."""
    return max(4 * deadline_ms, 2000)


class BatchAggregator:
    """A queue's aggregator: `shards` open batches (one by default), each on its own hash tag.
    A web process spreads its requests over them in turn; a worker seals a batch on the shard
    its id names."""

    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        *,
        max_batch_size: int = Policy.max_batch_size,
        deadline_ms: int = Policy.deadline_ms,
        shards: int = 1,
    ) -> None:
        self.client = client
        self.queue = queue
        self.keys = QueueKeys(queue)
        self.shards = [ShardKeys(tag) for tag in shard_tags(queue, shards)]
        self._shard_of_tag = {keys.tag: keys for keys in self.shards}
        # Each process starts its turn at its own shard, so that a node's processes do not
        # move over the shards in step.
        self._turn = itertools.count(os.getpid())
        self._ids = BatchIds()
        # Per shard and lane: (admission's figure, when read); per shard: (Redis ms -
        # monotonic ms, when read).
        self._admission_seen: dict[tuple[int, int], tuple[float, float]] = {}
        self._clock_offsets: dict[str, tuple[float, float]] = {}
        self._cluster = is_cluster(client)
        self.configure(max_batch_size=max_batch_size, deadline_ms=deadline_ms)
        self._clock = client.register_script(CLOCK_LUA)
        self._close = client.register_script(CLOSE_LUA)
        self._seal = client.register_script(SEAL_LUA)
        self._heartbeat = client.register_script(HEARTBEAT_LUA)
        self._take_due = client.register_script(TAKE_DUE_LUA)
        self._admission = client.register_script(ADMISSION_LUA_SCRIPT)
        self._cached_append = client.register_script(CACHED_APPEND_LUA)

    def configure(self, *, max_batch_size: int, deadline_ms: int) -> None:
        """Apply a policy: called at start and by the policy watcher when it changes."""
        if not 1 <= max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be 1..{MAX_BATCH_SIZE}, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.deadline_ms = deadline_ms
        self.ttl_ms = batch_ttl_ms(deadline_ms)
        self.hold_ms = round(deadline_ms * HOLD_DEADLINE_FRACTION)

    @property
    def ttl_s(self) -> float:
        """How long a batch's data lives, in seconds: its task message and its answers live
        as long (Celery's `expires`, the result's expiry)."""
        return self.ttl_ms / 1000

    def load_scripts(self) -> None:
        """Load the Lua scripts into Redis now rather than on a request's first NOSCRIPT (on
        every master of a cluster)."""
        scripts = (
            self._clock, self._close, self._seal, self._heartbeat, self._take_due,
            self._admission, self._cached_append,
        )  # fmt: skip
        for script in scripts:
            self.client.script_load(script.script)

    def shard_of(self, batch_id: str) -> ShardKeys:
        """The shard whose keys hold the batch (named by the batch id's tag)."""
        keys = self._shard_of_tag.get(tag_of(batch_id))
        if keys is None:
            # An id of another shard layout (SAMPLING_SHARDS changed while it waited), or of
            # the version before shards: its keys are named by its tag all the same.
            keys = ShardKeys(tag_of(batch_id) or self.queue)
        return keys

    def append(
        self,
        prompt: str | SampleRequest,
        budget_ms: int,
        shard: int | None = None,
        *,
        key_id: int = 0,
        counter: RateCounter | None = None,
        cache: str = "",
        lane: int = 0,
    ) -> Ticket:
        """Join the open batch of `lane` (the caller's tier priority) on `shard` (by default
        the next shard in this process's turn) with a bare prompt (the queue's settings) or a
        request with its own settings: the request's one round trip, a MULTI of plain
        commands (a Lua call costs a Redis core several times more): SET NX GET of the lane's
        open pointer (the batch joined, or this request's new one) and RPUSH of the item; and
        HGET of the lane's admission figure when this process read it over
        ADMISSION_REFRESH_S ago.

        Admission is decided before the call from the figure this process read last (a
        refusal needs no Redis call at all); a figure missing, or one that would refuse and
        was read over ADMISSION_FRESH_S ago, is read again first. A process admits requests
        for at most ADMISSION_REFRESH_S and one request after the figure turned against it.

        A keyed request names its key (`key_id`, for the workers' token charges) and, when
        the key has a request rate limit, the counter its MULTI raises (`counter`, on the
        shard's slot: see `shard_of_key`); the ticket carries the count after it.

        A request the response cache may answer names its digest (`cache`, batching.cache):
        its one call (a script, then) returns the cached answer when there is one, in the
        ticket, and joins no batch; else it joins as any request, and the worker caches its
        answer."""
        index = (next(self._turn) if shard is None else shard) % len(self.shards)
        keys = self.shards[index]
        lane_keys = LaneKeys.of(keys, lane)
        seen = self._admission_seen.get((index, lane))
        now_s = time.monotonic()
        if seen is None or (seen[0] > budget_ms and now_s - seen[1] > ADMISSION_FRESH_S):
            figure = float(self.client.hget(keys.admission, lane_keys.predicted) or 0)
            seen = self._admission_seen[index, lane] = (figure, now_s)
        if seen[0] > 0 and seen[0] > budget_ms:
            return Ticket("", -1, False, True, int(seen[0]), lane=lane)
        counted = 0
        for _ in range(APPEND_ATTEMPTS):
            now_ms = self._redis_now_ms(keys, now_s)
            candidate = keys.batch_id(self._ids.next())
            read_admission = now_s - seen[1] > ADMISSION_REFRESH_S
            pointer = f"{candidate} {now_ms} {self.max_batch_size}"
            item = item_of(now_ms + int(budget_ms), prompt, key_id, cache)
            if cache:
                hit, *more = self._join_cached(
                    keys, lane_keys, cache, pointer, item, read_admission, counter
                )
                if hit:
                    counted = int(more[1]) if counter is not None else 0
                    return Ticket("", -1, False, counted=counted, cached=more[0], lane=lane)
                joined, length, *more = more
            else:
                joined, length, *more = self._join(
                    lane_keys, pointer, item, read_admission, counter
                )
            if read_admission:
                seen = self._admission_seen[index, lane] = (float(more.pop(0) or 0), now_s)
            counted = int(more[0]) if counter is not None else 0
            counter = None  # raised once, whatever batch the request ends in
            if joined is None:
                batch_id, max_size, opened = candidate, self.max_batch_size, True
            else:
                fields = joined.decode().split(" ")
                batch_id = fields[0]
                max_size = int(fields[2]) if len(fields) > 2 else MAX_BATCH_SIZE
                opened = False
            if length >= max_size:  # full: the next request opens a new batch
                self.close(batch_id, lane)
            if length <= max_size:
                return Ticket(batch_id, length - 1, opened, counted=counted, lane=lane)
            # Pushed onto a batch already full (before its closer moved it): join the next.
        raise redis.RedisError(f"no batch of shard {keys.tag} took the request")

    def shard_of_key(self, key_id: int) -> int:
        """The shard an API key's requests join: always the same one, so that its request
        counter lives on the slot of their appends."""
        return key_id % len(self.shards)

    def _join(
        self,
        keys: LaneKeys,
        pointer: str,
        item: str,
        read_admission: bool,
        counter: RateCounter | None,
    ) -> list[Any]:
        """The append's MULTI: [the open pointer before (None: `pointer` set), the pending
        list's length, (the admission figure), (the rate counter after its raise)]."""
        join = self._join_pipelined if self._cluster else self._join_packed
        # A cluster's pipeline routes the MULTI to the shard's master.
        replies = join(keys, pointer, item, read_admission, counter)
        return replies[:-1] if counter is not None and counter.expire_ms else replies  # PEXPIRE

    def _join_cached(
        self,
        keys: ShardKeys,
        lane: LaneKeys,
        digest: str,
        pointer: str,
        item: str,
        read_admission: bool,
        counter: RateCounter | None,
    ) -> list[Any]:
        """CACHED_APPEND_LUA: [1, the cached answer, (the rate counter)], or [0, then what
        `_join` returns]."""
        script_keys = [keys.cached(digest), lane.open_batch, lane.pending, keys.admission]
        if counter is not None:
            script_keys.append(counter.key)
        args = [
            pointer,
            item,
            self.ttl_ms,
            lane.predicted if read_admission else "",
            counter.expire_ms if counter else 0,
        ]
        return list(self._cached_append(keys=script_keys, args=args))

    def queue_cached_answers(
        self, pipe: redis.client.Pipeline, answers: Mapping[str, str], ttl_ms: int
    ) -> None:
        """Queue on `pipe` the answers (JSON) of sampled requests, by digest, on every shard:
        an identical request finds it whichever shard it joins."""
        for digest, answer in answers.items():
            for keys in self.shards:
                pipe.set(keys.cached(digest), answer, px=ttl_ms)

    def _join_pipelined(
        self,
        keys: LaneKeys,
        pointer: str,
        item: str,
        read_admission: bool,
        counter: RateCounter | None,
    ) -> list[Any]:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.set(keys.open_batch, pointer, nx=True, get=True, px=self.ttl_ms)
            pipe.rpush(keys.pending, item)
            if read_admission:
                pipe.hget(keys.admission, keys.predicted)
            if counter is not None:
                pipe.incr(counter.key)
                if counter.expire_ms:
                    pipe.pexpire(counter.key, counter.expire_ms)
            return list(pipe.execute())

    def _join_packed(
        self,
        keys: LaneKeys,
        pointer: str,
        item: str,
        read_admission: bool,
        counter: RateCounter | None,
    ) -> list[Any]:
        """`_join_pipelined`'s bytes, sent by hand on a pooled connection: redis-py's Pipeline
        spends several times the Python on them (`python -m bench.append_cost`)."""
        commands: list[tuple[str | int, ...]] = [
            ("MULTI",),
            ("SET", keys.open_batch, pointer, "NX", "GET", "PX", self.ttl_ms),
            ("RPUSH", keys.pending, item),
        ]
        if read_admission:
            commands.append(("HGET", keys.admission, keys.predicted))
        if counter is not None:
            commands.append(("INCR", counter.key))
            if counter.expire_ms:
                commands.append(("PEXPIRE", counter.key, counter.expire_ms))
        commands.append(("EXEC",))
        pool = self.client.connection_pool
        # The pool hands out a connection Redis closed (restarted) only after reconnecting it.
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            for _ in range(len(commands) - 1):
                conn.read_response()  # +OK, then +QUEUED (an error raises)
            replies = conn.read_response()
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(conn)
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
        return list(replies)

    def _redis_now_ms(self, keys: ShardKeys, now: float | None = None) -> int:
        """The shard's Redis server time in ms, from this process's monotonic clock and an
        offset read with TIME every CLOCK_REFRESH_S (items' deadlines and batches' times are
        in the time of the Redis node that holds them: no shared clock).

        Never ahead of the node's clock: TIME ran at some point of its round trip, so the
        node's time minus the round trip's end is a lower bound of the offset, and the
        largest of CLOCK_SAMPLES such bounds the tightest. A midpoint could be ahead by half
        a round trip, and a first round trip that also connects and loads the script, under
        gevent on busy cores, can take tens of ms: a request's deadline then lay that much
        past its budget in the node's time, and a worker sampled items it should have
        dropped, answering after their requests had given up."""
        offset = self._clock_offsets.get(keys.tag)
        now = time.monotonic() if now is None else now
        if offset is None or now - offset[1] > CLOCK_REFRESH_S:
            bounds = []
            for _ in range(CLOCK_SAMPLES):
                seconds, micros = self._clock(keys=[keys.open_batch])
                now = time.monotonic()
                bounds.append(int(seconds) * 1000 + int(micros) / 1000 - now * 1000)
            offset = self._clock_offsets[keys.tag] = (max(bounds), now)
        return int(now * 1000 + offset[0])

    def open_batch_id(self, shard: int = 0, lane: int = 0) -> str | None:
        """The id of the batch a request of `lane` on `shard` would join now (None: it would
        open one)."""
        raw = self.client.get(self.shards[shard].open_of(lane))
        return raw.decode().split(" ")[0] if raw else None

    def close(self, batch_id: str, lane: int = 0) -> bool:
        """Close the batch of `lane` to newcomers (it is full), if it is the lane's open one;
        its items wait in its own list for its seal. False when it was not open."""
        keys = self.shard_of(batch_id)
        lane_keys = LaneKeys.of(keys, lane)
        script_keys = [
            lane_keys.open_batch, lane_keys.pending, lane_keys.unsealed, keys.handover_due,
            keys.admission, keys.sent, keys.lanes,
        ]  # fmt: skip
        args = [batch_id, keys.batch_prefix, self.ttl_ms, DISPATCH_GRACE_MS, keys.prefix, lane]
        return bool(self._close(keys=script_keys, args=args))

    def dispatched(self, batch_id: str, lane: int = 0) -> None:
        """The batch's task is sent: it is no longer due for a hand-over for want of a
        dispatch, and its lane is one the seals choose among. Plain commands, one round trip;
        the pending list's expiry is refreshed here, once a batch (a list left by a queue no
        worker serves goes away on its own)."""
        keys = self.shard_of(batch_id)
        now_ms = self._redis_now_ms(keys)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.sent, {batch_id: now_ms})
            pipe.zrem(keys.handover_due, batch_id)
            pipe.pexpire(keys.pending_of(lane), self.ttl_ms)
            if lane:
                pipe.zadd(keys.lanes, {str(lane): now_ms})
            pipe.execute()

    def hold(self, batch_id: str, seal_in_ms: float) -> bool:
        """A worker received the batch's task and expects to seal it within `seal_in_ms`: if it
        has not by DISPATCH_GRACE_MS later (the worker died), the batch is handed over. Its own
        hand-over member, so that a dispatcher's late confirmation cannot remove it. False
        when the batch is sealed already (its member, then, is dropped by the next scan).
        Plain commands, one round trip."""
        keys = self.shard_of(batch_id)
        due_ms = self._redis_now_ms(keys) + max(0, round(seal_in_ms)) + DISPATCH_GRACE_MS
        with self.client.pipeline(transaction=False) as pipe:
            pipe.get(keys.open_batch)
            pipe.exists(keys.batch(batch_id))
            pipe.zadd(keys.handover_due, {batch_id + HELD_SUFFIX: due_ms})
            pointer, closed, _ = pipe.execute()
        return bool(closed) or (pointer is not None and pointer.decode().split(" ")[0] == batch_id)

    def take_due_handovers(self, shard: int = 0, limit: int = 10) -> list[str]:
        """Batches of `shard` due for a hand-over, whose tasks the caller sends again: each due
        one is taken by one caller (a worker's seal or scan)."""
        keys = self.shards[shard]
        taken = self._take_due(
            keys=[keys.handover_due, keys.sent, keys.lanes],
            args=[keys.batch_prefix, DISPATCH_GRACE_MS, limit, keys.prefix, self.ttl_ms],
        )
        return [batch_id.decode() for batch_id in taken]

    def seal(
        self,
        batch_id: str,
        inputs: AdmissionInputs | None = None,
        *,
        lane: int = -1,
        exact: bool = False,
    ) -> SealedBatch:
        """Take the items of a batch of the task's shard (closing it, if it is an open one):
        the task's own batch (`batch_id`, of `lane`; -1: not known), or one of a higher lane
        whose batch is ready (see SEAL_LUA); `exact`: that batch or none. A worker passes what
        it knows for admission (`inputs`), and gets the shard's batches due for a hand-over."""
        keys = self.shard_of(batch_id)
        raw = self._seal(
            keys=[keys.lanes, keys.handover_due, keys.admission, keys.sent, keys.taken_over],
            args=[
                batch_id,
                keys.batch_prefix,
                HELD_SUFFIX,
                *self._admission_args(inputs or AdmissionInputs(0, 0.0)),
                DISPATCH_GRACE_MS,
                HANDOVERS_PER_SEAL,
                self.ttl_ms,
                keys.prefix,
                lane,
                int(exact),
                self.hold_ms,
            ],
        )
        handed = int(raw[4])
        return SealedBatch(
            int(raw[0]),
            int(raw[1]),
            [_parse_item(item) for item in raw[5 + handed :]],
            [due.decode() for due in raw[5 : 5 + handed]],
            raw[2].decode(),
            int(raw[3]),
        )

    def abandon(self, batch_id: str, lane: int = -1) -> int:
        """Close a batch whose task cannot be sent, so no later request joins it; returns how
        many members it had (its dispatcher answers them)."""
        return len(self.seal(batch_id, lane=lane, exact=True).items)

    def _admission_args(self, inputs: AdmissionInputs) -> list[int | float]:
        return [
            inputs.workers,
            round(inputs.turn_ms),
            len(self.shards),
            self.deadline_ms,
            HEARTBEAT_TIMEOUT_MS,
        ]

    def refresh_admission(self, inputs: AdmissionInputs) -> list[int]:
        """Give every shard the workers' figures for admission (a worker's heartbeat, once a
        second); returns each shard's predicted ms (0: admit; -1: its Redis node is away,
        which does not keep the other shards from theirs)."""
        predicted = []
        for keys in self.shards:
            try:
                figure = self._admission(
                    keys=[keys.admission, keys.lanes],
                    args=[*self._admission_args(inputs), keys.prefix, self.ttl_ms],
                )
            except redis.RedisError as exc:
                log.warning("admission figures of shard %s not refreshed: %s", keys.tag, exc)
                figure = -1
            predicted.append(int(figure))
        return predicted

    def heartbeat(self, worker: str) -> int:
        """Record a live worker and return the number of live workers of this queue."""
        return int(
            self._heartbeat(keys=[self.keys.live_workers], args=[worker, HEARTBEAT_TIMEOUT_MS])
        )

    def live_workers(self) -> int:
        return int(self._heartbeat(keys=[self.keys.live_workers], args=["", HEARTBEAT_TIMEOUT_MS]))

    def worker_infos(self, since_s: float) -> list[tuple[str, dict[str, Any]]]:
        """The queue's workers seen since `since_s` (epoch seconds), each with its last
        heartbeat's record ({} when it expired or cannot be read): two round trips."""
        names = [
            name.decode()
            for name in self.client.zrange(
                self.keys.known_workers, int(since_s), "+inf", byscore=True
            )
        ]
        if not names:
            return []
        raws = self.client.mget([self.keys.worker_info(name) for name in names])
        return [(name, _worker_info(raw)) for name, raw in zip(names, raws, strict=True)]

    def forget_worker(self, worker: str) -> None:
        self.client.zrem(self.keys.live_workers, worker)

    def queue_record(
        self, pipe: redis.client.Pipeline, record: str, counts: Mapping[str, int], at_s: float
    ) -> None:
        """Queue on `pipe` a batch's record (JSON; the last BATCH_LOG_LENGTH are kept for
        operators, tests and the benchmark) and its statistics `counts`, added to the time
        buckets of `at_s`."""
        pipe.lpush(self.keys.batch_log, record)
        pipe.ltrim(self.keys.batch_log, 0, BATCH_LOG_LENGTH - 1)
        stats.add_counts(pipe, self.queue, at_s, counts)

    def recent_batches(self, count: int = BATCH_LOG_LENGTH) -> list[bytes]:
        return list(self.client.lrange(self.keys.batch_log, 0, count - 1))

    def queue_turn_ms(self, pipe: redis.client.Pipeline, turn_ms: float) -> None:
        """Queue on `pipe` how long a batch's turn on a GPU takes, for operators."""
        # Kept a few deadlines only: a stale figure must not outlive the workers long.
        pipe.set(self.keys.turn_ms, max(1, round(turn_ms)), px=self.ttl_ms * 5)

    def publish_turn_ms(self, turn_ms: float) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            self.queue_turn_ms(pipe, turn_ms)
            pipe.execute()

    def published_turn_ms(self) -> float:
        raw = self.client.get(self.keys.turn_ms)
        return float(raw) if raw else 0.0
