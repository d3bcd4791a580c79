"""The backfill lane against a real Redis: seals top their batch up with it, never past the
batch's places nor ahead of its items; a backfill turn takes a waiting batch first, else a
whole batch of backfill; the feeder's side (push, collect, acknowledge, requeue, withdraw)."""

from __future__ import annotations

import pytest
import redis

from batching.aggregator import BatchAggregator
from batching.answers import Answer
from batching.backfill import Backfill, BackfillItem, queue_answers
from batching.generation import SampleRequest
from batching.outcomes import ItemOutcome
from batching.protocol import BACKFILL_TURN
from tests.support import unique_queue

PLACES = 100


@pytest.fixture
def aggregator(redis_client: redis.Redis) -> BatchAggregator:
    return BatchAggregator(redis_client, unique_queue("bf"), max_batch_size=PLACES)


def _items(job: str, count: int) -> list[BackfillItem]:
    return [BackfillItem(job, line, SampleRequest(prompt=f"{job} {line}")) for line in range(count)]


def test_a_seal_fills_only_the_places_its_batch_left(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-a", 250))
    tickets = [aggregator.append(f"asked {i}", 500) for i in range(30)]
    sealed = aggregator.seal(tickets[0].batch_id, places=PLACES)
    assert [item.prompt for item in sealed.items] == [f"asked {i}" for i in range(30)]
    taken = [BackfillItem.parse(raw) for raw in sealed.backfill]
    assert [(item.job, item.line) for item in taken] == [("job-a", line) for line in range(70)]
    assert sealed.backfill_left == 180
    assert lanes.depth() == (180, 70)


def test_a_seal_without_places_takes_no_backfill(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-b", 10))
    ticket = aggregator.append("alone", 500)
    sealed = aggregator.seal(ticket.batch_id)
    assert (len(sealed.items), sealed.backfill) == (1, [])
    assert lanes.depth() == (10, 0)


def test_a_backfill_turn_takes_a_waiting_batch_first(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-c", 300))
    turn = aggregator.shards[0].batch_id("backfill-1")
    ticket = aggregator.append("waiting", 500)
    sealed = aggregator.seal(turn, lane=BACKFILL_TURN, places=PLACES)
    assert sealed.batch_id == ticket.batch_id  # the waiting batch, topped up
    assert (len(sealed.items), len(sealed.backfill)) == (1, PLACES - 1)
    alone = aggregator.seal(aggregator.shards[0].batch_id("backfill-2"), lane=BACKFILL_TURN,
                            places=PLACES)  # fmt: skip
    assert (alone.batch_id, alone.items, len(alone.backfill)) == ("", [], PLACES)
    assert not alone.sealed_before
    # The batch's own task comes later: it was sealed, so it runs nothing.
    late = aggregator.seal(ticket.batch_id, places=PLACES)
    assert late.sealed_before


def test_answers_leave_the_taken_set_for_the_feeder(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-d", 5))
    sealed = aggregator.seal(aggregator.shards[0].batch_id("t"), lane=BACKFILL_TURN, places=3)
    items = [BackfillItem.parse(raw) for raw in sealed.backfill]
    answers = [Answer(ItemOutcome.OK, f"text {i}", "stop", 3, 2) for i in range(3)]
    with aggregator.client.pipeline() as pipe:
        queue_answers(pipe, aggregator.shards[0], sealed.backfill, items, answers)
        pipe.execute()
    assert lanes.depth() == (2, 0)
    found, read = lanes.collect(100)
    assert [(d.job, d.line, d.answer) for d in found] == [
        ("job-d", i, answers[i]) for i in range(3)
    ]
    assert lanes.collect(100)[0] == found  # still there until acknowledged
    lanes.acknowledge(read)
    assert lanes.collect(100) == ([], [0])


@pytest.mark.parametrize("written", [0, 1, 2])
def test_an_answer_written_in_part_loses_no_line(aggregator: BatchAggregator, written: int) -> None:
    """A worker's answer cut short after `written` of its commands (a pipeline broken off, a
    crash, a failover to a replica that has only them): each line is answered, or still taken
    and so put back in the lane in time."""
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-p", 3))
    keys = aggregator.shards[0]
    sealed = aggregator.seal(keys.batch_id("t"), lane=BACKFILL_TURN, places=3)
    items = [BackfillItem.parse(raw) for raw in sealed.backfill]
    answers = [Answer(ItemOutcome.OK, f"text {i}", "stop", 3, 2) for i in range(3)]
    with aggregator.client.pipeline(transaction=False) as pipe:
        queue_answers(pipe, keys, sealed.backfill, items, answers)
        pipe.command_stack = pipe.command_stack[:written]
        pipe.execute()
    answered = {done.line for done in lanes.collect(100)[0]}
    still_taken = {BackfillItem.parse(raw).line
                   for raw in aggregator.client.zrange(keys.backfill_taken, 0, -1)}  # fmt: skip
    assert answered | still_taken == {0, 1, 2}
    if still_taken:
        assert lanes.requeue_stale(sealed.now_ms + 1001, timeout_ms=1000) == len(still_taken)


def test_items_taken_too_long_ago_go_back_first(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-e", 4))
    sealed = aggregator.seal(aggregator.shards[0].batch_id("t"), lane=BACKFILL_TURN, places=2)
    assert lanes.requeue_stale(sealed.now_ms, timeout_ms=1000) == 0
    assert lanes.requeue_stale(sealed.now_ms + 1001, timeout_ms=1000) == 2
    assert lanes.depth() == (4, 0)
    again = aggregator.seal(aggregator.shards[0].batch_id("u"), lane=BACKFILL_TURN, places=4)
    assert sorted(BackfillItem.parse(raw).line for raw in again.backfill) == [0, 1, 2, 3]


def test_a_withdrawn_job_leaves_the_others(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(_items("job-f", 3) + _items("job-g", 3))
    aggregator.seal(aggregator.shards[0].batch_id("t"), lane=BACKFILL_TURN, places=1)  # f 0
    assert lanes.withdraw("job-f") == (2, 1)
    remaining = aggregator.seal(aggregator.shards[0].batch_id("u"), lane=BACKFILL_TURN,
                                places=10)  # fmt: skip
    assert [BackfillItem.parse(raw).job for raw in remaining.backfill] == ["job-g"] * 3
