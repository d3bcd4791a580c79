"""The Redis batch aggregator shared by every web process and every worker of one queue.

A queue's requests join open batches: one per shard (SAMPLING_SHARDS, one by default), each
shard's keys under its own hash tag so that a Redis cluster spreads the shards over its
masters. A request joins its shard's open batch with one short Lua call (APPEND: GET, HGET,
TIME, RPUSH), the only Redis round trip of a request. The call that opens a batch tells its
caller to dispatch the batch's Celery task at once, with the batch id as task id, so every
member knows which result to wait on before the batch is closed. A call that fills the batch
closes it. The worker seals the batch (SEAL) when it starts the task, i.e. when a GPU is
free, and takes every item appended so far: while the GPUs are busy new requests pile into
the open batches, so the batch size follows the load with no timer.

Admission control (batching.admission) is decided per request from one figure per shard,
`predicted`, which the per-batch scripts (open, close, seal) and the workers' heartbeats
recompute; a request only compares it with its budget.

A batch whose task was never sent cannot be sealed, so every opened batch is due for a
hand-over DISPATCH_GRACE_MS after it opened, until its dispatcher confirms the send
(`dispatched`). If the send fails, the dispatcher closes the batch (`abandon`) and answers its
members at once. If the dispatcher dies between the two, a worker hands the batch over: the
next seal of the shard, or a worker's scan when no seal comes, sends its task again (a
duplicate task finds the batch sealed and answers nothing). A worker that receives a batch's
task while its GPU is still busy (workers.pipeline takes the next task before the running
call ends) marks the batch held (`hold`), due for a hand-over a grace after the worker
expects to seal it: a worker killed before the seal loses only the batch it was running, not
the one it held.

Keys come from batching.keys; times are Redis server time (TIME), so web and GPU nodes need
no shared clock. This module knows nothing of Django or models: it takes a redis client
(a cluster client works alike) and numbers.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from batching import stats
from batching.admission import ADMISSION_LUA
from batching.keys import QueueKeys, ShardKeys, shard_tags, tag_of
from batching.policy import MAX_BATCH_SIZE, Policy

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
# The last batch records kept for operators, tests and the benchmark.
BATCH_LOG_LENGTH = 1000

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

# refresh_admission(open pointer, unsealed zset, admission hash, now): recompute the one figure
# a request's APPEND reads, `predicted` (ms until a batch joined now would finish; 0: admit),
# from the inputs the workers keep in the admission hash (none: admit everything). Run when a
# batch opens, closes or is sealed and on every heartbeat: never per request. The backlog is
# this shard's unsealed batches opened within the window, times the shards (requests are
# spread evenly over them, and the workers take every shard's batches from one queue), less
# the open batch, which a newcomer joins.
_REFRESH_ADMISSION_LUA = (
    ADMISSION_LUA
    + """
local function refresh_admission(open_key, unsealed_key, admission_key, now)
  local inputs = redis.call('HMGET', admission_key, 'workers', 'turn_ms', 'shards', 'window_ms')
  local workers = tonumber(inputs[1])
  if not workers then return 0 end
  local ahead = redis.call('ZCOUNT', unsealed_key, now - tonumber(inputs[4]), '+inf')
  ahead = ahead * tonumber(inputs[3])
  if redis.call('EXISTS', open_key) == 1 then ahead = ahead - 1 end
  local predicted = predicted_ms(ahead, workers, tonumber(inputs[2])) or 0
  redis.call('HSET', admission_key, 'predicted', predicted)
  return predicted
end
"""
)

# KEYS: open pointer, admission (hash), unsealed batches (zset), hand-over due (zset)
# ARGV: candidate batch id, prompt, budget ms, max size, ttl ms, batch key prefix, dispatch
#       grace ms
# Returns {batch id, index, opened, predicted ms}: batch id '' and index -1 when admission
# refused the request. A request runs GET, HGET, TIME and RPUSH; opening and closing a batch
# (once per batch) do the rest.
APPEND_LUA = (
    _NOW_FUNCTION_LUA
    + _REFRESH_ADMISSION_LUA
    + """
local budget = tonumber(ARGV[3])
local predicted = tonumber(redis.call('HGET', KEYS[2], 'predicted') or '0')
if predicted > 0 and predicted > budget then
  return {'', -1, 0, predicted}
