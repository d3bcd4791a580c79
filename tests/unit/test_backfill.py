"""The backfill lane against a real Redis: seals top their batch up with it, never past the
batch's places nor ahead of its items; a backfill turn takes a waiting batch first, else a
whole batch of backfill; the feeder's side (push, collect, acknowledge, requeue, withdraw),
fenced against a feeder that stalled past its lock."""

from __future__ import annotations

import pytest
import redis

from batching.admission import AdmissionInputs
from batching.aggregator import BatchAggregator
from batching.answers import Answer
from batching.backfill import Backfill, BackfillItem, StaleFeeder, queue_answers
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


def test_two_workers_backfill_turns_are_two_calls_for_admission(
    aggregator: BatchAggregator,
) -> None:
    """Each worker counts its backfill turns from 1: the same turn id from two workers is two
    running calls, each with its own end (batching/lua/seal.lua's record_call)."""
    Backfill(aggregator.client, aggregator.shards).push(_items("job-e", 2 * PLACES))
    same_id = aggregator.shards[0].batch_id("backfill-1")
    for _ in range(2):
        sealed = aggregator.seal(same_id, AdmissionInputs(workers=2, turn_ms=100),
                                 lane=BACKFILL_TURN, places=PLACES)  # fmt: skip
        assert len(sealed.backfill) == PLACES
    assert aggregator.client.zcard(aggregator.shards[0].call_ends) == 2


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


@pytest.mark.parametrize("written", [0, 1])
def test_an_answer_written_in_part_loses_no_line(aggregator: BatchAggregator, written: int) -> None:
    """A worker's answer cut short after `written` of its commands (a pipeline broken off, a
    crash, a failover to a replica that has only them): each line is answered and off the
    taken set, or still taken and so put back in the lane in time; never answered and taken,
    nor neither."""
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
    assert not answered & still_taken
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


def test_a_feeder_that_stalled_past_its_lock_trims_nothing(aggregator: BatchAggregator) -> None:
    """Feeder A read 3 answers and stalled; B (a later holding) read them and 2 more. A's trim
    would drop 3 of the list B is about to trim by 5: B's last 2 would be lost unread."""
    keys = aggregator.shards[0]
    stalled = Backfill(aggregator.client, [keys], generation=1)
    successor = Backfill(aggregator.client, [keys], generation=2)
    answers = [Answer(ItemOutcome.OK, f"text {i}", "stop", 3, 2) for i in range(5)]
    _answer(aggregator, "job-s", answers[:3])
    _, read_by_a = stalled.collect(100)
    _answer(aggregator, "job-s", answers[3:], first=3)
    found, read_by_b = successor.collect(100)
    assert (read_by_a, read_by_b) == ([3], [5])
    with pytest.raises(StaleFeeder):
        stalled.acknowledge(read_by_a)
    successor.acknowledge(read_by_b)
    assert successor.collect(100) == ([], [0])
    assert [d.line for d in found] == [0, 1, 2, 3, 4]
    with pytest.raises(StaleFeeder):  # nor read them again
        stalled.collect(100)


def _answer(aggregator: BatchAggregator, job: str, answers: list[Answer], first: int = 0) -> None:
    """`answers` of a job's lines from `first`, as a worker writes them."""
    keys = aggregator.shards[0]
    lanes = Backfill(aggregator.client, [keys])
    lanes.push([BackfillItem(job, first + i, SampleRequest("p")) for i in range(len(answers))])
    sealed = aggregator.seal(keys.batch_id(f"t{first}"), lane=BACKFILL_TURN, places=len(answers))
    items = [BackfillItem.parse(raw) for raw in sealed.backfill]
    with aggregator.client.pipeline(transaction=False) as pipe:
        queue_answers(pipe, keys, sealed.backfill, items, answers)
        pipe.execute()


def test_withdrawing_a_job_keeps_the_others_in_order(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards[:1])
    mixed = [item for pair in zip(_items("job-h", 3000), _items("job-i", 3000), strict=True)
             for item in pair]  # fmt: skip
    lanes.push(mixed)
    assert lanes.withdraw("job-h") == (3000, 0)
    assert lanes.withdraw("job-h") == (0, 0)
    left = aggregator.client.lrange(aggregator.shards[0].backfill, 0, -1)
    assert [(i.job, i.line) for i in map(BackfillItem.parse, left)] == [
        ("job-i", line) for line in range(3000)
    ]
