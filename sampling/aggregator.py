"""The Redis batch aggregator shared by every web process and every worker of one queue.

One open batch per queue. A request joins it with one atomic Lua call (APPEND); the call that
opens a batch tells its caller to dispatch the batch's Celery task at once, with the batch id
as task id, so every member knows which result to wait on before the batch is closed. A call
that fills the batch closes it. The worker seals the batch (SEAL) when it starts the task,
i.e. when a GPU is free, and takes every item appended so far: while the GPUs are busy new
requests pile into the open batch, so the batch size follows the load with no timer.

All keys of a queue share the hash tag {queue}, so the scripts stay on one slot of a Redis
cluster. Times are Redis server time (TIME), so web and GPU nodes need no shared clock.

This module knows nothing of Django or models: it takes a redis client and numbers.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from sampling import stats

# KEYS: open pointer, unsealed batches (zset), live workers (zset), recent ms per batch
# ARGV: candidate batch id, request id, prompt, budget ms, max size, ttl ms,
#       heartbeat timeout ms, batch key prefix, admission window ms
# Returns {batch id, index, opened, deadline ms} or {"", -1, 0, predicted ms} when rejected.
APPEND_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local budget = tonumber(ARGV[4])
local deadline = now + budget
local bid = redis.call('GET', KEYS[1])

-- Admission: when batches are queued behind every live worker (a backlog), predict when a
-- batch joined now would finish, from the batches ahead of it, the workers and the recent
-- time of a batch's turn on a GPU, and refuse at once if that is past the deadline. The
-- prediction is the worst case: the calls running now may have just started, so the batch
-- waits for them, for the batches ahead, then for its own call. An optimistic one lets in
-- requests that expire in the queue: the benchmark's overload runs lost a quarter of the
-- goodput that way (docs/benchmarks). Without a backlog (or without live workers) the
-- request is always taken: the worker drops it if it cannot be met, and without workers it
-- waits for its deadline.
local workers = redis.call('ZCOUNT', KEYS[3], now - tonumber(ARGV[7]), '+inf')
if workers > 0 then
  local sampler_ms = tonumber(redis.call('GET', KEYS[4]) or '0')
  local ahead = redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[9]), '+inf')
  if bid then ahead = ahead - 1 end
  if sampler_ms > 0 and ahead >= workers then
    local predicted = (math.floor(ahead / workers) + 2) * sampler_ms
    if predicted > budget then
      return {'', -1, 0, predicted}
    end
  end
end

local opened = 0
local ttl = tonumber(ARGV[6])
if not bid then
  bid = ARGV[1]
  opened = 1
  redis.call('SET', KEYS[1], bid, 'PX', ttl)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
  redis.call('ZADD', KEYS[2], now, bid)
end
local batch_key = ARGV[8] .. bid
local n = redis.call('RPUSH', batch_key, deadline .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
if n == 1 then redis.call('PEXPIRE', batch_key, ttl) end
if n >= tonumber(ARGV[5]) then
  redis.call('DEL', KEYS[1])
end
return {bid, n - 1, opened, deadline}
"""

# KEYS: open pointer, unsealed batches (zset); ARGV: batch id, batch key prefix
# Returns {now ms, opened-at ms (or -1), items...}. Atomic with APPEND: an append lands either
# in this batch (and is returned here) or, after the pointer is cleared, in a new batch.
SEAL_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
local opened_at = redis.call('ZSCORE', KEYS[2], ARGV[1]) or -1
redis.call('ZREM', KEYS[2], ARGV[1])
local batch_key = ARGV[2] .. ARGV[1]
local items = redis.call('LRANGE', batch_key, 0, -1)
redis.call('DEL', batch_key)
table.insert(items, 1, tonumber(opened_at))
table.insert(items, 1, now)
return items
"""

# KEYS: live workers (zset); ARGV: worker name, heartbeat timeout ms
# Records the heartbeat at Redis time and returns how many workers are live.
HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[1] ~= '' then redis.call('ZADD', KEYS[1], now, ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 10 * tonumber(ARGV[2]))
return redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[2]), '+inf')
"""

HEARTBEAT_TIMEOUT_MS = 5000

# The outcome of one item in a batch's result, which is a list aligned with the batch's items,
# each entry [outcome, text]: the completion for OK, a one-line reason otherwise.
OK = "ok"
EXPIRED = "expired"  # dropped by the worker before sampling: its deadline could not be met
REJECTED = "rejected"  # the sampler refused this prompt alone (e.g. too long for the model)
ERROR = "error"  # the sampler failed for the whole batch


