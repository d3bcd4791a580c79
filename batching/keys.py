"""Every Redis key of a queue, built in one place.

A queue's own keys (policy, workers, statistics, batch log) share the hash tag `{queue}`. Its
request path is split over SAMPLING_SHARDS shards, each an open batch with its own keys under
its own hash tag (ShardKeys), so that a Redis cluster spreads the shards over its masters and
every script of a shard runs on one slot. With one shard, the shard's tag is the queue's.
Nothing else in the project spells a `sampling:{...}:...` key; the prefix is an installed
name (batching.installed_names).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from batching.installed_names import REDIS_KEY_PREFIX

# The most shards a queue may have (SAMPLING_SHARDS): far more than any Redis cluster needs for
# one model's requests.
MAX_SHARDS = 64


@dataclass(frozen=True)
class QueueKeys:
    """The keys of one queue; each built once per instance (the request path reads some on
    every request)."""

    queue: str

    @cached_property
    def tag(self) -> str:
        return f"{REDIS_KEY_PREFIX}:{{{self.queue}}}"

    @cached_property
    def live_workers(self) -> str:
        """A zset of worker names scored by their last heartbeat (Redis time, ms)."""
        return f"{self.tag}:workers"

    @cached_property
    def deadline_readers(self) -> str:
        """The same, of the workers that read an item's whole deadline (batching.items): web
        processes write it only while every live worker is one of them."""
        return f"{self.tag}:workers:deadline-readers"

    @cached_property
    def turn_ms(self) -> str:
        """The workers' running estimate of one batch's turn on a GPU, for operators (what
        admission uses reaches each shard's `admission` hash)."""
        return f"{self.tag}:sampler_ms"

    @cached_property
    def batch_log(self) -> str:
        """The last batch records (JSON), newest first."""
        return f"{self.tag}:batches"

    # --- workers, as the operators see them -----------------------------------------------
    def worker_info(self, worker: str) -> str:
        """A worker's row of the stats page (JSON), written with its heartbeat."""
        return f"{self.tag}:worker:{worker}"

    def worker_owner(self, worker: str) -> str:
        """The token of the one live process that runs as `worker` (its claim, expiring)."""
        return f"{self.tag}:worker-owner:{worker}"

    @cached_property
    def known_workers(self) -> str:
        """A zset of worker names scored by their last heartbeat (epoch seconds)."""
        return f"{self.tag}:known-workers"

    def worker_metrics(self, worker: str) -> str:
        """A worker's Prometheus exposition, published with its heartbeat."""
        return f"{self.tag}:metrics:{worker}"

    # --- policy and statistics -------------------------------------------------------------
    @cached_property
    def policy(self) -> str:
        return f"{self.tag}:policy"

    def stats_bucket(self, granularity_s: int, start_s: int) -> str:
        return f"{self.stats_prefix}{granularity_s}:{start_s}"

    @cached_property
    def spend_prefix(self) -> str:
        """What each month's spend totals' key starts with (the flush script appends the
        month): a hash of key id -> spend this month on this model (telemetry.flush)."""
        return f"{self.tag}:spend:"

    def spend_of_month(self, month: str) -> str:
        return f"{self.spend_prefix}{month}"

    def job_charges_applied(self, job_id: str) -> str:
        """An offline job's charges' last applied sequence (offline.charges): kept apart from
        `stats_applied`, as long as a month's spend totals."""
        return f"{self.tag}:stats:applied:{job_id}"

    @cached_property
    def stats_epoch(self) -> str:
        """A token housekeeping writes where it is missing, never expiring: missing with the
        persisted-minute marker, Redis lost its data, and the month's spend totals are built
        again from the database (operations.minutes)."""
        return f"{self.tag}:stats:epoch"

    @cached_property
    def stats_prefix(self) -> str:
        """What every statistics bucket's key starts with (the flush script builds them)."""
        return f"{self.tag}:stats:"

    @cached_property
    def stats_applied(self) -> str:
        """A hash: a writer's id -> the sequence of its last flush applied (telemetry/flush.py):
        a flush sent again is not counted twice."""
        return f"{self.tag}:stats:applied"

    @cached_property
    def dirty_minutes(self) -> str:
        """A hash: a minute (since the epoch) whose counts changed since it was persisted ->
        its version (raised by each change): housekeeping writes it again."""
        return f"{self.tag}:stats:dirty-minutes"

    @cached_property
    def persisted_minute(self) -> str:
        """The last minute of statistics written to the database."""
        return f"{self.tag}:stats:persisted-minute"

    @cached_property
    def housekeeping_lock(self) -> str:
        return f"{self.tag}:housekeeping"

    @cached_property
    def feeder_lock(self) -> str:
        """Held by the one web process that feeds the queue's offline jobs (offline.feeder)."""
        return f"{self.tag}:feeder"

    @cached_property
    def feeder_failures(self) -> str:
        """A hash: a feeder step (validated, moved on, finalized, charged) -> how many times a
        job's step failed (offline.feeder), for /metrics."""
        return f"{self.tag}:feeder-failures"

    @cached_property
    def feeder_generation(self) -> str:
        """A counter: each holding of the feeder's lock gets the next value, which fences the
        shards' done lists (batching/lua/trim_done.lua)."""
        return f"{self.tag}:feeder-generation"


# The published model catalog (batching.catalog): one JSON value with a version, the models
# operators registered and their aliases, read by every web process's poller.
CATALOG_KEY = f"{REDIS_KEY_PREFIX}:{{catalog}}:models"
# Held by the one web process that judges the canaries in each interval (operations.canary).
CANARY_LOCK_KEY = f"{REDIS_KEY_PREFIX}:{{catalog}}:canary-judge"


@dataclass(frozen=True)
class AccessKeys:
    """The deployment's API keys, as the web processes read them (one set for every queue,
    under one hash tag: they are read off the request path, by a poller). `scope` is for
    tests that must not touch a running deployment's keys."""

    scope: str = "access"

    @cached_property
    def prefix(self) -> str:
        return f"{REDIS_KEY_PREFIX}:{{{self.scope}}}"

    @cached_property
    def records(self) -> str:
        """A hash: a key's SHA-256 (hex) -> its record (JSON: id, name, tier, limits...)."""
        return f"{self.prefix}:keys"

    @cached_property
    def version(self) -> str:
        """A counter raised by every change to `records` (the publishers' WATCH); a process
        reads it with `digest` twice a second, and the whole hash only when either moved."""
        return f"{self.prefix}:version"

    @cached_property
    def digest(self) -> str:
        """The SHA-256 of `records` as published (accounts.access.digest_of_records), written
        in the same MULTI: what a process compares to tell a change, which a restarted
        counter cannot fake; absent when Redis lost the set (a restart with no data)."""
        return f"{self.prefix}:digest"

    @cached_property
    def last_used(self) -> str:
        """A hash: a key's id -> when a web process last saw it (epoch seconds)."""
        return f"{self.prefix}:last-used"

    def tokens(self, window: int) -> str:
        """A hash: a key's id -> the tokens its requests reserved or used in rate window
        `window` (minutes since the epoch): accounts.ratelimit.Reservation."""
        return f"{self.prefix}:tpm:{window}"

    def spent_models(self, month: str) -> str:
        """A set: the models with spend in `month` (each writer of spend adds its own), so
        that budgets sum a model's spend after it left the catalog too (accounts.budgets)."""
        return f"{self.prefix}:spent-models:{month}"

    def spend_holds(self, window: int) -> str:
        """A hash: `k:<key id>` (and `o:<owner>`) -> the billionths its requests in flight
        hold against its monthly budget, held in window `window` (accounts.budgets:
        HOLD_WINDOW_S)."""
        return f"{self.prefix}:spend-holds:{window}"


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard of a queue's request path, all under the hash tag `{tag}`; and
    its batches' ids, which carry the tag too (`{tag}<hex>`), so that a batch's result key
    (Celery's `celery-task-meta-<id>`) lives on the shard's slot and the worker finds the
    shard from the task alone."""

    tag: str

    @cached_property
    def prefix(self) -> str:
        return f"{REDIS_KEY_PREFIX}:{{{self.tag}}}"

    # --- lanes: one open batch per priority lane (a tier's priority; 0 for the anonymous
    # tier and for every request before tiers, whose keys keep their names) --------------
    def lane_key(self, name: str, lane: int) -> str:
        """Key `name` of lane `lane`: the Lua scripts build the same names (lane_key,
        batching/lua/common.lua)."""
        return f"{self.prefix}:{name}" if lane == 0 else f"{self.prefix}:{name}:{lane}"

    def open_of(self, lane: int) -> str:
        return self.lane_key("open", lane)

    def pending_of(self, lane: int) -> str:
        return self.lane_key("pending", lane)

    def unsealed_of(self, lane: int) -> str:
        return self.lane_key("unsealed", lane)

    @cached_property
    def lanes(self) -> str:
        """A zset of the lanes in use on this shard, scored by when a batch of theirs last
        opened or was sealed (Redis ms): what a seal chooses among."""
        return f"{self.prefix}:lanes"

    @cached_property
    def taken_over(self) -> str:
        """A zset of batches sealed by another batch's task (a seal chose a higher lane),
        scored by when (ms): their own task, when it comes, seals a batch in their stead."""
        return f"{self.prefix}:taken-over"

    @cached_property
    def open_batch(self) -> str:
        """The batch new requests join, "<batch id> <opened ms> <max size>" (absent: the next
        request opens one); its items are in `pending` until it is sealed or closed."""
        return f"{self.prefix}:open"

    @cached_property
    def pending(self) -> str:
        """The list of the open batch's items, one "deadline_ms prompt" string each: a request
        pushes onto it and learns its index from the list's length."""
        return f"{self.prefix}:pending"

    @cached_property
    def unsealed(self) -> str:
        """A zset of closed (full) batches not sealed yet, scored by their opening time (ms):
        with the open batches of the other shards, the backlog that admission counts."""
        return f"{self.prefix}:unsealed"

    @cached_property
    def sent(self) -> str:
        """A zset of batches whose dispatcher confirmed its task sent, scored by the time of
        the confirmation (ms): an open batch not in it a grace after it opened is handed over."""
        return f"{self.prefix}:sent"

    @cached_property
    def handover_due(self) -> str:
        """A zset of unsealed batches whose task may be lost, scored by the time (ms) from which
        a worker hands the batch over (sends its task again) if it is still unsealed: a batch
        whose task is not known to be sent yet (member: its id), and a batch a worker received
        before its GPU was free (member: id + HELD_SUFFIX), in case that worker dies first."""
        return f"{self.prefix}:handover-due"

    @cached_property
    def admission(self) -> str:
        """A hash: what admission needs (live workers, a turn's ms, shards, window), written
        by the workers' heartbeats and seals, and `predicted`, the ms a batch joined now would
        take to finish, refreshed whenever a batch closes or is sealed and on heartbeats; a
        web process reads that one field (with a request's push, at most every 10 ms). Its
        `calls` counts backfill turns, to name each one's entry in `call_ends`."""
        return f"{self.prefix}:admission"

    @cached_property
    def call_ends(self) -> str:
        """A zset of the shard's latest calls (member: the sealed batch's id), scored by the
        time (ms) its seal predicted the call ends: admission's view of when a GPU frees. The
        seals keep the latest `workers` of them (batching/lua/common.lua builds the same
        name from the prefix)."""
        return f"{self.prefix}:call-ends"

    @staticmethod
    def predicted_field(lane: int) -> str:
        """The field of `admission` that a request of `lane` reads."""
        return "predicted" if lane == 0 else f"predicted:{lane}"

    @cached_property
    def batch_prefix(self) -> str:
        return f"{self.prefix}:batch:"

    def batch(self, batch_id: str) -> str:
        """The list of a closed (full) batch's items, waiting for its seal."""
        return self.batch_prefix + batch_id

    @cached_property
    def results(self) -> str:
        """The channel on which the shard's batches' answers are published, each message
        "<batch id> <Celery meta>", and their deltas while they stream (batching.deltas):
        every web process listens to it for good."""
        return f"{self.prefix}:results"

    def cancelled(self, batch_id: str) -> str:
        """A set of the indexes of a batch's items whose streaming client left: its worker
        drops them before its call, or stops their deltas during it."""
        return f"{self.prefix}:cancelled:{batch_id}"

    @cached_property
    def backfill(self) -> str:
        """The shard's backfill lane (batching.backfill): a list of offline jobs' items, which
        a seal takes into the places its batch leaves empty (a whole batch for a GPU that
        would otherwise be idle)."""
        return f"{self.prefix}:backfill"

    @cached_property
    def backfill_taken(self) -> str:
        """A zset of the backfill items seals took, scored by when (ms): one not answered in
        time goes back to `backfill`."""
        return f"{self.prefix}:backfill-taken"

    @cached_property
    def backfill_epoch(self) -> str:
        """A token the feeder writes where it is missing: another than the one a job was fed
        under, the lane was lost since (a restart), and the job's unanswered lines go again."""
        return f"{self.prefix}:backfill-epoch"

    @cached_property
    def backfill_done(self) -> str:
        """A list of the answers of backfill items, for the feeder to collect."""
        return f"{self.prefix}:backfill-done"

    @cached_property
    def backfill_fence(self) -> str:
        """The highest feeder generation that read `backfill_done`: an earlier holder (one
        that stalled past its lock) may not trim it any more."""
        return f"{self.prefix}:backfill-fence"

    def batch_id(self, unique: str) -> str:
        return f"{{{self.tag}}}{unique}"

    def cached(self, digest: str) -> str:
        """A cached answer (JSON) of the request whose input hashes to `digest`
        (batching.cache); every shard holds its own copy, so that the append that looks it up
        finds it on its own slot."""
        return f"{self.prefix}:cache:{digest}"

    @cached_property
    def cache_version(self) -> str:
        """The policy version the queue's workers run, as their heartbeats last set it: a
        cached answer of an older version is not served (batching/lua/append_items.lua)."""
        return f"{self.prefix}:cache_version"

    def requests_counter(self, key_id: int, window: int) -> str:
        """The count of API key `key_id`'s requests in rate window `window` (minutes since the
        epoch), raised by the request's own append: a keyed request joins the shard its key
        is pinned to, so the counter shares the slot of the append's MULTI."""
        return f"{self.prefix}:rpm:{key_id}:{window}"


@dataclass(frozen=True)
class LaneKeys:
    """The keys a request of one lane touches on its shard: its open pointer and pending list,
    and the field of the shard's admission hash it reads; built once per shard and lane (the
    request path reads them on every request)."""

    open_batch: str
    pending: str
    unsealed: str
    admission: str
    predicted: str
    lane: int

    @staticmethod
    @lru_cache(maxsize=1024)
    def of(shard: ShardKeys, lane: int) -> LaneKeys:
        return LaneKeys(
            shard.open_of(lane),
            shard.pending_of(lane),
            shard.unsealed_of(lane),
            shard.admission,
            ShardKeys.predicted_field(lane),
            lane,
        )


def tag_of(batch_id: str) -> str:
    """The shard tag a batch id carries ('' for an id without one)."""
    if batch_id.startswith("{"):
        end = batch_id.find("}")
        if end > 0:
            return batch_id[1:end]
    return ""


def shard_tags(queue: str, shards: int) -> list[str]:
    """The hash tags of a queue's shards. One shard: the queue's own tag. More: shard i's tag
    is the first `{queue}.{i}.{n}` whose cluster slot falls in the i-th of `shards` equal
    ranges of the slots, so that a cluster whose masters own equal contiguous ranges (as
    `--cluster create` and our test clusters make them) carries equal numbers of shards."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"a queue has 1 to {MAX_SHARDS} shards, got {shards}")
    if shards == 1:
        return [queue]
    tags = []
    for index in range(shards):
        low = index * REDIS_CLUSTER_HASH_SLOTS // shards
        high = (index + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        for n in range(100_000):
            tag = f"{queue}.{index}.{n}"
            if low <= key_slot(tag.encode()) < high:
                tags.append(tag)
                break
        else:  # pragma: no cover - 16,384 slots, at most 100 shards: always found
            raise RuntimeError(f"no tag found for shard {index} of {queue}")
    return tags


# The shard tag of a task id that carries none (a task not sent by the aggregator).
UNTAGGED = "untagged-results"


def results_channel(task_id: str) -> str:
    """The channel a task's result (and a streaming batch's deltas) is published on: its
    shard's."""
    return ShardKeys(tag_of(task_id) or UNTAGGED).results