end
local bid = redis.call('GET', KEYS[1])
local now = now_ms()
local ttl = tonumber(ARGV[5])
local opened = 0
if not bid then
  bid = ARGV[1]
  opened = 1
  redis.call('SET', KEYS[1], bid, 'PX', ttl)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - ttl)
  redis.call('ZADD', KEYS[3], now, bid)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - ttl)
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[7]), bid)
end
local batch_key = ARGV[6] .. bid
local n = redis.call('RPUSH', batch_key, (now + budget) .. ' ' .. ARGV[2])
if n == 1 then redis.call('PEXPIRE', batch_key, ttl) end
local closed = n >= tonumber(ARGV[4])
if closed then redis.call('DEL', KEYS[1]) end
if opened == 1 or closed then refresh_admission(KEYS[1], KEYS[3], KEYS[2], now) end
return {bid, n - 1, opened, 0}
"""
)

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

# KEYS: open pointer, unsealed batches (zset), hand-over due (zset), admission (hash)
# ARGV: batch id, batch key prefix, held member, workers, turn ms, shards, window ms,
#       inputs ttl ms, dispatch grace ms, hand-overs at most
# Returns {now ms, opened-at ms (or -1), number of hand-overs h, h batch ids due for a
# hand-over, items...}. Atomic with APPEND: an append lands either in this batch (and is
# returned here) or, after the pointer is cleared, in a new batch. The sealing worker also
# refreshes the shard's admission and takes the shard's batches due for a hand-over (it sends
# their tasks again): under load, no other round trip is needed for either.
SEAL_LUA = (
    _NOW_FUNCTION_LUA
    + _REFRESH_ADMISSION_LUA
    + _ADMISSION_INPUTS_LUA
    + _TAKE_DUE_LUA
    + """
