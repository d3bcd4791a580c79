"""A worker's statistics are counted in the Redis node's time (its time at the seal), not the
worker's own clock; and a worker counts the queue's sampled tokens, no key's usage (a key is
charged by the web processes, for what its 200 answers delivered)."""

from __future__ import annotations

import time

import pytest
import redis

from batching.aggregator import BatchAggregator
from batching.generation import SampleRequest
from telemetry import stats
from tests.support import unique_queue
from workers.runner import BatchRunner
from workers.samplers.simulated import SimulatedSampler


def test_a_worker_whose_clock_is_30_s_off_counts_in_redis_time(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    aggregator = BatchAggregator(redis_client, unique_queue("wclock"), deadline_ms=500)
    runner = BatchRunner(aggregator, SimulatedSampler(batch_ms=0), "w")
    ticket = aggregator.append(SampleRequest(prompt="E equals ", max_tokens=2), 500, key_id=7)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 30)  # this process's clock only
    runner.run(ticket.batch_id)
    monkeypatch.undo()
    seconds, _ = redis_client.time()
    buckets = stats.read_buckets(
        redis_client, aggregator.queue, stats.SECOND, seconds - 5, seconds + 40
    )
    found = {start - seconds: counts for start, counts in buckets if counts["batches"]}
    assert len(found) == 1
    [(offset, counts)] = found.items()
    assert -2 <= offset <= 0  # the node's second, not 30 s ahead
    assert counts[stats.SAMPLED_PROMPT_TOKENS] == 2
    assert counts[stats.SAMPLED_COMPLETION_TOKENS] == 2
    assert stats.usage_of(counts) == {}  # no key's usage: the web process counts what it got
