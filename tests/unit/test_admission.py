"""Admission's one formula, as the aggregator's scripts and the capacity planner's simulation
apply it: the same inputs must give the same decisions."""

from __future__ import annotations

import itertools
from collections import deque

import redis

from batching import admission
from batching.admission import AdmissionInputs
from batching.aggregator import BatchAggregator
from planning import simulation
from tests.support import unique_queue

DEADLINE_MS = 500
# Opening ages (ms before now) well inside and well outside the admission window (a deadline).
FRESH_AGES = (350, 300, 250, 200, 150, 100, 50)
STALE_AGES = (1500, 900)


def lua_decision(
    client: redis.Redis, ages: list[int], open_queued: bool, workers: int, turn_ms: int
) -> tuple[bool, int]:
    aggregator = BatchAggregator(client, unique_queue("adm"), deadline_ms=DEADLINE_MS)
    keys = aggregator.shards[0]
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    closed = ages[:-1] if open_queued else ages  # the newest batch is the open one
    for index, age in enumerate(closed):
        client.zadd(keys.unsealed, {f"b{index}": now_ms - age})
    if open_queued:
        client.set(keys.open_batch, f"b{len(ages) - 1} {now_ms - ages[-1]} 100")
    # What a worker's heartbeat gives every shard; the request only reads the outcome.
    aggregator.refresh_admission(AdmissionInputs(workers=workers, turn_ms=turn_ms), now_ms=now_ms)
    ticket = aggregator.append("p", DEADLINE_MS)
    return ticket.rejected, ticket.predicted_ms


def simulation_decision(ages: list[int], open_queued: bool, workers: int, turn_ms: int) -> bool:
    now = 10_000.0
    queued: deque[simulation._Batch] = deque(simulation._Batch(now - age) for age in ages)
    return simulation.refuses(queued, open_queued, workers, turn_ms, now, DEADLINE_MS)


def test_the_script_and_the_simulation_decide_alike(redis_client: redis.Redis) -> None:
    decisions = []
    for workers, turn_ms, fresh, stale, open_queued in itertools.product(
        (0, 1, 2, 3), (0, 103, 250), range(len(FRESH_AGES) + 1), (0, 2), (False, True)
    ):
        ages = [*STALE_AGES[:stale], *FRESH_AGES[:fresh]]  # oldest first, as queued
        if open_queued and not ages:
            continue
        case = (workers, turn_ms, fresh, stale, open_queued)
        refused, predicted = lua_decision(redis_client, ages, open_queued, workers, turn_ms)
        assert refused == simulation_decision(ages, open_queued, workers, turn_ms), case
        if refused:
            ahead = fresh - (1 if open_queued else 0)  # the open batch is not ahead
            assert predicted == admission.predicted_ms(ahead, workers, turn_ms), case
        decisions.append(refused)
    # The grid covers both answers, so agreement means something.
    assert 0 < sum(decisions) < len(decisions)


def test_the_formula_is_the_worst_case() -> None:
    # No backlog, no worker or no measured turn: no prediction, never refused.
    assert admission.predicted_ms(ahead=1, workers=2, turn_ms=100) is None
    assert admission.predicted_ms(ahead=5, workers=0, turn_ms=100) is None
    assert admission.predicted_ms(ahead=5, workers=1, turn_ms=0) is None
    # 4 batches ahead of one worker: they, the running call and its own call.
    extra = admission.WORST_CASE_EXTRA_TURNS
    assert admission.predicted_ms(ahead=4, workers=1, turn_ms=100) == (4 + extra) * 100
    assert admission.refuses(4, 1, 100, budget_ms=(4 + extra) * 100 - 1)
    assert not admission.refuses(4, 1, 100, budget_ms=(4 + extra) * 100)
