"""Priority lanes of the aggregator on a real Redis: one open batch per lane, the seal's choice
of lane, the hand-over of a task's batch when its seal chose another, and admission per lane."""

from __future__ import annotations

import pytest
import redis

from batching import admission
from batching.admission import AdmissionInputs
from batching.aggregator import BatchAggregator
from batching.items import Item
from batching.lanes import HOLD_LATE_FACTOR, SHARE_WEIGHT
from batching.protocol import PRIORITY_STEPS, UNKNOWN_LANE, task_priority
from tests.support import unique_queue
from tests.support.clocks import redis_ms

HIGH, LOW = 30, 10


@pytest.fixture
def aggregator(redis_client: redis.Redis) -> BatchAggregator:
    return BatchAggregator(
        redis_client, unique_queue("lanes"), max_batch_size=3, deadline_ms=60_000
    )


def fill(
    aggregator: BatchAggregator, lane: int, count: int, tag: str = "", now_ms: int | None = None
) -> list[str]:
    """`count` requests of `lane` (at `now_ms`; None: the node's time); the batch ids they
    joined, each opener's dispatch confirmed."""
    batch_ids = []
    for index in range(count):
        ticket = aggregator.append(f"{tag or lane}-{index}", 60_000, lane=lane, now_ms=now_ms)
        if ticket.opened:
            aggregator.dispatched(ticket.batch_id, lane, now_ms=now_ms)
        batch_ids.append(ticket.batch_id)
    return batch_ids


def prompts(sealed_items: list[Item]) -> list[str]:
    return [item.prompt for item in sealed_items]


def test_each_lane_has_its_own_open_batch(aggregator: BatchAggregator) -> None:
    high = fill(aggregator, HIGH, 2)
    low = fill(aggregator, LOW, 2)
    assert len(set(high)) == len(set(low)) == 1
    assert high[0] != low[0]
    assert aggregator.open_batch_id(lane=HIGH) == high[0]
    assert aggregator.open_batch_id(lane=LOW) == low[0]


def test_a_full_batch_of_a_higher_lane_goes_before_the_task_s_own(
    aggregator: BatchAggregator,
) -> None:
    low = fill(aggregator, LOW, 2)[0]
    high = fill(aggregator, HIGH, 3)[0]  # full: closed
    sealed = aggregator.seal(low, lane=LOW)
    assert (sealed.batch_id, sealed.lane) == (high, HIGH)
    assert prompts(sealed.items) == [f"{HIGH}-{i}" for i in range(3)]
    # The high batch's task, when it comes, seals in the low batch's stead.
    taken = aggregator.seal(high, lane=HIGH)
    assert (taken.batch_id, taken.lane) == (low, LOW)
    assert prompts(taken.items) == [f"{LOW}-{i}" for i in range(2)]
    assert aggregator.seal(high, lane=HIGH).sealed_before  # a third task: nothing left


def test_a_young_partial_batch_of_a_higher_lane_waits_for_a_full_lower_one(
    aggregator: BatchAggregator,
) -> None:
    high = fill(aggregator, HIGH, 1)[0]
    low = fill(aggregator, LOW, 3)[0]  # full
    sealed = aggregator.seal(high, lane=HIGH)
    assert sealed.batch_id == low
    # Once it has waited its hold, the higher lane's partial batch goes first.
    more_low = fill(aggregator, LOW, 3, tag="more")[0]
    aggregator.configure(max_batch_size=3, deadline_ms=0)  # hold 0 ms: ready at once
    assert aggregator.seal(more_low, lane=LOW).batch_id == high


def test_a_held_partial_batch_waits_longer_while_a_lower_full_one_can_take_the_turn(
    aggregator: BatchAggregator,
) -> None:
    """Past its hold, a higher lane's partial batch waits on (up to HOLD_LATE_FACTOR holds)
    while a lower lane's full batch can use the turn whole; with none, it goes at its hold."""
    aggregator.configure(max_batch_size=3, deadline_ms=4000)
    hold = aggregator.hold_ms
    start = redis_ms(aggregator.client)
    high = fill(aggregator, HIGH, 1, now_ms=start)[0]
    low = fill(aggregator, LOW, 3, now_ms=start)[0]  # full
    now = start + round(hold * (1 + HOLD_LATE_FACTOR) / 2)  # past the hold, short of the late one
    assert aggregator.seal(low, lane=LOW, now_ms=now).batch_id == low
    partial_low = fill(aggregator, LOW, 1, tag="partial", now_ms=now)[0]  # no full batch below
    assert aggregator.seal(partial_low, lane=LOW, now_ms=now).batch_id == high
    # Past the late hold, a higher partial batch goes before a lower full one.
    later_high = fill(aggregator, HIGH, 1, tag="later", now_ms=now)[0]
    full_low = fill(aggregator, LOW, 3, tag="full", now_ms=now)[0]
    just_short = now + round(hold * HOLD_LATE_FACTOR) - 1
    assert aggregator.seal(full_low, lane=LOW, now_ms=just_short).batch_id == full_low
    later_low = fill(aggregator, LOW, 3, tag="later", now_ms=now)[0]
    late = now + round(hold * HOLD_LATE_FACTOR)
    assert aggregator.seal(later_low, lane=LOW, now_ms=late).batch_id == later_high