local now = now_ms()
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
local opened_at = redis.call('ZSCORE', KEYS[2], ARGV[1]) or -1
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1], ARGV[3])
local batch_key = ARGV[2] .. ARGV[1]
local items = redis.call('LRANGE', batch_key, 0, -1)
redis.call('DEL', batch_key)
if tonumber(ARGV[4]) > 0 then
  set_admission_inputs(KEYS[4], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
end
refresh_admission(KEYS[1], KEYS[2], KEYS[4], now)
local due = take_due(KEYS[3], ARGV[2], now, tonumber(ARGV[9]), tonumber(ARGV[10]))
local reply = {now, tonumber(opened_at), #due}
for _, due_bid in ipairs(due) do table.insert(reply, due_bid) end
for _, item in ipairs(items) do table.insert(reply, item) end
return reply
"""
)

# KEYS: hand-over due (zset); ARGV: batch key prefix, dispatch grace ms, at most this many
# The batches due for a hand-over, for a worker that has not sealed a batch of this shard for
# HANDOVER_SCAN_MS: a batch is handed over even when no worker seals anything.
TAKE_DUE_LUA = (
    _NOW_FUNCTION_LUA
    + _TAKE_DUE_LUA
    + """
return take_due(KEYS[1], ARGV[1], now_ms(), tonumber(ARGV[2]), tonumber(ARGV[3]))
"""
)

# KEYS: open pointer, unsealed batches (zset), admission (hash)
# ARGV: workers, turn ms, shards, window ms, inputs ttl ms
# The workers' figures for a shard's admission (every heartbeat), and the refreshed figure.
ADMISSION_LUA_SCRIPT = (
    _NOW_FUNCTION_LUA
    + _REFRESH_ADMISSION_LUA
    + _ADMISSION_INPUTS_LUA
    + """
set_admission_inputs(KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
return refresh_admission(KEYS[1], KEYS[2], KEYS[3], now_ms())
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
    """A request's place in a batch, or its refusal by admission control."""

    batch_id: str
    index: int
    opened: bool
    rejected: bool = False
    predicted_ms: int = 0


@dataclass(frozen=True)
class Item:
    deadline_ms: int
    prompt: str


@dataclass(frozen=True)
class SealedBatch:
    now_ms: int
    opened_at_ms: int  # -1: no record of its opening (sealed already, or expired)
    items: list[Item]
    # Batches of the shard due for a hand-over, taken by this seal: the sealer sends their
    # tasks again.
    handovers: list[str] = field(default_factory=list)

    @property
    def sealed_before(self) -> bool:
        """Nothing to answer: this batch was sealed by an earlier task (a duplicate sent by a
        hand-over), or it expired; its members already have their answer or gave up."""
        return self.opened_at_ms < 0 and not self.items


@dataclass(frozen=True)
class AdmissionInputs:
    """What a worker knows that admission needs, passed with every seal and heartbeat."""

    workers: int
    turn_ms: float


def _parse_item(raw: bytes) -> Item:
    deadline, prompt = raw.split(b" ", 1)
    return Item(int(deadline), prompt.decode("utf-8"))


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
        self.configure(max_batch_size=max_batch_size, deadline_ms=deadline_ms)
        self._append = client.register_script(APPEND_LUA)
        self._seal = client.register_script(SEAL_LUA)
        self._heartbeat = client.register_script(HEARTBEAT_LUA)
        self._hold = client.register_script(HOLD_LUA)
        self._take_due = client.register_script(TAKE_DUE_LUA)
        self._admission = client.register_script(ADMISSION_LUA_SCRIPT)

    def configure(self, *, max_batch_size: int, deadline_ms: int) -> None:
        """Apply a policy: called at start and by the policy watcher when it changes."""
        if not 1 <= max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be 1..{MAX_BATCH_SIZE}, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.deadline_ms = deadline_ms
        self.ttl_ms = batch_ttl_ms(deadline_ms)

    def load_scripts(self) -> None:
        """Load the Lua scripts into Redis now rather than on a request's first NOSCRIPT (on
        every master of a cluster)."""
        scripts = (
            self._append, self._seal, self._heartbeat, self._hold, self._take_due,
            self._admission,
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

    def append(self, prompt: str, budget_ms: int, shard: int | None = None) -> Ticket:
        """Join the open batch of `shard` (by default the next shard in this process's turn):
        the request's one round trip."""
        index = next(self._turn) if shard is None else shard
        keys = self.shards[index % len(self.shards)]
        bid, item_index, opened, predicted = self._append(
            keys=[keys.open_batch, keys.admission, keys.unsealed, keys.handover_due],
            args=[
                keys.batch_id(uuid.uuid4().hex),
                prompt,
                int(budget_ms),
                self.max_batch_size,
                self.ttl_ms,
                keys.batch_prefix,
                DISPATCH_GRACE_MS,
            ],
        )
        if item_index < 0:
            return Ticket("", -1, False, True, int(predicted))
        return Ticket(bid.decode(), int(item_index), bool(opened))

    def dispatched(self, batch_id: str) -> None:
        """The batch's task is sent: no hand-over for want of a dispatch."""
        self.client.zrem(self.shard_of(batch_id).handover_due, batch_id)

    def hold(self, batch_id: str, seal_in_ms: float) -> bool:
        """A worker received the batch's task and expects to seal it within `seal_in_ms`: if it
        has not by DISPATCH_GRACE_MS later (the worker died), the batch is handed over. Its own
        hand-over member, so that a dispatcher's late confirmation cannot remove it. False
        when the batch is sealed already."""
        keys = self.shard_of(batch_id)
        due_in_ms = max(0, round(seal_in_ms)) + DISPATCH_GRACE_MS
        return bool(
            self._hold(
                keys=[keys.unsealed, keys.handover_due],
                args=[batch_id + HELD_SUFFIX, batch_id, due_in_ms],
            )
        )

    def take_due_handovers(self, shard: int = 0, limit: int = 10) -> list[str]:
        """Batches of `shard` due for a hand-over, whose tasks the caller sends again: each due
        one is taken by one caller (a worker's seal or scan)."""
        keys = self.shards[shard]
        taken = self._take_due(
            keys=[keys.handover_due], args=[keys.batch_prefix, DISPATCH_GRACE_MS, limit]
        )
        return [batch_id.decode() for batch_id in taken]

    def seal(self, batch_id: str, inputs: AdmissionInputs | None = None) -> SealedBatch:
        """Take the batch's items (closing it, if it is the open one). A worker passes what it
        knows for admission (`inputs`), and gets the shard's batches due for a hand-over."""
        keys = self.shard_of(batch_id)
        raw = self._seal(
            keys=[keys.open_batch, keys.unsealed, keys.handover_due, keys.admission],
            args=[
                batch_id,
                keys.batch_prefix,
                batch_id + HELD_SUFFIX,
                *self._admission_args(inputs or AdmissionInputs(0, 0.0)),
                DISPATCH_GRACE_MS,
                HANDOVERS_PER_SEAL,
            ],
        )
        handed = int(raw[2])
        return SealedBatch(
            int(raw[0]),
            int(raw[1]),
            [_parse_item(item) for item in raw[3 + handed :]],
            [due.decode() for due in raw[3 : 3 + handed]],
        )

    def abandon(self, batch_id: str) -> int:
        """Close a batch whose task cannot be sent, so no later request joins it; returns how
        many members it had (its dispatcher answers them)."""
        return len(self.seal(batch_id).items)

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
                    keys=[keys.open_batch, keys.unsealed, keys.admission],
                    args=self._admission_args(inputs),
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

    def record_batch(self, record: str, counts: Mapping[str, int], at_s: float) -> None:
        """`queue_record`, sent at once: one round trip."""
        with self.client.pipeline(transaction=False) as pipe:
            self.queue_record(pipe, record, counts, at_s)
            pipe.execute()

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
