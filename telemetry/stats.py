"""Service statistics in Redis: counters in time buckets, written in bulk, read for the stats page.

Every figure is a counter in a Redis hash per time bucket, at two granularities: per second
(kept 15 minutes: the "now" figures) and per 10 seconds (kept 2 hours: the charts of the last
hour and the per-minute rows persisted to the database). Counters add up across processes and
machines with HINCRBY, so no process needs to know of the others.

- Web processes count each request (outcome, latency histogram) in memory and flush once a
  second in one pipeline: the request path never waits on Redis for statistics. Streams add
  their time to first token and between tokens (histograms of their own).
- Workers write one pipeline per batch (size, expired, queue wait, sampling time, per-worker
  busy time) and one per heartbeat (worker-seconds alive, for the busy %, and every 10 s
  the queue times of the items sampled since).
- Each tier's requests (outcome, latency histogram) ride in the same buckets, under fields
  that name the tier (`tier_field`); `tier_counts` splits them out.
- Usage per API key rides in the same buckets, under fields that name the key
  (`usage_field`), all from the web processes: requests by outcome, and the tokens of the
  key's 200 answers as each answer's `usage` reported them (the billing rule: a key is charged
  for what was delivered; prompt tokens once per prompt, those answered from the response
  cache also counted apart as cached). `usage_of` reads them back per key. Workers count the
  tokens they sampled per queue (SAMPLED_*): sampled minus delivered is GPU work no client got.
- A web process's flush is applied once and in Redis's time (telemetry/flush.py).

Latencies go into fixed buckets 10% wide, so percentiles of any window are computed from the
summed histogram, accurate to a few percent.

This module knows nothing of Django: it takes a redis client and numbers.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import redis

from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from telemetry import flush as flushing

# Upper bounds (ms) of the latency buckets: 1 ms to ~2 min in 10% steps; one more for above.
LATENCY_BOUNDS_MS: tuple[float, ...] = tuple(round(1.1**k, 3) for k in range(123))

SECOND = 1
TEN_SECONDS = 10
TTL_S = {SECOND: flushing.SECOND_TTL_S, TEN_SECONDS: flushing.TEN_SECONDS_TTL_S}


# Workers seen in this long stay on the stats page (as stopped or silent) and in /metrics.
KNOWN_WORKERS_S = 10 * 60
# The states a worker that left says it left in (workers.lifecycle): stopped (a shutdown), hung
# (a call cut off by its timeout), unhealthy (its sampler failed calls in a row).
DEPARTED_STATES = ("stopped", "hung", "unhealthy")


# A key's usage fields: "k:<key id>:" then "req:<outcome>", PROMPT_TOKENS, COMPLETION_TOKENS
# or CACHED_TOKENS (the prompt tokens of prompts answered from the response cache, a part of
# PROMPT_TOKENS).
USAGE_PREFIX = "k:"
PROMPT_TOKENS = "pt"
COMPLETION_TOKENS = "ct"
CACHED_TOKENS = "cpt"
# What a key's answers cost, in billionths of the price's unit (batching.catalog.Price):
# exact for any price of 6 decimals per 1,000 tokens.
SPEND = "spend"

# A model's requests refused at routing because it had no live worker (503s counted as
# `req:error` too): a capacity signal, apart from the version's own errors (telemetry.canary).
NO_WORKER = "noworker"
# A model's offline lines (the Batch API's) answered 200, and failed by the service (5xx).
OFFLINE_OK = "offline:ok"
OFFLINE_ERRORS = "offline:errors"
# A model's requests that came through an alias: "via:<alias>:" then "req:<outcome>".
VIA_PREFIX = "via:"

# The queue's tokens the workers sampled (delivered or not): prompt and completion.
SAMPLED_PROMPT_TOKENS = "sampled:pt"
SAMPLED_COMPLETION_TOKENS = "sampled:ct"


# Offline jobs' items sampled (batching.backfill), and calls of nothing else with their time
# (busy time, but no call of the queue's: the mean call leaves it out).
BACKFILL_ITEMS = "backfill:items"
BACKFILL_CALLS = "backfill:calls"
BACKFILL_BUSY_US = "backfill:busy_us"

# Items the response cache answered, and items it was asked for but did not hold.
CACHE_HITS = "cache:hit"
CACHE_MISSES = "cache:miss"


# The latency histograms' fields: a prefix, then the bucket's index (`latency_bucket`).
# Requests, any outcome, from arrival to answer; streams, from arrival to their first content
# chunk, and between two content chunks of a choice; sampled items, from their request's
# arrival to their call's start (workers.runner).
LATENCY = "lat:"
TTFT = "ttft:"  # time to first token
ITL = "itl:"  # inter-token latency
QUEUE_TIME = "qt:"


# A tier's request fields: "t:<tier name>:" then "req:<outcome>" or "lat:<bucket>", the
# queue's own names, so that a tier's counts make a Summary of their own.
TIER_PREFIX = "t:"


def usage_field(key_id: int, name: str) -> str:
    return f"{USAGE_PREFIX}{key_id}:{name}"


def tier_field(tier: str, name: str) -> str:
    return f"{TIER_PREFIX}{tier}:{name}"


def tier_counts(counts: Mapping[str, int]) -> dict[str, Counter[str]]:
    """Every tier's own counts in a bucket's (or a sum of buckets') counts, under the
    queue's field names."""
    found: dict[str, Counter[str]] = {}
    for name, value in counts.items():
        if name.startswith(TIER_PREFIX):
            tier, _, field = name[len(TIER_PREFIX) :].partition(":")
            found.setdefault(tier, Counter())[field] += value
    return found


@dataclass
class Usage:
    """One key's usage over some time: requests by outcome, and tokens."""

    requests: Counter[str]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens: the prompts answered from the response cache
    spend_nanos: int = 0  # at each model's price when it answered (SPEND)

    def add(self, other: Usage) -> None:
        self.requests.update(other.requests)
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        self.spend_nanos += other.spend_nanos


def usage_of(counts: Mapping[str, int]) -> dict[int, Usage]:
    """Every key's usage in a bucket's (or a sum of buckets') counts."""
    found: dict[int, Usage] = {}
    for name, value in counts.items():
        if not name.startswith(USAGE_PREFIX):
            continue
        key, _, what = name[len(USAGE_PREFIX) :].partition(":")
        usage = found.setdefault(int(key), Usage(Counter()))
        if what == PROMPT_TOKENS:
            usage.prompt_tokens += value
        elif what == COMPLETION_TOKENS:
            usage.completion_tokens += value
        elif what == CACHED_TOKENS:
            usage.cached_tokens += value
        elif what == SPEND:
            usage.spend_nanos += value
        elif what.startswith("req:"):
            usage.requests[what[4:]] += value
    return found


def without_usage(counts: Mapping[str, int]) -> dict[str, int]:
    """The queue's own figures of `counts`, without the per-key usage fields."""
    return {name: value for name, value in counts.items() if not name.startswith(USAGE_PREFIX)}


def token_counts(tokens_by_key: Mapping[int, tuple[int, int]]) -> dict[str, int]:
    """Usage fields of keys' tokens: key id -> (prompt tokens, completion tokens); anonymous
    requests (key 0) are not a key's usage."""
    counts: dict[str, int] = {}
    for key_id, (prompt, completion) in tokens_by_key.items():
        if key_id:
            counts[usage_field(key_id, PROMPT_TOKENS)] = prompt
            counts[usage_field(key_id, COMPLETION_TOKENS)] = completion
    return counts


def latency_bucket(latency_ms: float) -> int:
    return bisect.bisect_left(LATENCY_BOUNDS_MS, latency_ms)


def add_counts(
    pipe: redis.client.Pipeline, queue: str, at_s: float, counts: Mapping[str, int]
) -> None:
    """Queue HINCRBYs of `counts` into the buckets holding time `at_s`, both granularities."""
    second = int(at_s)
    keys = QueueKeys(queue)
    for granularity in (SECOND, TEN_SECONDS):
        key = keys.stats_bucket(granularity, second - second % granularity)
        for field, value in counts.items():
            if value:
                pipe.hincrby(key, field, value)
        pipe.expire(key, TTL_S[granularity])


class RequestStats:
    """A web process's request counters, per second of its clock in memory until the next
    flush, then in its Flusher until Redis applied them (once, in Redis's time)."""

    def __init__(self, queue: str, clock: Callable[[], float] = time.time) -> None:
        self.queue = queue
        self.clock = clock
        self.flusher = flushing.Flusher(queue, clock)
        self._lock = threading.Lock()
        self._pending: defaultdict[int, Counter[str]] = defaultdict(Counter)

    def record(
        self,
        outcome: RequestOutcome,
        latency_s: float,
        now: float | None = None,
        key_id: int = 0,
        tier: str = "",
        via: str = "",
        no_worker: bool = False,
    ) -> None:
        """The request path's only statistics work: a few dictionary increments (more for a
        request of a tier, one with an API key (its usage), one through an alias (`via`) and
        one refused for want of a live worker)."""
        latency_ms = latency_s * 1000
        second = int(self.clock() if now is None else now)
        requests, latency = "req:" + outcome, f"{LATENCY}{latency_bucket(latency_ms)}"
        with self._lock:
            counts = self._pending[second]
            counts[requests] += 1
            counts[latency] += 1
            counts["lat_us"] += int(latency_ms * 1000)
            if tier:
                counts[tier_field(tier, requests)] += 1
                counts[tier_field(tier, latency)] += 1
            if key_id:
                counts[usage_field(key_id, requests)] += 1
            if via:
                counts[f"{VIA_PREFIX}{via}:{requests}"] += 1
            if no_worker:
                counts[NO_WORKER] += 1
                if via:
                    counts[f"{VIA_PREFIX}{via}:{NO_WORKER}"] += 1

    def record_offline(self, ok: int, errors: int, now: float | None = None) -> None:
        """Offline lines answered on this model: 200s, and failures of the service's own."""
        second = int(self.clock() if now is None else now)
        with self._lock:
            counts = self._pending[second]
            counts[OFFLINE_OK] += ok
            counts[OFFLINE_ERRORS] += errors

    def record_token_time(self, first: bool, seconds: float, now: float | None = None) -> None:
        """A stream's content chunk went: `seconds` since its request's arrival (its `first`),
        or since its choice's last chunk."""
        field = f"{TTFT if first else ITL}{latency_bucket(seconds * 1000)}"
        second = int(self.clock() if now is None else now)
        with self._lock:
            self._pending[second][field] += 1

    def record_cache(self, hits: int, misses: int, now: float | None = None) -> None:
        """Items answered from the response cache, and items it was asked for but lacked."""
        second = int(self.clock() if now is None else now)
        with self._lock:
            counts = self._pending[second]
            counts[CACHE_HITS] += hits
            counts[CACHE_MISSES] += misses

    def record_usage(
        self,
        key_id: int,
        prompt: int,
        completion: int,
        cached: int,
        now: float | None = None,
        spend_nanos: int = 0,
    ) -> None:
        """A key's 200 answer's tokens, as its `usage` reported them (`cached`: the prompt
        tokens of its prompts answered from the response cache, a part of `prompt`), and
        what they cost at the model's price."""
        if not key_id:
            return
        second = int(self.clock() if now is None else now)
        with self._lock:
            counts = self._pending[second]
            counts[usage_field(key_id, PROMPT_TOKENS)] += prompt
            counts[usage_field(key_id, COMPLETION_TOKENS)] += completion
            if cached:
                counts[usage_field(key_id, CACHED_TOKENS)] += cached
            if spend_nanos:
                counts[usage_field(key_id, SPEND)] += spend_nanos

    def flush(self, client: redis.Redis) -> int:
        """Send the pending seconds as one flush, with any earlier one Redis has not applied
        yet; returns the number of requests written. On an error (Redis away:
        RedisClusterException is no RedisError) the flushes stay, to go again as they are."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(Counter)
        self.flusher.add(pending)
        return self.flusher.send(client)


def batch_counts(
    *,
    worker: str,
    size: int,
    expired: int,
    queue_wait_ms: int | None,
    sampler_ms: float,
    calls: int,
    max_batch_size: int,
) -> dict[str, int]:
    counts = {
        "batches": 1,
        "calls": calls,  # batched_sample calls: 0 when every item had expired
        "items": size,
        "sampled": size - expired,
        "expired": expired,
        "capacity": max_batch_size,  # fill % = items / capacity, whatever the policy was
        "busy_us": round(sampler_ms * 1000),  # time in sampling calls
        f"w:{worker}:batches": 1,
        f"w:{worker}:busy_us": round(sampler_ms * 1000),
    }
    if queue_wait_ms is not None:
        counts["waits"] = 1
        counts["wait_ms"] = max(0, queue_wait_ms)
    return counts


def queue_time_counts(queue_times_ms: Iterable[float]) -> Counter[str]:
    """Items' queue times as QUEUE_TIME histogram fields. A worker sends them with a
    heartbeat every few seconds (workers.runner.QUEUE_TIMES_EVERY_S), not with each batch:
    a batch's items span a few dozen buckets, a HINCRBY each, which per batch would add a
    command or more per request."""
    return Counter(f"{QUEUE_TIME}{latency_bucket(max(0.0, ms))}" for ms in queue_times_ms)


def busy_counts(worker: str, sampler_ms: float) -> dict[str, int]:
    """A call's busy time alone (a call of backfill items only: no batch of the queue's)."""
    busy_us = round(sampler_ms * 1000)
    return {
        "busy_us": busy_us,
        f"w:{worker}:busy_us": busy_us,
        BACKFILL_CALLS: 1,
        BACKFILL_BUSY_US: busy_us,
    }


def alive_counts(worker: str, seconds: int = 1) -> dict[str, int]:
    """A heartbeat's worker-seconds: busy % = busy time / time alive, per worker and in all."""
    return {"alive": seconds, f"w:{worker}:alive": seconds}


