"""The Redis batch aggregator shared by every web process and every worker of one queue.

One open batch per queue. A request joins it with one atomic Lua call (APPEND); the call that
opens a batch tells its caller to dispatch the batch's Celery task at once, with the batch id
as task id, so every member knows which result to wait on before the batch is closed. A call
that fills the batch closes it. The worker seals the batch (SEAL) when it starts the task,
i.e. when a GPU is free, and takes every item appended so far: while the GPUs are busy new
requests pile into the open batch, so the batch size follows the load with no timer.

A batch whose task was never sent cannot be sealed, so every opened batch is due for a
hand-over DISPATCH_GRACE_MS after it opened, until its dispatcher confirms the send
(`dispatched`). If the send fails, the dispatcher closes the batch (`abandon`) and answers its
members at once. If the dispatcher dies between the two, the next request after the due time
is told to hand the batch over: to send its task again (a duplicate task finds the batch
sealed and answers nothing). A worker that receives a batch's task while its GPU is still
busy (workers.pipeline takes the next task before the running call ends) marks the batch held
(`hold`), due for a hand-over a grace after the worker expects to seal it: a worker killed
before the seal loses only the batch it was running, not the one it held.

All keys of a queue come from QueueKeys and share the hash tag {queue}, so the scripts stay
on one slot of a Redis cluster. Times are Redis server time (TIME), so web and GPU nodes need
no shared clock.

This module knows nothing of Django or models: it takes a redis client and numbers.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from batching import stats
from batching.admission import ADMISSION_LUA
from batching.keys import QueueKeys
from batching.policy import MAX_BATCH_SIZE, Policy

# A dispatcher confirms its send within this long, or its batch is handed over; a worker
# seals a batch it holds within this long after it expected to, or the batch is handed over.
DISPATCH_GRACE_MS = 100
# The hand-over member of a batch that a worker holds (see `hold`), after the batch's id.
HELD_SUFFIX = ":held"
# Every worker looks this often for batches due for a hand-over: all of a dead worker's
# clients may be waiting in the batch it held, and then no request comes to hand it over.
HANDOVER_SCAN_MS = 100
# A worker that has not heartbeated for this long is not counted (admission, /readyz).
HEARTBEAT_TIMEOUT_MS = 5000
# The last batch records kept for operators, tests and the benchmark.
BATCH_LOG_LENGTH = 1000

_NOW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# take_due(key, batch prefix, now, grace ms, limit): the ids of up to `limit` batches due for a
# hand-over in zset `key`, each taken by this caller alone. A batch whose dispatch is not
# confirmed is re-armed (one caller at a time sends its task again, until it is confirmed or
# sealed); a held batch is taken once: its holder may only be slower than it expected (a
# call longer than its estimate), and a task sent again queues like any other. A member
# whose batch is gone (sealed, expired) is dropped.
_TAKE_DUE_LUA = """
local function take_due(key, batch_prefix, now, grace, limit)
  local taken = {}
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', now, 'LIMIT', 0, limit)) do
    local due_bid = string.match(member, '^[^:]+')
    if redis.call('EXISTS', batch_prefix .. due_bid) == 1 then
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

# KEYS: open pointer, unsealed batches (zset), live workers (zset), turn ms, hand-over due
#       (zset)
# ARGV: candidate batch id, prompt, budget ms, max size, ttl ms, heartbeat timeout ms,
#       batch key prefix, admission window ms, dispatch grace ms
# Returns {batch id, index, opened, predicted ms, batch to hand over}: batch id '' and index
# -1 when admission refused the request; the last is '' when no batch needs handing over.
APPEND_LUA = (
    _NOW_LUA
    + ADMISSION_LUA
    + _TAKE_DUE_LUA
    + """
local budget = tonumber(ARGV[3])
local ttl = tonumber(ARGV[5])

-- A batch due for a hand-over: this caller sends its task again.
local handover = take_due(KEYS[5], ARGV[7], now, tonumber(ARGV[9]), 1)[1] or ''

local bid = redis.call('GET', KEYS[1])
local workers = redis.call('ZCOUNT', KEYS[3], now - tonumber(ARGV[6]), '+inf')
if workers > 0 then
  local turn_ms = tonumber(redis.call('GET', KEYS[4]) or '0')
  local ahead = redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[8]), '+inf')
  if bid then ahead = ahead - 1 end
  local predicted = predicted_ms(ahead, workers, turn_ms)
  if predicted and predicted > budget then
    return {'', -1, 0, predicted, handover}
  end
end

local opened = 0
if not bid then
  bid = ARGV[1]
  opened = 1
  redis.call('SET', KEYS[1], bid, 'PX', ttl)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
  redis.call('ZADD', KEYS[2], now, bid)
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - ttl)
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[9]), bid)
end
local batch_key = ARGV[7] .. bid
local n = redis.call('RPUSH', batch_key, (now + budget) .. ' ' .. ARGV[2])
if n == 1 then redis.call('PEXPIRE', batch_key, ttl) end
if n >= tonumber(ARGV[4]) then
  redis.call('DEL', KEYS[1])
end
return {bid, n - 1, opened, 0, handover}
"""
)

