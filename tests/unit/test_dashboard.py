"""The stats page's figures and recommendation for a fixed scenario written to a real Redis."""

from __future__ import annotations

import time

import pytest
import redis

from batching.aggregator import BatchAggregator
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from operations import dashboard
from telemetry import stats
from telemetry.recommendation import RECENT_S
from tests.support import unique_queue
from tests.support.queue_views import workers_of


def test_fixed_scenario_matches_the_hand_calculation(redis_client: redis.Redis) -> None:
    # 25 GPUs, each running 10 calls of 100 ms a second with 90 prompts: 22,500 req/s.
    queue = unique_queue("dash")
    now = time.time()
    gpus = [f"gpu{i}@node" for i in range(25)]
    aggregator = BatchAggregator(redis_client, queue)
    for gpu in gpus:
        workers_of(aggregator).heartbeat(gpu)
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
    requests_chart, fill_chart, latency_chart, _, busy_chart = board.charts
    assert 'data-series="ok"' in requests_chart
    assert 'data-series="fill"' in fill_chart
    assert 'data-series="busy"' in busy_chart
    assert "deadline 500 ms" in latency_chart


def test_tier_rows_count_each_tier_apart(redis_client: redis.Redis) -> None:
    queue = unique_queue("dash-tiers")
    now = time.time()
    recorder = stats.RequestStats(queue)
    sent = {  # tier -> (outcome, latency s, how many)
        "enterprise": [(RequestOutcome.OK, 0.100, 120)],
        "free": [
            (RequestOutcome.OK, 0.200, 30),
            (RequestOutcome.REJECTED, 0.005, 60),
            (RequestOutcome.TIMEOUT, 0.500, 10),
            (RequestOutcome.RATE_LIMITED, 0.001, 7),
        ],
    }
    for tier, answers in sent.items():
        for outcome, latency_s, count in answers:
            for index in range(count):
                recorder.record(outcome, latency_s, now=now - 30 + index % 20, tier=tier)
    recorder.record(RequestOutcome.UNAUTHORIZED, 0.001, now=now - 5)  # no tier: no row
    recorder.flush(redis_client)

    order = ["enterprise", "plus", "free"]
    board = dashboard.build(redis_client, queue, Policy(), now=now, tier_order=order)
    assert [row.name for row in board.tiers] == ["enterprise", "free"]  # plus sent nothing
    for row in board.tiers:
        answers = sent[row.name]
        total = sum(count for _, _, count in answers)
        ok = sum(count for outcome, _, count in answers if outcome == RequestOutcome.OK)
        limited = sum(c for o, _, c in answers if o == RequestOutcome.RATE_LIMITED)
        assert row.requests_rps == total / RECENT_S
        assert row.goodput_rps == ok / RECENT_S
        assert row.goodput_percent == 100 * ok / (total - limited)
        assert row.rate_limited == limited
        by_outcome = {outcome: count for outcome, _, count in answers}
        assert row.rejected == by_outcome.get(RequestOutcome.REJECTED, 0)
        assert row.timeouts == by_outcome.get(RequestOutcome.TIMEOUT, 0)
    enterprise, free = board.tiers
    assert enterprise.p99_ms == pytest.approx(100, rel=0.1)  # buckets are 10% wide
    # free's median answer is one of its 60 refusals (5 ms), its p99 a timeout (500 ms)
    assert free.p50_ms == pytest.approx(5, rel=0.1)
    assert free.p99_ms == pytest.approx(500, rel=0.1)
    # The tiers' counts are apart from the queue's, which has every request.
    assert board.recent.requests() == sum(c for a in sent.values() for _, _, c in a) + 1


def test_streams_time_to_first_token_between_tokens_and_queue_time(
    redis_client: redis.Redis,
) -> None:
    """Each histogram as its counters were written: a web process's streams (first token,
    between tokens) and a worker's heartbeat (its sampled items' queue times)."""
    queue = unique_queue("dash-streams")
    now = time.time()
    recorder = stats.RequestStats(queue)
    for index in range(100):  # first tokens of 20 to 119 ms, 10 ms between tokens
        recorder.record_token_time(True, (20 + index) / 1000, now=now - 30)
        recorder.record_token_time(False, 0.010, now=now - 30)
    recorder.flush(redis_client)
    queue_times_ms = [5.0] * 90 + [250.0] * 10  # 90 items waited 5 ms, 10 a whole call more
    with redis_client.pipeline(transaction=False) as pipe:
        stats.add_counts(pipe, queue, int(now) - 20, stats.queue_time_counts(queue_times_ms))
        pipe.execute()

    board = dashboard.build(redis_client, queue, Policy(), now=now)
    recent = board.recent
    assert recent.latency_percentile_ms(50, stats.TTFT) == pytest.approx(70, rel=0.1)
    assert recent.latency_percentile_ms(99, stats.TTFT) == pytest.approx(119, rel=0.1)
    assert recent.latency_percentile_ms(50, stats.ITL) == pytest.approx(10, rel=0.1)
    assert recent.latency_percentile_ms(50, stats.QUEUE_TIME) == pytest.approx(5, rel=0.1)
    assert recent.latency_percentile_ms(95, stats.QUEUE_TIME) == pytest.approx(250, rel=0.1)
    # A stream's figures are not a request's: no request was counted.
    assert recent.latency_percentile_ms(50) is None
    headline = dict(board.headline)
    p50, p99 = (recent.latency_percentile_ms(q, stats.TTFT) or 0 for q in (50, 99))
    assert headline["time to first token p50 / p99 (streams)"] == f"{p50:.0f} ms / {p99:.0f} ms"
    streams_chart = board.charts[3]
    for series in ("first token p50", "first token p99", "queue p50", "queue p99"):
        assert f'data-series="{series}"' in streams_chart