def read_buckets(
    client: redis.Redis, queue: str, granularity: int, start_s: int, end_s: int
) -> list[tuple[int, Counter[str]]]:
    """(bucket start, counts) for every bucket in [start_s, end_s), empty ones included."""
    first = start_s - start_s % granularity
    starts = list(range(first, end_s, granularity))
    keys = QueueKeys(queue)
    with client.pipeline(transaction=False) as pipe:
        for start in starts:
            pipe.hgetall(keys.stats_bucket(granularity, start))
        raw = pipe.execute()
    return [
        (start, Counter({k.decode(): int(v) for k, v in fields.items()}))
        for start, fields in zip(starts, raw, strict=True)
    ]


def merge(buckets: Iterable[Mapping[str, int]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for counts in buckets:
        total.update(counts)
    return total


@dataclass(frozen=True)
class Summary:
    """Figures of one window of summed counters; `peak_demand_rps`, where known, the demand
    rate of the window's busiest stretch (telemetry.recommendation)."""

    counts: Counter[str]
    seconds: float
    peak_demand_rps: float | None = None

    def requests(self, outcome: RequestOutcome | None = None) -> int:
        if outcome is not None:
            return self.counts["req:" + outcome]
        return sum(self.counts["req:" + o] for o in RequestOutcome)

    def rate(self, outcome: RequestOutcome | None = None) -> float:
        return self.requests(outcome) / self.seconds if self.seconds > 0 else 0.0

    def demand_rate(self) -> float:
        """Requests/s that asked a GPU for a completion: all but those refused before any
        batch (bad requests, no valid key, over the key's rate limit) and those the response
        cache answered (counted by item: a request of several items may count more)."""
        if not self.seconds:
            return 0.0
        refused = sum(
            self.requests(outcome)
            for outcome in (
                RequestOutcome.BAD_REQUEST,
                RequestOutcome.UNAUTHORIZED,
                RequestOutcome.RATE_LIMITED,
            )
        )
        asked = self.requests() - refused - self.counts[CACHE_HITS]
        return max(0, asked) / self.seconds

    def cache_hit_percent(self) -> float | None:
        """Of the items the response cache was asked for, the % it answered."""
        asked = self.counts[CACHE_HITS] + self.counts[CACHE_MISSES]
        return 100 * self.counts[CACHE_HITS] / asked if asked else None

    @property
    def batches(self) -> int:
        return self.counts["batches"]

    def mean_batch(self) -> float | None:
        return self.counts["items"] / self.batches if self.batches else None

    def fill_percent(self) -> float | None:
        capacity = self.counts["capacity"]
        return 100 * self.counts["items"] / capacity if capacity else None

    def mean_sampler_ms(self) -> float | None:
        """The mean call of the queue's batches: the calls of backfill items only are not."""
        calls = self.counts["calls"]
        interactive_us = self.counts["busy_us"] - self.counts[BACKFILL_BUSY_US]
        return interactive_us / 1000 / calls if calls else None

    def backfill_busy_percent(self) -> float | None:
        """The share of the workers' time in calls of backfill items only."""
        alive = self.counts["alive"]
        return min(100.0, 100 * self.counts[BACKFILL_BUSY_US] / 1e6 / alive) if alive else None

    def mean_queue_wait_ms(self) -> float | None:
        waits = self.counts["waits"]
        return self.counts["wait_ms"] / waits if waits else None

    def busy_percent(self, worker: str | None = None) -> float | None:
        prefix = f"w:{worker}:" if worker else ""
        alive = self.counts[prefix + "alive"]
        return min(100.0, 100 * self.counts[prefix + "busy_us"] / 1e6 / alive) if alive else None

    def latency_percentile_ms(self, q: float, histogram: str = LATENCY) -> float | None:
        """The q-th percentile of a latency histogram: requests' (LATENCY) by default, or
        TTFT, ITL, QUEUE_TIME."""
        return histogram_percentile(
            [self.counts[f"{histogram}{i}"] for i in range(len(LATENCY_BOUNDS_MS) + 1)], q
        )


def histogram_percentile(bucket_counts: list[int], q: float) -> float | None:
    """The q-th percentile (0-100) of a LATENCY_BOUNDS_MS histogram, interpolated linearly
    inside its bucket; None for an empty histogram."""
    total = sum(bucket_counts)
    if total == 0:
        return None
    rank = q / 100 * total
    seen = 0
    for index, count in enumerate(bucket_counts):
        if count and seen + count >= rank:
            low = LATENCY_BOUNDS_MS[index - 1] if index > 0 else 0.0
            high = LATENCY_BOUNDS_MS[index] if index < len(LATENCY_BOUNDS_MS) else low * 1.1
            return low + (high - low) * max(0.0, rank - seen) / count
        seen += count
    return LATENCY_BOUNDS_MS[-1]
