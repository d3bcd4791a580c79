"""The autoscaling signal: /metrics' sampling_gpus_recommended and sampling_gpus_live after a
known minute of traffic written to a real Redis the way web processes and workers write it,
checked against the calculation done by hand."""

from __future__ import annotations

import time

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from batching.aggregator import BatchAggregator
from batching.outcomes import RequestOutcome
from batching.policy import Policy
from operations import dashboard
from serving.metrics import exposition
from telemetry import stats
from telemetry.recommendation import RECENT_S, RIGHT, UNDER
from tests.support import unique_queue
from tests.support.queue_views import workers_of


def feed(
    client: redis.Redis,
    queue: str,
    *,
    ok_per_s: int,
    bad_per_s: int,
    batches_per_s: int,
    batch_size: int,
    call_ms: float,
    policy: Policy,
) -> None:
    """A steady minute (and a second either side, whatever second the scrape falls in): each
    second `ok_per_s` answered and `bad_per_s` refused requests (the web processes' counts) and
    `batches_per_s` calls of `call_ms` (the workers')."""
    now = int(time.time())
    with client.pipeline(transaction=False) as pipe:
        for second in range(now - RECENT_S - 1, now + 2):
            counts = {
                "req:" + RequestOutcome.OK: ok_per_s,
                "req:" + RequestOutcome.BAD_REQUEST: bad_per_s,
            }
            for _ in range(batches_per_s):
                batch = stats.batch_counts(
                    worker="w", size=batch_size, expired=0, queue_wait_ms=5,
                    sampler_ms=call_ms, calls=1, max_batch_size=policy.max_batch_size,
                )  # fmt: skip
                for field, value in batch.items():
                    counts[field] = counts.get(field, 0) + value
            stats.add_counts(pipe, queue, second, counts)
        pipe.execute()


def gauges(client: redis.Redis, queue: str, policy: Policy) -> dict[str, float]:
    text = exposition(client, [(queue, policy)]).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("sampling_gpus_recommended", "sampling_gpus_live"):
            (sample,) = family.samples
            assert sample.labels == {"queue": queue}
            found[family.name] = sample.value
    return found


@pytest.mark.parametrize(
    ("traffic", "policy", "live", "by_hand"),
    [
        # 3,000 req/s, 30 calls/s of 100 ms, batches of 100 at a 90% fill target:
        # 3,000 x 0.1 s / (100 x 0.9) = 3.33 GPUs, so 4.
        (dict(ok_per_s=3000, bad_per_s=0, batches_per_s=30, batch_size=100, call_ms=100),
         Policy(max_batch_size=100, fill_target_percent=90), 2, 4),
        # 1,000 req/s of which 200 bad requests (refused before any batch: no GPU demand),
        # calls of 250 ms, batches of 50 at 80%: 800 x 0.25 / (50 x 0.8) = 5 exactly, so 5.
        (dict(ok_per_s=800, bad_per_s=200, batches_per_s=16, batch_size=50, call_ms=250),
         Policy(max_batch_size=50, fill_target_percent=80), 7, 5),
        # The same demand with full batches planned for (100%): 4 GPUs.
        (dict(ok_per_s=800, bad_per_s=200, batches_per_s=16, batch_size=50, call_ms=250),
         Policy(max_batch_size=50, fill_target_percent=100), 1, 4),
        # No traffic: 1, never 0 (a queue without a GPU answers nothing).
        (dict(ok_per_s=0, bad_per_s=0, batches_per_s=0, batch_size=0, call_ms=0),
         Policy(), 3, 1),
    ],
)  # fmt: skip
def test_gauges_match_the_hand_calculation(
    redis_client: redis.Redis, traffic: dict[str, int], policy: Policy, live: int, by_hand: int
) -> None:
    queue = unique_queue("gauges")
    feed(redis_client, queue, policy=policy, **traffic)
    aggregator = BatchAggregator(redis_client, queue, max_batch_size=policy.max_batch_size)
    for index in range(live):
        workers_of(aggregator).heartbeat(f"worker-{index}")
    assert gauges(redis_client, queue, policy) == {
        "sampling_gpus_recommended": by_hand,
        "sampling_gpus_live": live,
    }


def test_a_worker_that_leaves_leaves_the_live_gauge(redis_client: redis.Redis) -> None:
    queue, policy = unique_queue("gauges"), Policy()
    aggregator = BatchAggregator(redis_client, queue)
    workers_of(aggregator).heartbeat("staying")
    workers_of(aggregator).heartbeat("leaving")
    assert gauges(redis_client, queue, policy)["sampling_gpus_live"] == 2
    workers_of(aggregator).forget("leaving")  # as a worker stopping says so
    assert gauges(redis_client, queue, policy)["sampling_gpus_live"] == 1


