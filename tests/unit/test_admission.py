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
# The running calls' ends (ms from now) that the shard's seals recorded: none known (the worst
# case), one overdue, two of which one is near, more than three workers' worth.
CALL_ENDS: tuple[tuple[int, ...], ...] = ((), (-20,), (30, 240), (5, 60, 120, 200))


def lua_decision(
    client: redis.Redis, ages: list[int], open_queued: bool, workers: int, turn_ms: int,
    ends: tuple[int, ...] = (),
) -> tuple[bool, int]:  # fmt: skip
    aggregator = BatchAggregator(client, unique_queue("adm"), deadline_ms=DEADLINE_MS)
    keys = aggregator.shards[0]
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    for index, end in enumerate(ends):  # the running calls' ends, as their seals recorded them
        client.zadd(keys.call_ends, {f"c{index}": now_ms + end})
    closed = ages[:-1] if open_queued else ages  # the newest batch is the open one
    for index, age in enumerate(closed):
        client.zadd(keys.unsealed, {f"b{index}": now_ms - age})
    if open_queued:
        client.set(keys.open_batch, f"b{len(ages) - 1} {now_ms - ages[-1]} 100")
    # What a worker's heartbeat gives every shard; the request only reads the outcome.
    aggregator.refresh_admission(AdmissionInputs(workers=workers, turn_ms=turn_ms), now_ms=now_ms)
    ticket = aggregator.append("p", DEADLINE_MS)
    return ticket.rejected, ticket.predicted_ms


def simulation_decision(
    ages: list[int], open_queued: bool, workers: int, turn_ms: int, ends: tuple[int, ...] = ()
) -> bool:
    now = 10_000.0
    queued: deque[simulation._Batch] = deque(simulation._Batch(now - age) for age in ages)
    latest = sorted(ends)[-workers:] if workers else []  # the latest `workers` calls
    call_ends = [now + end for end in latest]
    return simulation.refuses(queued, open_queued, workers, turn_ms, now, DEADLINE_MS, call_ends)


def test_the_script_and_the_simulation_decide_alike(redis_client: redis.Redis) -> None:
    decisions = []
    for workers, turn_ms, fresh, stale, open_queued, ends in itertools.product(
        (0, 1, 2, 3), (0, 103, 250), range(len(FRESH_AGES) + 1), (0, 2), (False, True),
        CALL_ENDS,
    ):  # fmt: skip
        ages = [*STALE_AGES[:stale], *FRESH_AGES[:fresh]]  # oldest first, as queued
        if open_queued and not ages:
            continue
        case = (workers, turn_ms, fresh, stale, open_queued, ends)
        refused, predicted = lua_decision(redis_client, ages, open_queued, workers, turn_ms, ends)
        assert refused == simulation_decision(ages, open_queued, workers, turn_ms, ends), case
        if refused:
            ahead = fresh - (1 if open_queued else 0)  # the open batch is not ahead
            frees = sorted(ends)[-workers:]
            expected = admission.predicted_ms(ahead, workers, turn_ms, frees)
            assert expected is not None
            assert abs(predicted - expected) <= 1, case  # the figure is stored in whole ms
        decisions.append((refused, ends))
    # The grid covers both answers, with and without the calls' ends: agreement means something.
    for known in CALL_ENDS:
        answers = [refused for refused, ends in decisions if ends == known]
        assert 0 < sum(answers) < len(answers), known
    # Knowing when the calls end admits what the worst case refuses, never the other way.
    assert sum(r for r, e in decisions if e == ()) > sum(r for r, e in decisions if e == (-20,))


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


def test_a_known_call_end_counts_from_that_end_plus_a_margin() -> None:
    margin = admission.ADMISSION_MARGIN_TURNS * 100
    # One worker whose call ends in 30 ms: then the 4 batches ahead, then its own call.
    assert admission.predicted_ms(4, 1, 100, frees=[30]) == 30 + margin + 5 * 100
    # An overdue call counts as ending now; one ending later than a turn, as a turn.
    assert admission.predicted_ms(4, 1, 100, frees=[-50]) == margin + 5 * 100
    assert admission.predicted_ms(4, 1, 100, frees=[400]) == 6 * 100
    # Two workers, 3 batches ahead: the second GPU to free takes the newcomer's batch, round 1.
    assert admission.predicted_ms(3, 2, 100, frees=[10, 40]) == 40 + margin + 2 * 100
    # A GPU whose end is not known frees a turn from now.
    assert admission.predicted_ms(3, 2, 100, frees=[10]) == 100 + 2 * 100
    # A long call's margin is capped: the web path and the gap do not grow with the call.
    long_turn = 10 * admission.ADMISSION_MARGIN_MAX_MS / admission.ADMISSION_MARGIN_TURNS
    capped = 30 + admission.ADMISSION_MARGIN_MAX_MS + 2 * long_turn  # the batch ahead, its own
    assert admission.predicted_ms(1, 1, long_turn, frees=[30]) == capped
