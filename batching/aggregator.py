"""The Redis batch aggregator shared by every web process and every worker of one queue:
append, close, seal and hand-over. The rules themselves are Lua, in batching/lua/ (the seal's
choice of batch: seal.lua); this is their Python side.

A queue's requests join open batches: one per shard (SAMPLING_SHARDS, one by default), each
shard's keys under its own hash tag so that a Redis cluster spreads the shards over its
masters. A request joins its shard's open batch with one MULTI of plain commands (`append`,
batching.join: SET NX GET of the open pointer, RPUSH onto the shard's pending list, now and
then an HGET of the admission figure), the only Redis round trip of a request: no Lua on the
request path, whose cold call costs a Redis core about as much as the rest of the request.
The pointer names the batch, its opening time and its maximum size; the request whose SET NX
set it opened the batch and dispatches the batch's Celery task at once, with the batch id as
task id, so every member knows which result to wait on before the batch is sealed; its index
is the list's length. The request that fills the batch closes it (`close`: its items move to
the batch's own list; pushes beyond the maximum are dropped and their requests join the next
batch). The worker seals the batch (`seal`) when it starts the task, i.e. when a GPU is free,
and takes every item appended so far: while the GPUs are busy new requests pile into the open
batches, so the batch size follows the load with no timer.

Priority tiers (batching.lanes): each lane has its own open batch per shard, and its task
carries the lane's Celery priority. A task is one turn of a GPU on its shard: the seal takes
the highest lane's ready batch, which may be another than the task's own, and the worker
answers the batch it sealed.

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

Times are the Redis node's (batching.clock): web and GPU nodes need no shared clock. A method
that reads the time takes `now_ms`, a set time for tests (None: the node's). It takes a redis
client (a cluster client works alike) and numbers, and knows nothing of Django or models.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import redis

from batching import scripts
from batching.admission import AdmissionInputs
from batching.clock import RedisClock
from batching.generation import SampleRequest
from batching.items import BatchIds, Joined, SealedBatch, Ticket, item_of
from batching.join import AppendCounter, ItemsCall, join, join_items
from batching.keys import LaneKeys, QueueKeys, ShardKeys, shard_tags, tag_of
from batching.lanes import HOLD_DEADLINE_FRACTION, SCRIPT_CONSTANTS
from batching.policy import MAX_BATCH_SIZE, Policy
from batching.registry import HEARTBEAT_TIMEOUT_MS
from batching.topology import REDIS_FAULTS, is_cluster

log = logging.getLogger(__name__)

# A dispatcher confirms its send, and a worker seals a batch it holds after it expected to,
# within this long, or the batch is handed over.
DISPATCH_GRACE_MS = 100
# The hand-over member of a batch that a worker holds (see `hold`), after the batch's id.
HELD_SUFFIX = ":held"
# A worker that has not sealed a batch of a shard for this long looks for the shard's batches
# due for a hand-over (a seal takes them too): all of a dead worker's clients may be waiting
# in the batch it held, and then no request comes to move anything.
HANDOVER_SCAN_MS = 100
# A seal takes at most this many batches due for a hand-over.
HANDOVERS_PER_SEAL = 10
# A process refuses requests from the admission figure its last call read for this long; then
# it reads the figure again before it refuses.
ADMISSION_FRESH_S = 0.1
# A request's call reads the figure again when its process read it over this long ago: under
# load, one request in several carries the HGET.
ADMISSION_REFRESH_S = 0.01
# A request that finds its batch full joins the next; this many tries, then a RedisError.
APPEND_ATTEMPTS = 8
# The scripts of batching/lua/ the aggregator runs (the clock's is batching.clock's).
SCRIPTS = ("close", "seal", "take_due", "admission", "append_items")


def batch_ttl_ms(deadline_ms: int) -> int:
    """How long a batch's data lives: a few deadlines, long enough for any batch a live
    caller waits on, short enough that an abandoned batch (no worker) does not linger."""
    return max(4 * deadline_ms, 2000)


def _clock_arg(now_ms: int | None) -> list[int]:
    """The scripts' optional last argument: a set time, or none (the node's TIME)."""
    return [] if now_ms is None else [now_ms]


class BatchAggregator:
    """A queue's aggregator: `shards` open batches (one by default), each on its own hash tag.
    A web process spreads its requests over them in turn; a worker seals a batch on the shard
    its id names. The queue's live workers (batching.registry) and its batch log
    (telemetry.batch_log) are read and written beside it, not through it."""

    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        *,
        max_batch_size: int = Policy.max_batch_size,
        deadline_ms: int = Policy.deadline_ms,
        shards: int = 1,
        monotonic: Callable[[], float] = time.monotonic,
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
        # Per shard and lane: (admission's figure, when read, monotonic s).
        self._admission_seen: dict[tuple[int, int], tuple[float, float]] = {}
        self._monotonic = monotonic
        self._cluster = is_cluster(client)
        self.clock = RedisClock(client, monotonic)
        self.configure(max_batch_size=max_batch_size, deadline_ms=deadline_ms)
        self._scripts = {name: scripts.register(client, name, SCRIPT_CONSTANTS) for name in SCRIPTS}

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
        for script in [self.clock.script, *self._scripts.values()]:
            self.client.script_load(script.script)

    def shard_of(self, batch_id: str) -> ShardKeys:
        """The shard whose keys hold the batch (named by the batch id's tag)."""
        # An id of another shard layout (SAMPLING_SHARDS changed while it waited), or of the
        # version before shards: its keys are named by its tag all the same.
        return self._shard_of_tag.get(tag_of(batch_id)) or ShardKeys(tag_of(batch_id) or self.queue)

    def shard_of_key(self, key_id: int) -> int:
        """The shard an API key's requests join: always the same one, so that its request
        counter lives on the slot of their appends."""
        return key_id % len(self.shards)

    def append(
        self,
        prompt: str | SampleRequest,
        budget_ms: int,
        shard: int | None = None,
        *,
        key_id: int = 0,
        counter: AppendCounter | None = None,
        lane: int = 0,
        now_ms: int | None = None,
        stream: bool = False,
        deadline_ms: int = 0,
    ) -> Ticket:
        """Join the open batch of `lane` (the caller's tier priority) on `shard` (by default
        the next shard in this process's turn) with a bare prompt (the queue's settings) or a
        request with its own settings, in one round trip (batching.join).

        Admission is decided before the call from the figure this process read last (a
        refusal needs no Redis call at all); a figure missing, or one that would refuse and
        was read over ADMISSION_FRESH_S ago, is read again first. A process admits requests
        for at most ADMISSION_REFRESH_S and one request after the figure turned against it.

        A keyed request names its key (`key_id`, for the workers' token charges) and, when
        the key has a request rate limit, the counter its MULTI raises (`counter`, on the
        shard's slot: see `shard_of_key`); the ticket carries the count after it. A
        `stream`ing request's item is marked so: its worker publishes its text as it comes.
        `budget_ms` is what is left of the request's deadline, `deadline_ms` the whole of it,
        which the item carries for its worker's queue time (0: not carried)."""
        index = (next(self._turn) if shard is None else shard) % len(self.shards)
        keys = self.shards[index]
        lane_keys = LaneKeys.of(keys, lane)
        now_s = self._monotonic()
        seen = self._admission_figure(index, lane_keys, budget_ms, now_s)
        if seen[0] > 0 and seen[0] > budget_ms:
            return Ticket("", -1, False, True, int(seen[0]), lane=lane)
        for _ in range(APPEND_ATTEMPTS):
            redis_ms = self.clock.now_ms(keys, now_s) if now_ms is None else now_ms
            candidate = keys.batch_id(self._ids.next())
            read_admission = now_s - seen[1] > ADMISSION_REFRESH_S
            pointer = f"{candidate} {redis_ms} {self.max_batch_size}"
            expires_at_ms = redis_ms + int(budget_ms)
            item = item_of(expires_at_ms, prompt, key_id, stream=stream, deadline_ms=deadline_ms)
            joined, length, *more = join(
                self.client, self._cluster, lane_keys, pointer, item, self.ttl_ms,
                read_admission, counter,
            )  # fmt: skip
            if read_admission:
                seen = self._admission_seen[index, lane] = (float(more.pop(0) or 0), now_s)
            counted = int(more[0]) if counter is not None else 0
            counter = None  # raised once, whatever batch the request ends in
            batch_id, max_size, opened = self._batch_joined(joined, candidate)
            if length >= max_size:  # full: the next request opens a new batch
                self.close(batch_id, lane, now_ms=now_ms)
            if length <= max_size:
                return Ticket(batch_id, length - 1, opened, counted=counted, lane=lane)
            # Pushed onto a batch already full (before its closer moved it): join the next.
        raise redis.RedisError(f"no batch of shard {keys.tag} took the request")

    def _admission_figure(
        self, index: int, keys: LaneKeys, budget_ms: int, now_s: float
    ) -> tuple[float, float]:
        """The admission figure of the lane `keys` on shard `index` this process read last,
        and when: read again when missing, or when it would refuse and is no longer fresh."""
        seen = self._admission_seen.get((index, keys.lane))
        if seen is None or (seen[0] > budget_ms and now_s - seen[1] > ADMISSION_FRESH_S):
            figure = float(self.client.hget(keys.admission, keys.predicted) or 0)
            seen = self._admission_seen[index, keys.lane] = (figure, now_s)
        return seen

    def append_items(
        self,
        items: Sequence[tuple[str, str | SampleRequest]],
        budget_ms: int,
        shard: int | None = None,
        *,
        key_id: int = 0,
        counter: AppendCounter | None = None,
        cost: int = 1,
        limit: int = 0,
        version: int = 0,
        lane: int = 0,
        now_ms: int | None = None,
        stream: bool = False,
        deadline_ms: int = 0,
    ) -> Joined:
        """A request's items (with their response cache digests, "" for none) appended in one
        round trip by batching/lua/append_items.lua (its cache answers of policy `version`);
        with `limit`, refused, nothing appended, if raising the counter by `cost` passes it;
        `stream`, `deadline_ms`: as `append`'s."""
        index = (next(self._turn) if shard is None else shard) % len(self.shards)
        keys = self.shards[index]
        lane_keys = LaneKeys.of(keys, lane)
        now_s = self._monotonic()
        seen = self._admission_figure(index, lane_keys, budget_ms, now_s)
        if seen[0] > 0 and seen[0] > budget_ms:
            rejected = Ticket("", -1, False, True, int(seen[0]), lane=lane)
            return Joined([rejected] * len(items))
        redis_ms = self.clock.now_ms(keys, now_s) if now_ms is None else now_ms
        expires_at_ms = redis_ms + int(budget_ms)
        read_admission = now_s - seen[1] > ADMISSION_REFRESH_S
        call = ItemsCall(
            keys.batch_id(self._ids.next()), redis_ms, self.max_batch_size, self.ttl_ms,
            read_admission, counter, cost, limit, version, "" if now_ms is None else str(now_ms),
        )  # fmt: skip
        listed = [
            (digest, item_of(expires_at_ms, item, key_id, digest, stream, deadline_ms))
            for digest, item in items
        ]
        reply = join_items(self._scripts["append_items"], keys, lane_keys, call, listed,
                           DISPATCH_GRACE_MS)  # fmt: skip
        if reply[0] == -1:
            return Joined([], int(reply[1]), limited=True)
        if read_admission:
            self._admission_seen[index, lane] = (float(reply[1] or 0), now_s)
        return Joined.of_reply(reply, lane)

    def _batch_joined(self, joined: bytes | None, candidate: str) -> tuple[str, int, bool]:
        """The batch an append joined, its maximum size, and whether the append opened it,
        from the open pointer it found (None: its own, `candidate`, was set)."""
        if joined is None:
            return candidate, self.max_batch_size, True
        fields = joined.decode().split(" ")
        return fields[0], int(fields[2]) if len(fields) > 2 else MAX_BATCH_SIZE, False

    def queue_cached_answers(
        self, pipe: redis.client.Pipeline, answers: Mapping[str, str], ttl_ms: int
    ) -> None:
        """Queue on `pipe` the answers (JSON) of sampled requests, by digest, on every shard:
        an identical request finds it whichever shard it joins."""
        for digest, answer in answers.items():
            for keys in self.shards:
                pipe.set(keys.cached(digest), answer, px=ttl_ms)

    def queue_cache_version(self, pipe: redis.client.Pipeline, version: int) -> None:
        """Queue on `pipe` the policy version this worker runs, on every shard (its heartbeat,
        before it reports the version): the response cache serves no answer of an older one."""
        for keys in self.shards:
            pipe.set(keys.cache_version, version, px=HEARTBEAT_TIMEOUT_MS)

    def open_batch_id(self, shard: int = 0, lane: int = 0) -> str | None:
        """The id of the batch a request of `lane` on `shard` would join now (None: it would
        open one)."""
        raw = self.client.get(self.shards[shard].open_of(lane))
        return raw.decode().split(" ")[0] if raw else None

    def close(self, batch_id: str, lane: int = 0, *, now_ms: int | None = None) -> bool:
        """Close the batch of `lane` to newcomers (it is full), if it is the lane's open one;
        its items wait in its own list for its seal. False when it was not open."""
        keys = self.shard_of(batch_id)
        lane_keys = LaneKeys.of(keys, lane)
        script_keys = [
            lane_keys.open_batch, lane_keys.pending, lane_keys.unsealed, keys.handover_due,
            keys.admission, keys.sent, keys.lanes,
        ]  # fmt: skip
        args = [batch_id, keys.batch_prefix, self.ttl_ms, DISPATCH_GRACE_MS, keys.prefix, lane]
        return bool(self._scripts["close"](keys=script_keys, args=args + _clock_arg(now_ms)))

    def dispatched(self, batch_id: str, lane: int = 0, *, now_ms: int | None = None) -> None:
        """The batch's task is sent: it is no longer due for a hand-over for want of a
        dispatch, and its lane is one the seals choose among. Plain commands, one round trip;
        the pending list's expiry is refreshed here, once a batch (a list left by a queue no
        worker serves goes away on its own)."""
        keys = self.shard_of(batch_id)
        now_ms = self.clock.now_ms(keys) if now_ms is None else now_ms
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.sent, {batch_id: now_ms})
            pipe.zrem(keys.handover_due, batch_id)
            pipe.pexpire(keys.pending_of(lane), self.ttl_ms)
            if lane:
                pipe.zadd(keys.lanes, {str(lane): now_ms})
            pipe.execute()

    def hold(self, batch_id: str, seal_in_ms: float, *, now_ms: int | None = None) -> bool:
        """A worker received the batch's task and expects to seal it within `seal_in_ms`: if it
        has not by DISPATCH_GRACE_MS later (the worker died), the batch is handed over. Its own
        hand-over member, so that a dispatcher's late confirmation cannot remove it. False
        when the batch is sealed already (its member, then, is dropped by the next scan).
        Plain commands, one round trip."""
        keys = self.shard_of(batch_id)
        now_ms = self.clock.now_ms(keys) if now_ms is None else now_ms
        due_ms = now_ms + max(0, round(seal_in_ms)) + DISPATCH_GRACE_MS
        with self.client.pipeline(transaction=False) as pipe:
            pipe.get(keys.open_batch)
            pipe.exists(keys.batch(batch_id))
            pipe.zadd(keys.handover_due, {batch_id + HELD_SUFFIX: due_ms})
            pointer, closed, _ = pipe.execute()
        return bool(closed) or (pointer is not None and pointer.decode().split(" ")[0] == batch_id)

    def take_due_handovers(
        self, shard: int = 0, limit: int = 10, *, now_ms: int | None = None
    ) -> list[str]:
        """Batches of `shard` due for a hand-over, whose tasks the caller sends again: each due
        one is taken by one caller (a worker's seal or scan)."""
        keys = self.shards[shard]
        taken = self._scripts["take_due"](
            keys=[keys.handover_due, keys.sent, keys.lanes],
            args=[
                keys.batch_prefix, DISPATCH_GRACE_MS, limit, keys.prefix, self.ttl_ms,
                *_clock_arg(now_ms),
            ],
        )  # fmt: skip
        return [batch_id.decode() for batch_id in taken]

    def seal(
        self,
        batch_id: str,
        inputs: AdmissionInputs | None = None,
        *,
        lane: int = -1,
        exact: bool = False,
        places: int | Sequence[int] = 0,
        now_ms: int | None = None,
    ) -> SealedBatch:
        """Take the items of a batch of the task's shard (closing it, if it is an open one):
        the task's own batch (`batch_id`, of `lane`; -1: not known), or one of a higher lane
        whose batch is ready (see batching/lua/seal.lua); `exact`: that batch or none. A
        worker passes what it knows for admission (`inputs`), and gets the shard's batches
        due for a hand-over; with `places`, backfill items up to that many items in all
        (batching.backfill), or up to the smallest of several sizes that holds its items."""
        keys = self.shard_of(batch_id)
        raw = self._scripts["seal"](
            keys=[
                keys.lanes,
                keys.handover_due,
                keys.admission,
                keys.sent,
                keys.taken_over,
                keys.backfill,
                keys.backfill_taken,
            ],
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
                places if isinstance(places, int) else ",".join(map(str, sorted(places))),
                *_clock_arg(now_ms),
            ],
        )
        return SealedBatch.of_reply(raw)

    def abandon(self, batch_id: str, lane: int = -1, *, now_ms: int | None = None) -> int:
        """Close a batch whose task cannot be sent, so no later request joins it; returns how
        many members it had (its dispatcher answers them)."""
        return len(self.seal(batch_id, lane=lane, exact=True, now_ms=now_ms).items)

    def _admission_args(self, inputs: AdmissionInputs) -> list[int | float]:
        return [
            inputs.workers,
            round(inputs.turn_ms),
            len(self.shards),
            self.deadline_ms,
            HEARTBEAT_TIMEOUT_MS,
        ]

    def refresh_admission(self, inputs: AdmissionInputs, *, now_ms: int | None = None) -> list[int]:
        """Give every shard the workers' figures for admission (a worker's heartbeat, once a
        second); returns each shard's predicted ms (0: admit; -1: its Redis node is away,
        which does not keep the other shards from theirs)."""
        predicted = []
        for keys in self.shards:
            try:
                figure = self._scripts["admission"](
                    keys=[keys.admission, keys.lanes],
                    args=[
                        *self._admission_args(inputs), keys.prefix, self.ttl_ms,
                        *_clock_arg(now_ms),
                    ],
                )  # fmt: skip
            except REDIS_FAULTS as exc:
                log.warning("admission figures of shard %s not refreshed: %s", keys.tag, exc)
                figure = -1
            predicted.append(int(figure))
        return predicted