# KEYS: open pointer, unsealed batches (zset), hand-over due (zset)
# ARGV: batch id, batch key prefix, held member
# Returns {now ms, opened-at ms (or -1), items...}. Atomic with APPEND: an append lands either
# in this batch (and is returned here) or, after the pointer is cleared, in a new batch.
SEAL_LUA = (
    _NOW_LUA
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
local opened_at = redis.call('ZSCORE', KEYS[2], ARGV[1]) or -1
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1], ARGV[3])
local batch_key = ARGV[2] .. ARGV[1]
local items = redis.call('LRANGE', batch_key, 0, -1)
redis.call('DEL', batch_key)
table.insert(items, 1, tonumber(opened_at))
table.insert(items, 1, now)
return items
"""
)

# KEYS: hand-over due (zset); ARGV: batch key prefix, dispatch grace ms, at most this many
# The batches due for a hand-over, for the workers, which look every HANDOVER_SCAN_MS so that a
# batch is handed over even when no request comes after it.
TAKE_DUE_LUA = (
    _NOW_LUA
    + _TAKE_DUE_LUA
    + """
return take_due(KEYS[1], ARGV[1], now, tonumber(ARGV[2]), tonumber(ARGV[3]))
"""
)

# KEYS: unsealed batches (zset), hand-over due (zset); ARGV: held member, batch id, due in ms
# A batch still unsealed becomes due for a hand-over at now + due in ms; returns 1, or 0 when
# the batch is sealed already (nothing to hold).
HOLD_LUA = (
    _NOW_LUA
    + """
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
  return 1
