"""A seal's top-up on a GPU whose call grows with its shape (batching.call_cost): the worker
keeps the backfill lines that leave the interactive call within its bound and gives the others
back to the lane; what it learns of the queue's calls leaves the backfill out."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import redis

from batching.aggregator import BatchAggregator
from batching.backfill import Backfill, BackfillItem
from batching.call_cost import Shape, load_profile
from batching.generation import SampleRequest
from batching.outcomes import ItemOutcome
from batching.protocol import BACKFILL_TURN
from telemetry import stats
from tests.support import unique_queue
from workers.call_costs import CallCosts
from workers.runner import BatchRunner
from workers.samplers.simulated import SimulatedSampler

H100 = load_profile("h100-graphs-135m", 100)


@pytest.fixture
def aggregator(redis_client: redis.Redis) -> BatchAggregator:
    return BatchAggregator(redis_client, unique_queue("bfc"), max_batch_size=100)


def lines(job: str, count: int, max_tokens: int) -> list[BackfillItem]:
    return [BackfillItem(job, line, SampleRequest(prompt=f"{job} line {line}",
                                                  max_tokens=max_tokens))
            for line in range(count)]  # fmt: skip


def runner_on(aggregator: BatchAggregator, profile: object = H100) -> BatchRunner:
    sampler = SimulatedSampler(batch_ms=20, cost=profile)  # type: ignore[arg-type]
    runner = BatchRunner(aggregator, sampler, "w")
    runner.estimate_ms = 20.0
    runner.backfill_left[aggregator.shards[0].tag] = 1  # the lane is known to hold lines
    return runner


def requests(aggregator: BatchAggregator, count: int, max_tokens: int = 0) -> str:
    """`count` requests joined: /sample's (the queue's 32 new tokens), or API requests of
    `max_tokens`."""
    asked = [SampleRequest(prompt=f"asked {i}", max_tokens=max_tokens) if max_tokens
             else f"asked {i}" for i in range(count)]  # fmt: skip
    tickets = [aggregator.append(prompt, 5000) for prompt in asked]
    return tickets[0].batch_id


def test_a_top_up_fills_the_graph_bucket_s_padding_and_no_more(
    aggregator: BatchAggregator,
) -> None:
    """10 requests run in the 16-row bucket: 6 lines more cost nothing; a 17th row would take
    the 32-row bucket, far past 5% more. The seal takes no more than those 6."""
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(lines("job-a", 30, max_tokens=8))
    runner = runner_on(aggregator)
    turn = runner.begin(requests(aggregator, 10))
    assert turn is not None
    assert [(item.job, item.line) for item in turn.backfill] == [("job-a", n) for n in range(6)]
    assert lanes.depth() == (24, 6)
    runner.sample(turn)
    runner.finish(turn)
    assert lanes.depth() == (24, 0)  # the 6 answered
    shape = runner.costs.shape(runner._rows_of(turn.items))
    alone = runner.costs.shape(runner._rows_of(turn.sealed.items))
    assert H100.call_ms(shape) <= 1.05 * H100.call_ms(alone)
    assert H100.bucket(shape.rows) == H100.bucket(alone.rows) == 16


def test_lines_asking_more_tokens_than_the_call_s_rows_wait_and_pause_top_ups(
    aggregator: BatchAggregator,
) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(lines("job-long", 20, max_tokens=32))
    runner = runner_on(aggregator)
    turn = runner.begin(requests(aggregator, 10, max_tokens=4))
    assert turn is not None
    assert turn.backfill == []
    runner.sample(turn)
    runner.finish(turn)
    assert lanes.depth() == (20, 0)  # every line back, none lost, none left taken
    tag = aggregator.shards[0].tag
    assert runner.backfill_paused_until[tag] > time.monotonic()
    again = runner.begin(requests(aggregator, 5, max_tokens=4))  # paused: no places offered
    assert again is not None
    assert (again.backfill, lanes.depth()) == ([], (20, 0))
    # A GPU that would be idle takes them whole, whatever their shape, once no request came
    # for a while (before, no more rows than a call of requests costs).
    runner.backfill_paused_until.clear()
    runner.costs.scale = 1.0
    runner.estimate_ms = H100.call_ms(Shape(16, 3, 32))  # the queue's 32 new tokens
    sized = runner.begin(aggregator.shards[0].batch_id("sized"), lane=BACKFILL_TURN)
    assert sized is not None
    assert len(sized.backfill) == 16
    runner.sample(sized)
    runner.finish(sized)
    runner.requests_seen_at = float("-inf")
    idle = runner.begin(aggregator.shards[0].batch_id("idle"), lane=BACKFILL_TURN)
    assert idle is not None
    assert len(idle.backfill) == 4


def test_the_sizes_a_seal_tops_up_to_are_the_buckets_a_margin_keeps() -> None:
    costs = runner_costs()
    buckets = list(costs.profile.graph_buckets)
    assert costs.top_up_sizes(100, 16) == buckets  # no margin: each bucket's own rows
    costs.backfill_extra_cost_pct = 25.0

    def bucket_ms(rows: int) -> float:
        return costs.profile.call_ms(Shape(rows, 0, 16))

    # With 25%: each bucket tops up to the largest bucket costing at most 25% more than it.
    expected = sorted({max(b for b in buckets if bucket_ms(b) <= 1.25 * bucket_ms(a))
                       for a in buckets})  # fmt: skip
    assert costs.top_up_sizes(100, 16) == expected
    assert len(expected) < len(buckets)  # the margin merges some: the test says something
    costs.profile = load_profile("contract", 20)
    assert costs.top_up_sizes(100, 16) == [100]


def runner_costs() -> CallCosts:
    return CallCosts(SimulatedSampler(cost=H100))


def test_under_the_contract_every_place_is_topped_up(aggregator: BatchAggregator) -> None:
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(lines("job-c", 150, max_tokens=256))
    runner = runner_on(aggregator, load_profile("contract", 20))
    turn = runner.begin(requests(aggregator, 10))
    assert turn is not None
    assert len(turn.backfill) == 90


def test_what_the_worker_learns_of_a_call_leaves_the_backfill_out(
    aggregator: BatchAggregator,
) -> None:
    """A backfill turn changes neither estimate; a topped-up call teaches the interactive
    share of its time."""
    lanes = Backfill(aggregator.client, aggregator.shards)
    runner = runner_on(aggregator)
    lanes.push(lines("job-d", 100, max_tokens=32))
    idle = runner.begin(aggregator.shards[0].batch_id("idle"), lane=BACKFILL_TURN)
    assert idle is not None
    runner.sample(idle)
    runner.finish(idle)
    assert (runner.estimate_ms, runner.turn_ms, runner.costs.scale) == (20.0, 0.0, 1.0)
    lanes.push(lines("job-e", 10, max_tokens=32))
    runner.backfill_left[aggregator.shards[0].tag] = 10  # as the heartbeat would see it
    turn = runner.begin(requests(aggregator, 10))
    assert turn is not None
    assert len(turn.backfill) == 6
    runner.sample(turn)
    runner.finish(turn)
    alone = H100.call_ms(runner.costs.shape(runner._rows_of(turn.sealed.items)))
    whole = H100.call_ms(runner.costs.shape(runner._rows_of(turn.items)))
    assert turn.backfill_extra_ms == pytest.approx(turn.sampler_ms * (1 - alone / whole))
    learned = 20.0 + 0.3 * (turn.sampler_ms * alone / whole - 20.0)
    assert runner.estimate_ms == pytest.approx(learned)


def test_the_mean_call_leaves_backfill_only_calls_out() -> None:
    counts = stats.batch_counts(worker="w", size=10, expired=0, queue_wait_ms=None,
                                sampler_ms=100.0, calls=1, max_batch_size=100)  # fmt: skip
    summed = Counter(counts) + Counter(stats.busy_counts("w", 900.0)) + Counter(alive=2)
    summary = stats.Summary(summed, 60.0)
    assert summary.mean_sampler_ms() == pytest.approx(100.0)
    assert summary.busy_percent() == pytest.approx(50.0)
    assert summary.backfill_busy_percent() == pytest.approx(45.0)
    assert H100.call_ms(Shape(16, 10, 32)) < H100.call_ms(Shape(17, 10, 32))


def test_a_stream_whose_client_left_during_its_call_is_answered_cancelled(
    aggregator: BatchAggregator,
) -> None:
    """Its row stopped at the client's leaving: its answer is cut, so none is given (nor
    cached); the other stream's is whole."""
    runner = BatchRunner(aggregator, SimulatedSampler(extra_words=40, cost=H100), "w")
    asked = [SampleRequest(prompt=f"stream {i}", max_tokens=16) for i in range(2)]
    tickets = [aggregator.append(request, 5000, stream=True) for request in asked]
    turn = runner.begin(tickets[0].batch_id)
    assert turn is not None
    keys = aggregator.shard_of(tickets[0].batch_id)
    aggregator.client.sadd(keys.cancelled(tickets[0].batch_id), tickets[0].index)  # mid-call
    runner.sample(turn)
    outcomes = [turn.results[ticket.index].outcome for ticket in tickets]
    assert outcomes == [ItemOutcome.CANCELLED, ItemOutcome.OK]
