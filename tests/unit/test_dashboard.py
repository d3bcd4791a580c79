"""The stats page's figures and recommendation for a fixed scenario written to a real Redis."""

from __future__ import annotations

import time

import redis

from batching import stats
from batching.aggregator import BatchAggregator
from batching.policy import Policy
from operations import dashboard
from tests.support import unique_queue


def test_fixed_scenario_matches_the_hand_calculation(redis_client: redis.Redis) -> None:
    # 25 GPUs, each running 10 calls of 100 ms a second with 90 prompts: 22,500 req/s.
    queue = unique_queue("dash")
    now = time.time()
    gpus = [f"gpu{i}@node" for i in range(25)]
    aggregator = BatchAggregator(redis_client, queue)
    for gpu in gpus:
        aggregator.heartbeat(gpu)
    with redis_client.pipeline(transaction=False) as pipe:
        for second in range(int(now) - 60, int(now)):
            per_second = stats.merge(
                [{"req:ok": 22_500}]
                + [
                    stats.batch_counts(worker=gpu, size=90, expired=0, queue_wait_ms=50,
                                       sampler_ms=100, calls=1, max_batch_size=100)
                    for gpu in gpus for _ in range(10)
                ]
                + [stats.alive_counts(gpu) for gpu in gpus]
            )  # fmt: skip
            stats.add_counts(pipe, queue, second, per_second)
        pipe.execute()

    board = dashboard.build(redis_client, queue, Policy(fill_target_percent=100), now=now)
    assert board.live_workers == 25
    assert board.recent.rate() == 22_500
    assert board.recent.mean_batch() == 90
    assert board.recent.fill_percent() == 90
    assert board.recent.busy_percent() == 100  # 10 calls x 100 ms per worker-second
    # ceil(22,500 req/s x 0.1 s / (100 x 100%)) = ceil(22.5) = 23 GPUs; 25 run: 2 spare.
    advice = board.recommendation
    assert (advice.needed_gpus, advice.verdict) == (23, "over-provisioned")
    assert advice.message.startswith(
        "average batch 90 with 25 GPUs at 22,500 req/s: 2 GPUs could be released"
    )
    headline = dict(board.headline)
    assert headline["requests/s"] == "22,500.0"
    assert headline["mean batch"] == "90.0"
    # The last hour's charts have a line for each figure over the last minute.
    requests_chart, fill_chart, latency_chart, busy_chart = board.charts
    assert 'data-series="ok"' in requests_chart
    assert 'data-series="fill"' in fill_chart
    assert 'data-series="busy"' in busy_chart
    assert "deadline 500 ms" in latency_chart