end
return 0
"""
)

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


@dataclass(frozen=True)
class Ticket:
    """A request's place in a batch, or its refusal by admission control; and a batch whose
    dispatch this caller must take over (`handover`), if any."""

    batch_id: str
    index: int
    opened: bool
    rejected: bool = False
    predicted_ms: int = 0
    handover: str = ""


@dataclass(frozen=True)
class Item:
    deadline_ms: int
    prompt: str


@dataclass(frozen=True)
class SealedBatch:
    now_ms: int
    opened_at_ms: int  # -1: no record of its opening (sealed already, or expired)
    items: list[Item]

    @property
    def sealed_before(self) -> bool:
        """Nothing to answer: this batch was sealed by an earlier task (a duplicate sent by a
        hand-over), or it expired; its members already have their answer or gave up."""
        return self.opened_at_ms < 0 and not self.items


def _parse_item(raw: bytes) -> Item:
    deadline, prompt = raw.split(b" ", 1)
    return Item(int(deadline), prompt.decode("utf-8"))


def batch_ttl_ms(deadline_ms: int) -> int:
    """How long a batch's data lives: a few deadlines, long enough for any batch a live
    caller waits on, short enough that an abandoned batch (no worker) does not linger."""
    return max(4 * deadline_ms, 2000)


class BatchAggregator:
    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        *,
        max_batch_size: int = Policy.max_batch_size,
        deadline_ms: int = Policy.deadline_ms,
    ) -> None:
        self.client = client
        self.queue = queue
        self.keys = keys = QueueKeys(queue)
        self._append_keys = [
            keys.open_batch,
            keys.unsealed,
            keys.live_workers,
            keys.turn_ms,
            keys.handover_due,
        ]
        self.configure(max_batch_size=max_batch_size, deadline_ms=deadline_ms)
        self._append = client.register_script(APPEND_LUA)
        self._seal = client.register_script(SEAL_LUA)
        self._heartbeat = client.register_script(HEARTBEAT_LUA)
        self._hold = client.register_script(HOLD_LUA)
        self._take_due = client.register_script(TAKE_DUE_LUA)

    def configure(self, *, max_batch_size: int, deadline_ms: int) -> None:
        """Apply a policy: called at start and by the policy watcher when it changes."""
        if not 1 <= max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be 1..{MAX_BATCH_SIZE}, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.deadline_ms = deadline_ms
        self.ttl_ms = batch_ttl_ms(deadline_ms)

    def load_scripts(self) -> None:
        """Load the Lua scripts into Redis now rather than on a request's first NOSCRIPT."""
        for script in (self._append, self._seal, self._heartbeat, self._hold, self._take_due):
            self.client.script_load(script.script)

    def append(self, prompt: str, budget_ms: int) -> Ticket:
        bid, index, opened, predicted, handover = self._append(
            keys=self._append_keys,
            args=[
                uuid.uuid4().hex,
                prompt,
                int(budget_ms),
                self.max_batch_size,
                self.ttl_ms,
                HEARTBEAT_TIMEOUT_MS,
                self.keys.batch_prefix,
                self.deadline_ms,
                DISPATCH_GRACE_MS,
            ],
        )
        handed = handover.decode()
        if index < 0:
            return Ticket("", -1, False, True, int(predicted), handed)
        return Ticket(bid.decode(), int(index), bool(opened), handover=handed)

    def dispatched(self, batch_id: str) -> None:
        """The batch's task is sent: no hand-over for want of a dispatch."""
        self.client.zrem(self.keys.handover_due, batch_id)

    def hold(self, batch_id: str, seal_in_ms: float) -> bool:
        """A worker received the batch's task and expects to seal it within `seal_in_ms`: if it
        has not by DISPATCH_GRACE_MS later (the worker died), the batch is handed over. Its own
        hand-over member, so that a dispatcher's late confirmation cannot remove it. False
        when the batch is sealed already."""
        keys = self.keys
        due_in_ms = max(0, round(seal_in_ms)) + DISPATCH_GRACE_MS
        return bool(
            self._hold(
                keys=[keys.unsealed, keys.handover_due],
                args=[batch_id + HELD_SUFFIX, batch_id, due_in_ms],
            )
        )

    def take_due_handovers(self, limit: int = 10) -> list[str]:
        """Batches due for a hand-over, whose tasks the caller sends again: each due one is
        taken by one caller (a worker's scan, or a request's APPEND)."""
        taken = self._take_due(
            keys=[self.keys.handover_due], args=[self.keys.batch_prefix, DISPATCH_GRACE_MS, limit]
        )
        return [batch_id.decode() for batch_id in taken]

    def seal(self, batch_id: str) -> SealedBatch:
        keys = self.keys
        raw = self._seal(
            keys=[keys.open_batch, keys.unsealed, keys.handover_due],
            args=[batch_id, keys.batch_prefix, batch_id + HELD_SUFFIX],
        )
        return SealedBatch(int(raw[0]), int(raw[1]), [_parse_item(item) for item in raw[2:]])

    def abandon(self, batch_id: str) -> int:
        """Close a batch whose task cannot be sent, so no later request joins it; returns how
        many members it had (its dispatcher answers them)."""
        return len(self.seal(batch_id).items)

    def heartbeat(self, worker: str) -> int:
        """Record a live worker and return the number of live workers of this queue."""
        return int(
            self._heartbeat(keys=[self.keys.live_workers], args=[worker, HEARTBEAT_TIMEOUT_MS])
        )

    def live_workers(self) -> int:
        return int(self._heartbeat(keys=[self.keys.live_workers], args=["", HEARTBEAT_TIMEOUT_MS]))

    def forget_worker(self, worker: str) -> None:
        self.client.zrem(self.keys.live_workers, worker)

    def record_batch(self, record: str, counts: Mapping[str, int], at_s: float) -> None:
        """Keep the last BATCH_LOG_LENGTH batch records (JSON) for operators and tests, and
        add the batch's statistics `counts` to the time buckets of `at_s`: one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.lpush(self.keys.batch_log, record)
            pipe.ltrim(self.keys.batch_log, 0, BATCH_LOG_LENGTH - 1)
            stats.add_counts(pipe, self.queue, at_s, counts)
            pipe.execute()

    def recent_batches(self, count: int = BATCH_LOG_LENGTH) -> list[bytes]:
        return list(self.client.lrange(self.keys.batch_log, 0, count - 1))

    def publish_turn_ms(self, turn_ms: float) -> None:
        """Publish how long a batch's turn on a GPU takes, for admission control."""
        # Kept a few deadlines only: a stale figure must not throttle admission forever.
        self.client.set(self.keys.turn_ms, max(1, round(turn_ms)), px=self.ttl_ms * 5)

    def published_turn_ms(self) -> float:
        raw = self.client.get(self.keys.turn_ms)
        return float(raw) if raw else 0.0