def feed_seconds(
    client: redis.Redis, queue: str, now: int, per_second: dict[int, tuple[int, int]]
) -> None:
    """Seconds of one simulated GPU's traffic (100 ms calls, full batches of its served
    requests): `per_second[offset]` = (answered, refused with a 503), the second now + offset."""
    with client.pipeline(transaction=False) as pipe:
        for offset, (ok, refused) in per_second.items():
            counts = {"req:" + RequestOutcome.OK: ok, "req:" + RequestOutcome.REJECTED: refused}
            for _ in range(10):  # ten calls a second, each of a tenth of the answered
                batch = stats.batch_counts(
                    worker="w", size=ok // 10, expired=0, queue_wait_ms=5, sampler_ms=100,
                    calls=1, max_batch_size=100,
                )  # fmt: skip
                for name, value in batch.items():
                    counts[name] = counts.get(name, 0) + value
            stats.add_counts(pipe, queue, now + offset, counts)
        pipe.execute()


HALF = (500, 0)  # half of one GPU's limit (1,000 req/s: 100 per call of 100 ms)
BURST = (1_000, 300)  # 130% of it: the limit answered, the rest refused (503)


@pytest.mark.parametrize(
    ("burst", "by_hand"),
    [
        # The last 8 s of the minute at 130%: its busiest 10 s (2 at half, 8 at 130%) ask
        # (2 x 500 + 8 x 1,300) / 10 = 1,140 req/s, x 0.1 s / (100 x 90%) = 1.27: 2 GPUs.
        (range(-8, 0), 2),
        # 20 s at 130% that ended 10 s ago: 1,300 x 0.1 / 90 = 1.44, 2 GPUs a minute long,
        # where the minute's mean (40 s at 500, 20 at 1,300: 767 req/s) reads 1, right-sized.
        (range(-30, -10), 2),
        # No burst: the same GPU at half its limit is right-sized.
        (range(0), 1),
    ],
)  # fmt: skip
def test_a_burst_inside_a_lighter_minute_asks_for_the_gpus_it_needed(
    redis_client: redis.Redis, burst: range, by_hand: int
) -> None:
    queue, policy = unique_queue("burst"), Policy(max_batch_size=100, fill_target_percent=90)
    now = int(time.time())
    seconds = {offset: BURST if offset in burst else HALF for offset in range(-RECENT_S - 1, 2)}
    feed_seconds(redis_client, queue, now, seconds)
    workers_of(BatchAggregator(redis_client, queue)).heartbeat("the one GPU")
    assert gauges(redis_client, queue, policy)["sampling_gpus_recommended"] == by_hand
    board = dashboard.build(redis_client, queue, policy, now=now + 0.5)
    assert board.recommendation.needed_gpus == by_hand
    assert board.recommendation.verdict == (UNDER if by_hand > 1 else RIGHT)
    assert board.recommendation.rate_rps < 900  # the minute's mean alone reads right-sized


def test_each_model_has_its_gauges_and_its_gpu_time_per_request(
    redis_client: redis.Redis,
) -> None:
    busy, idle, policy = unique_queue("gauges"), unique_queue("gauges"), Policy()
    # 800 req/s asking the GPUs (200 more refused as bad requests: no GPU demand).
    feed(redis_client, busy, policy=policy, ok_per_s=800, bad_per_s=200, batches_per_s=10,
         batch_size=80, call_ms=100)  # fmt: skip
    for queue, workers in ((busy, 2), (idle, 1)):
        for index in range(workers):
            workers_of(BatchAggregator(redis_client, queue)).heartbeat(f"worker-{index}")
    text = exposition(redis_client, [(busy, policy), (idle, policy)]).decode()
    by_family = {family.name: family for family in text_string_to_metric_families(text)}
    live = {s.labels["queue"]: s.value for s in by_family["sampling_gpus_live"].samples}
    assert live == {busy: 2, idle: 1}
    cost = by_family["sampling_gpu_ms_per_request"].samples
    # 2 GPUs for 800 requests/s: 2,000 GPU-ms per second over 800 requests, 2.5 ms each; the
    # idle model asks nothing, so it has no figure rather than an infinite one.
    assert [s.labels["queue"] for s in cost] == [busy]
    assert cost[0].value == pytest.approx(2.5)
