"""A web process's statistics flush on a real Redis: applied once whatever is sent again, in
Redis's time whatever the process's clock says."""

from __future__ import annotations

import contextlib
import time

import redis

from batching.outcomes import RequestOutcome
from telemetry import stats
from tests.support import unique_queue

# Keys whose usage one flush carries in the timeout test: enough fields that Redis takes far
# longer than the client's socket timeout to apply them (about 0.7 s against 0.01 s).
KEYS = 60_000


def ok_requests(client: redis.Redis, queue: str, second: int, granularity: int = 10) -> int:
    [(_, counts)] = stats.read_buckets(client, queue, granularity, second, second + 1)
    return counts["req:ok"]


def test_a_flush_that_times_out_after_redis_applied_it_counts_once(
    redis_client: redis.Redis,
) -> None:
    queue = unique_queue("flush")
    recorder = stats.RequestStats(queue)
    now = time.time()
    for key_id in range(1, KEYS + 1):
        recorder.record(RequestOutcome.OK, 0.01, now=now, key_id=key_id)
    pool = redis_client.connection_pool
    impatient = redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=pool.connection_class,
            **{**pool.connection_kwargs, "socket_timeout": 0.01},
        )
    )
    # No reply in time, after redis-py's own retries (it sends a timed-out command again):
    # Redis goes on and applies what it received all the same.
    with contextlib.suppress(redis.TimeoutError):
        recorder.flush(impatient)
    second = int(now)

    recorder.flush(redis_client)  # sent again, as it was
    recorder.flush(redis_client)
    for granularity in (stats.SECOND, stats.TEN_SECONDS):
        assert ok_requests(redis_client, queue, second, granularity) == KEYS
        [(_, counts)] = stats.read_buckets(redis_client, queue, granularity, second, second + 1)
        used = stats.usage_of(counts)
        assert used[1].requests == used[KEYS].requests == {RequestOutcome.OK: 1}


def test_a_failed_flush_goes_again_as_it_was(redis_client: redis.Redis) -> None:
    queue = unique_queue("flush")
    recorder = stats.RequestStats(queue)
    now = time.time()
    recorder.record(RequestOutcome.OK, 0.1, now=now)
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)
    try:
        recorder.flush(dead)
    except redis.ConnectionError:
        pass
    else:
        raise AssertionError("a flush to no Redis succeeded")
    recorder.record(RequestOutcome.OK, 0.1, now=now)
    assert recorder.flush(redis_client) == 2  # the kept flush, then the new one
    assert ok_requests(redis_client, queue, int(now)) == 2
    assert recorder.flush(redis_client) == 0


def test_a_process_whose_clock_is_30_s_off_counts_in_redis_time(
    redis_client: redis.Redis,
) -> None:
    queue = unique_queue("flush")
    recorder = stats.RequestStats(queue, clock=lambda: time.time() + 30)
    recorder.record(RequestOutcome.OK, 0.1)
    recorder.record_usage(7, 5, 3, 0)
    recorder.flush(redis_client)
    seconds, _ = redis_client.time()
    buckets = stats.read_buckets(redis_client, queue, stats.SECOND, seconds - 5, seconds + 40)
    found = {start - seconds for start, counts in buckets if counts["req:ok"]}
    assert len(found) == 1
    assert -2 <= found.pop() <= 0  # the node's second, not 30 s ahead