@dataclass(frozen=True)
class Ticket:
    """A request's place in a batch, or its rejection by admission control."""

    batch_id: str
    index: int
    opened: bool
    deadline_ms: int
    rejected: bool = False
    predicted_ms: int = 0


@dataclass(frozen=True)
class Item:
    deadline_ms: int
    request_id: str
    prompt: str


@dataclass(frozen=True)
class SealedBatch:
    now_ms: int
    opened_at_ms: int  # -1 when unknown (the batch outlived its bookkeeping)
    items: list[Item]


def _parse_item(raw: bytes) -> Item:
    deadline, request_id, prompt = raw.split(b" ", 2)
    return Item(int(deadline), request_id.decode(), prompt.decode("utf-8"))


class BatchAggregator:
    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        *,
        max_batch_size: int = 100,
        deadline_ms: int = 500,
    ) -> None:
        self.client = client
        self.queue = queue
        self.configure(max_batch_size=max_batch_size, deadline_ms=deadline_ms)
        tag = f"sampling:{{{queue}}}"
        self.open_key = f"{tag}:open"
        self.unsealed_key = f"{tag}:unsealed"
        self.workers_key = f"{tag}:workers"
        self.sampler_ms_key = f"{tag}:sampler_ms"
        self.batch_prefix = f"{tag}:batch:"
        self.batch_log_key = f"{tag}:batches"
        self.worker_info_prefix = f"{tag}:worker:"
        self._append = client.register_script(APPEND_LUA)
        self._seal = client.register_script(SEAL_LUA)
        self._heartbeat = client.register_script(HEARTBEAT_LUA)

    def configure(self, *, max_batch_size: int, deadline_ms: int) -> None:
        """Apply a policy: called at start and by the policy watcher when it changes."""
        if not 1 <= max_batch_size <= 100:
            raise ValueError(f"max_batch_size must be 1..100, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.deadline_ms = deadline_ms
        # A few deadlines: long enough for any batch a live caller waits on, short enough
        # that an abandoned batch (no worker) does not linger.
        self.ttl_ms = max(4 * deadline_ms, 2000)

    def load_scripts(self) -> None:
        """Load the Lua scripts into Redis now rather than on a request's first NOSCRIPT."""
        for script in (self._append, self._seal, self._heartbeat):
            self.client.script_load(script.script)

    def append(self, request_id: str, prompt: str, budget_ms: int) -> Ticket:
        bid, index, opened, value = self._append(
            keys=[self.open_key, self.unsealed_key, self.workers_key, self.sampler_ms_key],
            args=[
                uuid.uuid4().hex,
                request_id,
                prompt,
                int(budget_ms),
                self.max_batch_size,
                self.ttl_ms,
                HEARTBEAT_TIMEOUT_MS,
                self.batch_prefix,
                self.deadline_ms,
            ],
        )
        if index < 0:
            return Ticket("", -1, False, 0, rejected=True, predicted_ms=int(value))
        return Ticket(bid.decode(), int(index), bool(opened), int(value))

    def seal(self, batch_id: str) -> SealedBatch:
        raw = self._seal(
            keys=[self.open_key, self.unsealed_key], args=[batch_id, self.batch_prefix]
        )
        return SealedBatch(int(raw[0]), int(raw[1]), [_parse_item(item) for item in raw[2:]])

    def heartbeat(self, worker: str) -> int:
        """Record a live worker and return the number of live workers of this queue."""
        return int(self._heartbeat(keys=[self.workers_key], args=[worker, HEARTBEAT_TIMEOUT_MS]))

    def live_workers(self) -> int:
        return int(self._heartbeat(keys=[self.workers_key], args=["", HEARTBEAT_TIMEOUT_MS]))

    def forget_worker(self, worker: str) -> None:
        self.client.zrem(self.workers_key, worker)

    def record_batch(
        self, record: str, counts: Mapping[str, int], at_s: float, keep: int = 1000
    ) -> None:
        """Keep the last `keep` batch records (JSON) for operators and tests, and add the
        batch's statistics `counts` to the time buckets of `at_s`: one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.lpush(self.batch_log_key, record)
            pipe.ltrim(self.batch_log_key, 0, keep - 1)
            stats.add_counts(pipe, self.queue, at_s, counts)
            pipe.execute()

    def recent_batches(self, count: int = 1000) -> list[bytes]:
        return self.client.lrange(self.batch_log_key, 0, count - 1)

    def publish_sampler_ms(self, sampler_ms: float) -> None:
        """Publish how long a batch's turn on a GPU takes, for admission control."""
        # Kept a few deadlines only: a stale figure must not throttle admission forever.
        self.client.set(self.sampler_ms_key, max(1, round(sampler_ms)), px=self.ttl_ms * 5)
