"""Statistics counters on a real Redis: recorded in memory, flushed in bulk, summed back."""

from __future__ import annotations

import random
import statistics

import pytest
import redis

from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from telemetry import stats
from tests.support import unique_queue


def test_request_counts_flush_to_both_granularities(redis_client: redis.Redis) -> None:
    queue = unique_queue("st")
    recorder = stats.RequestStats(queue)
    now = 1_800_000_005.5
    outcomes = [RequestOutcome.OK] * 7 + [RequestOutcome.TIMEOUT] * 2 + [RequestOutcome.BAD_REQUEST]
    for outcome in outcomes:
        recorder.record(outcome, 0.120, now=now)
    recorder.record(RequestOutcome.OK, 0.080, now=now + 1)
    assert recorder.flush(redis_client) == len(outcomes) + 1
    assert recorder.flush(redis_client) == 0  # nothing left pending

    seconds = stats.read_buckets(redis_client, queue, stats.SECOND, int(now), int(now) + 2)
    assert [c["req:ok"] for _, c in seconds] == [7, 1]
    ten = stats.read_buckets(redis_client, queue, stats.TEN_SECONDS, int(now), int(now) + 1)
    summary = stats.Summary(ten[0][1], 10)
    assert summary.requests() == 11
    assert summary.requests(RequestOutcome.TIMEOUT) == 2
    assert summary.demand_rate() == pytest.approx(1.0)  # 10 of 11 asked for a completion
    assert summary.counts["lat_us"] == 10 * 120_000 + 80_000
    assert redis_client.ttl(QueueKeys(queue).stats_bucket(stats.TEN_SECONDS, 1_800_000_000)) > 3600


def test_percentiles_from_buckets_match_the_exact_ones(redis_client: redis.Redis) -> None:
    queue = unique_queue("st")
    recorder = stats.RequestStats(queue)
    rng = random.Random(4)
    latencies_ms = [rng.lognormvariate(5, 0.4) for _ in range(5000)]  # ~150 ms median
    for latency in latencies_ms:
        recorder.record(RequestOutcome.OK, latency / 1000, now=1_800_000_000)
    recorder.flush(redis_client)
    ((_, counts),) = stats.read_buckets(
        redis_client, queue, stats.TEN_SECONDS, 1_800_000_000, 1_800_000_001
    )
    summary = stats.Summary(counts, 10)
    exact = statistics.quantiles(latencies_ms, n=100)
    for q in (50, 95, 99):
        assert summary.latency_percentile_ms(q) == pytest.approx(exact[q - 1], rel=0.05), q


def test_histogram_percentile_interpolates_inside_a_bucket() -> None:
    counts = [0] * (len(stats.LATENCY_BOUNDS_MS) + 1)
    index = stats.latency_bucket(100.0)
    counts[index] = 10
    low, high = stats.LATENCY_BOUNDS_MS[index - 1], stats.LATENCY_BOUNDS_MS[index]
    assert low < 100.0 <= high
    assert stats.histogram_percentile(counts, 50) == pytest.approx((low + high) / 2)
    assert stats.histogram_percentile([0] * len(counts), 50) is None


def test_batch_and_alive_counts_give_fill_and_busy() -> None:
    counts = stats.merge(
        [
            stats.batch_counts(worker="g0", size=80, expired=5, queue_wait_ms=40,
                               sampler_ms=100, calls=1, max_batch_size=100),
            stats.batch_counts(worker="g1", size=40, expired=0, queue_wait_ms=None,
                               sampler_ms=100, calls=1, max_batch_size=100),
            stats.alive_counts("g0", 1),
            stats.alive_counts("g1", 1),
        ]
    )  # fmt: skip
    summary = stats.Summary(counts, 1)
    assert summary.mean_batch() == 60
    assert summary.fill_percent() == 60
    assert summary.counts["expired"] == 5
    assert summary.mean_queue_wait_ms() == 40  # one batch had no known opening time
    assert summary.mean_sampler_ms() == 100  # from the busy time: one counter, not two
    assert "sampler_us" not in summary.counts
    assert summary.busy_percent() == pytest.approx(10)  # 0.2 s busy of 2 worker-seconds
    assert summary.busy_percent("g0") == pytest.approx(10)