def test_with_nothing_ready_the_largest_open_batch_goes(aggregator: BatchAggregator) -> None:
    high = fill(aggregator, HIGH, 1)[0]
    low = fill(aggregator, LOW, 2)[0]
    assert aggregator.seal(high, lane=HIGH).batch_id == low
    assert aggregator.seal(low, lane=LOW).batch_id == high  # taken over: seals the rest


def test_one_lane_seals_its_closed_batches_first(aggregator: BatchAggregator) -> None:
    first = fill(aggregator, 0, 3)[0]  # closed
    second = fill(aggregator, 0, 1)[0]  # open
    assert aggregator.seal(second).batch_id == first  # the older, full one
    assert aggregator.seal(first).batch_id == second  # first's task, taken over
    assert aggregator.seal(first).sealed_before  # a duplicate: nothing
    third = fill(aggregator, 0, 3)[0]
    assert aggregator.seal(third).batch_id == third


def test_a_task_that_seals_another_batch_hands_its_own_over(
    aggregator: BatchAggregator,
) -> None:
    """The chosen batch's task was never confirmed sent: the task's own batch is due for a
    hand-over in its stead, so that a task still comes for it."""
    low = fill(aggregator, LOW, 1)[0]
    unconfirmed = aggregator.append("lost", 60_000, lane=HIGH)  # its dispatcher died
    for index in range(2):
        aggregator.append(f"x{index}", 60_000, lane=HIGH)
    keys = aggregator.shards[0]
    assert aggregator.seal(low, lane=LOW).batch_id == unconfirmed.batch_id
    assert aggregator.client.zscore(keys.sent, low) is None
    assert aggregator.client.zscore(keys.handover_due, low) is not None
    taken_over = aggregator.seal(unconfirmed.batch_id, lane=HIGH)  # if its task comes after all
    assert taken_over.batch_id == low


def test_admission_of_a_lane_counts_the_lanes_above(aggregator: BatchAggregator) -> None:
    inputs = AdmissionInputs(workers=1, turn_ms=100)
    for index in range(4):  # four full batches of the high lane
        fill(aggregator, HIGH, 3, tag=f"h{index}")
    fill(aggregator, LOW, 1)
    aggregator.refresh_admission(inputs)
    admission_hash = aggregator.client.hgetall(aggregator.shards[0].admission)
    high = float(admission_hash[f"predicted:{HIGH}".encode()])
    low = float(admission_hash[f"predicted:{LOW}".encode()])
    assert high == admission.predicted_ms(4, 1, 100)
    assert low >= high  # the high lane's batches are ahead of it
    # Another process reads the figures afresh (this one admits on what it read last).
    other = BatchAggregator(aggregator.client, aggregator.queue, max_batch_size=3)
    assert other.append("late", int(low) - 1, lane=LOW).rejected
    assert not other.append("patient", int(high) + 1, lane=HIGH).rejected


def test_task_priority_puts_higher_tiers_first() -> None:
    order = [task_priority(lane) for lane in (0, 10, 20, 30, 90, 500)]
    assert order == sorted(order, reverse=True)
    assert order[0] == PRIORITY_STEPS[-1]
    assert order[-1] == PRIORITY_STEPS[0]
    assert task_priority(UNKNOWN_LANE) == PRIORITY_STEPS[0]


def test_a_lower_lane_is_admitted_on_the_turns_the_lanes_above_leave_it(
    aggregator: BatchAggregator,
) -> None:
    inputs = AdmissionInputs(workers=1, turn_ms=100)
    now = redis_ms(aggregator.client)
    aggregator.refresh_admission(inputs, now_ms=now)
    fill(aggregator, LOW, 1, now_ms=now)  # a low request waits in its open batch
    claimed = 12
    for index in range(claimed):  # the high lane claims every turn with a full batch
        own = fill(aggregator, HIGH, 3, tag=f"h{index}", now_ms=now)[0]
        assert aggregator.seal(own, inputs, lane=HIGH, now_ms=now).lane == HIGH
    figures = aggregator.client.hgetall(aggregator.shards[0].admission)
    share = float(figures[f"share:{LOW}".encode()])
    assert share == pytest.approx((1 - SHARE_WEIGHT) ** claimed)
    assert float(figures[f"share:{HIGH}".encode()]) == 1  # every turn was the high lane's
    # One low turn in 1 / share turns, and none yet: the next is an interval away, then its
    # own call after the running one, and one turn to spare.
    interval = 100 / share
    expected = interval + (admission.WORST_CASE_EXTRA_TURNS + 1) * 100
    assert float(figures[f"predicted:{LOW}".encode()]) == pytest.approx(expected)
    assert float(figures[f"predicted:{HIGH}".encode()]) == 0  # no backlog
    other = BatchAggregator(aggregator.client, aggregator.queue, max_batch_size=3)
    assert other.append("too late", int(expected) - 10, lane=LOW).rejected
    assert not other.append("in time", int(expected) + 10, lane=LOW).rejected

    # The high lane stops: with nothing ready, the turns are everyone's again, and the low
    # lane's next turn is one call away.
    def figure(name: str) -> float:
        return float(aggregator.client.hget(aggregator.shards[0].admission, name) or 0)

    while figure(f"share:{LOW}") < 0.9:
        light = fill(aggregator, LOW, 1, tag="light", now_ms=now)[0]
        aggregator.seal(light, inputs, lane=LOW, now_ms=now)
    spare = (admission.WORST_CASE_EXTRA_TURNS + 1) * 100
    assert figure(f"predicted:{LOW}") == pytest.approx(100 / figure(f"share:{LOW}") + spare)
