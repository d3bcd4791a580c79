"""A request's queue time, from its arrival to its call's start, as a worker counts it: from
what its item carries, not from the worker's policy, which may change while it waits."""

from __future__ import annotations

import time

import redis

from batching.aggregator import BatchAggregator
from batching.policy import Policy
from tests.support import unique_queue
from workers.runner import BatchRunner
from workers.samplers.simulated import SimulatedSampler

WAITED_MS = 100  # what the request spent on the web side before it joined its batch
DEADLINE_MS = 500  # the policy's deadline when the request arrived
LATER_DEADLINE_MS = 2000  # the policy's deadline when its worker seals its batch


def queue_time_sum_s(runner: BatchRunner) -> float:
    registry = runner.metrics.registry
    value = registry.get_sample_value("sampling_request_queue_time_seconds_sum", {"worker": "w"})
    return value or 0.0


def test_a_request_s_queue_time_is_right_when_the_policy_changes_while_it_waits(
    redis_client: redis.Redis,
) -> None:
    live = {"policy": Policy(deadline_ms=DEADLINE_MS, version=1)}
    aggregator = BatchAggregator(redis_client, unique_queue("queue-time"), deadline_ms=DEADLINE_MS)
    runner = BatchRunner(
        aggregator, SimulatedSampler(batch_ms=1), "w", policy=lambda: live["policy"]
    )
    runner.apply_policy()
    before = queue_time_sum_s(runner)
    started = time.monotonic()
    ticket = aggregator.append("a prompt", DEADLINE_MS - WAITED_MS, deadline_ms=DEADLINE_MS)
    live["policy"] = Policy(deadline_ms=LATER_DEADLINE_MS, version=2)
    runner.run(ticket.batch_id)
    elapsed_ms = (time.monotonic() - started) * 1000
    assert runner.applied.deadline_ms == LATER_DEADLINE_MS  # the worker ran the new policy
    queue_time_ms = (queue_time_sum_s(runner) - before) * 1000
    # From its arrival (WAITED_MS before the append) to its call's start, which came after
    # the append and before run() returned; whole milliseconds of the Redis clock on each end.
    assert WAITED_MS - 2 <= queue_time_ms <= WAITED_MS + elapsed_ms + 2, queue_time_ms


def test_an_older_web_process_s_item_is_timed_by_the_worker_s_policy(
    redis_client: redis.Redis,
) -> None:
    """An item without its deadline (a web process of the release before) counts from its
    expiry less the worker's policy's deadline, as that release did."""
    aggregator = BatchAggregator(redis_client, unique_queue("queue-time-old"))
    ticket = aggregator.append("a prompt", DEADLINE_MS)  # as that release appended it
    (raw,) = redis_client.lrange(aggregator.shards[0].pending, 0, -1)
    assert raw.split(b" ", 1)[0].isdigit()  # its head: the expiry alone
    item = aggregator.seal(ticket.batch_id).items[0]
    assert item.request_deadline_ms == 0
    assert item.arrived_at_ms(LATER_DEADLINE_MS) == item.expires_at_ms - LATER_DEADLINE_MS
