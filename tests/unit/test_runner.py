"""The batch runner (the worker's one place for deadlines and errors) on a real Redis."""

from __future__ import annotations

import json
import time

import pytest
import redis
from prometheus_client import generate_latest

from batching.aggregator import BatchAggregator
from batching.backfill import Backfill, BackfillItem
from batching.generation import SampleRequest
from batching.outcomes import ItemOutcome
from batching.policy import Policy
from batching.protocol import BACKFILL_TURN
from telemetry import stats
from tests.support import unique_queue
from tests.support.queue_views import batch_log_of, workers_of
from workers.runner import BatchRunner
from workers.samplers.base import GenerationSettings, PromptRejected, Sampler
from workers.samplers.simulated import SimulatedSampler, expected_completion


class RecordingSampler(Sampler):
    name = "recording"

    def __init__(self, reply: object = None) -> None:
        self.calls: list[list[str]] = []
        self.reply = reply

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        self.calls.append(list(prompts))
        if isinstance(self.reply, Exception):
            raise self.reply
        if callable(self.reply):
            return self.reply(prompts)
        return [p.upper() for p in prompts]


def run(runner: BatchRunner, batch_id: str) -> list[list[str]]:
    """The batch's answers; a batch sealed for the first time always has some."""
    results = runner.run(batch_id)
    assert results is not None
    return results


@pytest.fixture
def aggregator(redis_client: redis.Redis) -> BatchAggregator:
    return BatchAggregator(redis_client, unique_queue("run"), deadline_ms=500)


def test_results_are_aligned_with_items(aggregator: BatchAggregator) -> None:
    sampler = RecordingSampler()
    runner = BatchRunner(aggregator, sampler, "w")
    tickets = [aggregator.append(f"prompt {i}", 500) for i in range(5)]
    results = run(runner, tickets[0].batch_id)
    assert [results[t.index] for t in tickets] == [
        [ItemOutcome.OK, f"PROMPT {i}"] for i in range(5)
    ]
    assert sampler.calls == [[f"prompt {i}" for i in range(5)]]
    record = json.loads(batch_log_of(aggregator).recent(1)[0])
    assert (record["size"], record["ok"], record["expired"], record["worker"]) == (5, 5, 0, "w")


def test_items_that_cannot_meet_their_deadline_never_reach_the_sampler(
    aggregator: BatchAggregator,
) -> None:
    sampler = RecordingSampler()
    runner = BatchRunner(aggregator, sampler, "w")
    runner.estimate_ms = 100  # one call is known to take about 100 ms
    late = aggregator.append("late", 50)  # 50 ms left: one call cannot make it
    on_time = aggregator.append("on time", 5000)
    results = run(runner, late.batch_id)
    assert results[late.index][0] == ItemOutcome.EXPIRED
    assert results[on_time.index] == [ItemOutcome.OK, "ON TIME"]
    assert sampler.calls == [["on time"]]


def test_a_batch_of_only_expired_items_makes_no_call(aggregator: BatchAggregator) -> None:
    sampler = RecordingSampler()
    runner = BatchRunner(aggregator, sampler, "w")
    runner.estimate_ms = 100
    ticket = aggregator.append("late", 0)
    assert run(runner, ticket.batch_id) == [[ItemOutcome.EXPIRED, "deadline could not be met"]]
    assert sampler.calls == []


def test_sampler_exception_marks_every_live_item(aggregator: BatchAggregator) -> None:
    runner = BatchRunner(aggregator, RecordingSampler(RuntimeError("CUDA out of memory")), "w")
    tickets = [aggregator.append(f"p{i}", 5000) for i in range(3)]
    results = run(runner, tickets[0].batch_id)
    assert all(r[0] == ItemOutcome.ERROR and "CUDA out of memory" in r[1] for r in results)


def test_wrong_result_length_is_an_error_not_a_misdelivery(aggregator: BatchAggregator) -> None:
    runner = BatchRunner(aggregator, RecordingSampler(lambda prompts: prompts[:-1]), "w")
    tickets = [aggregator.append(f"p{i}", 5000) for i in range(3)]
    results = run(runner, tickets[0].batch_id)
    assert [r[0] for r in results] == [ItemOutcome.ERROR] * 3
    assert "2 completions for 3 prompts" in results[0][1]


def test_a_rejected_prompt_fails_alone(aggregator: BatchAggregator) -> None:
    def reject_long(prompts: list[str]) -> list[str | PromptRejected]:
        return [PromptRejected("too long") if len(p) > 5 else p for p in prompts]

    runner = BatchRunner(aggregator, RecordingSampler(reject_long), "w")
    short = aggregator.append("short", 5000)
    long = aggregator.append("much too long", 5000)
    results = run(runner, short.batch_id)
    assert results[short.index] == [ItemOutcome.OK, "short"]
    assert results[long.index] == [ItemOutcome.PROMPT_REJECTED, "too long"]


def test_estimate_follows_measured_calls(aggregator: BatchAggregator) -> None:
    runner = BatchRunner(aggregator, SimulatedSampler(batch_ms=30), "w")
    runner.warm_up()
    assert 25 <= runner.estimate_ms < 80
    assert batch_log_of(aggregator).published_turn_ms() == round(runner.estimate_ms)
    ticket = aggregator.append("E equals ", 5000)
    assert run(runner, ticket.batch_id) == [[ItemOutcome.OK, expected_completion("E equals ")]]
    assert runner.batches == 1
    assert runner.busy_s > 0.02
    # Admission reads a batch's whole turn (seal, call, record), at least the call itself; it
    # reaches the shard's admission inputs with the next seal (operators' published figure
    # follows with the heartbeat).
    assert runner.turn_ms >= runner.estimate_ms * 0.9
    turn_ms = runner.turn_ms
    again = aggregator.append("E equals ", 5000)
    run(runner, again.batch_id)
    inputs = aggregator.client.hget(aggregator.shards[0].admission, "turn_ms")
    assert inputs is not None
    assert int(inputs) == round(turn_ms)


def test_the_live_policy_reaches_the_sampler_between_calls(aggregator: BatchAggregator) -> None:
    sampler = RecordingSampler()
    live = {"policy": Policy(max_batch_size=100, max_new_tokens=32, version=1)}
    runner = BatchRunner(aggregator, sampler, "w", policy=lambda: live["policy"])
    ticket = aggregator.append("a", 500)
    runner.run(ticket.batch_id)
    assert sampler.generation.max_new_tokens == 32
    live["policy"] = Policy(max_batch_size=100, max_new_tokens=7, stop="\n", version=2)
    ticket = aggregator.append("b", 500)
    runner.run(ticket.batch_id)
    assert sampler.generation == GenerationSettings(max_new_tokens=7, stop="\n")
    assert runner.applied_version == 2


class ShortContextSampler(RecordingSampler):
    """Refuses more than 100 new tokens, as a model refuses a policy past its context."""

    def configure(self, generation: GenerationSettings) -> None:
        if generation.max_new_tokens > 100:
            raise ValueError("no room for a prompt")
        super().configure(generation)


def test_a_policy_the_sampler_refuses_is_not_applied_in_part_nor_reported(
    aggregator: BatchAggregator,
) -> None:
    sampler = ShortContextSampler()
    live = {"policy": Policy(max_batch_size=100, max_new_tokens=32, version=1)}
    runner = BatchRunner(aggregator, sampler, "w", policy=lambda: live["policy"])
    assert runner.apply_policy().version == 1
    live["policy"] = Policy(max_batch_size=5, max_new_tokens=500, version=2)
    kept = runner.apply_policy()
    assert (kept.version, kept.max_batch_size) == (1, 100)  # the old one, whole
    assert (runner.applied_version, runner.refused_version) == (1, 2)
    assert runner.refused_reason == "no room for a prompt"
    assert (sampler.generation.max_new_tokens, aggregator.max_batch_size) == (32, 100)
    ticket = aggregator.append("a", 500)
    runner.run(ticket.batch_id)
    record = json.loads(batch_log_of(aggregator).recent(1)[0])
    assert record["policy_version"] == 1
    live["policy"] = Policy(max_batch_size=5, max_new_tokens=50, version=3)
    assert runner.apply_policy().version == 3
    assert (runner.applied_version, runner.refused_version, runner.refused_reason) == (3, None, "")
    assert aggregator.max_batch_size == 5


def test_a_batch_opened_under_a_larger_max_runs_in_calls_of_the_new_max(
    aggregator: BatchAggregator,
) -> None:
    sampler = RecordingSampler()
    tickets = [aggregator.append(f"p{i}", 500) for i in range(12)]  # max 100 then
    runner = BatchRunner(aggregator, sampler, "w", policy=lambda: Policy(max_batch_size=5))
    results = run(runner, tickets[0].batch_id)
    assert [len(call) for call in sampler.calls] == [5, 5, 2]
    assert results == [[ItemOutcome.OK, f"P{i}"] for i in range(12)]
    record = json.loads(batch_log_of(aggregator).recent(1)[0])
    assert (record["size"], record["max_batch_size"]) == (12, 5)


def test_a_batch_is_counted_in_the_statistics_and_metrics(aggregator: BatchAggregator) -> None:
    runner = BatchRunner(aggregator, SimulatedSampler(batch_ms=5), "w")
    runner.estimate_ms = 100
    live = aggregator.append("x", 500)
    aggregator.append("y", 10)  # cannot be met by a 100 ms call
    runner.run(live.batch_id)
    now = int(time.time())
    buckets = stats.read_buckets(
        aggregator.client, aggregator.queue, stats.SECOND, now - 2, now + 1
    )
    counts = stats.merge(c for _, c in buckets)
    assert (counts["batches"], counts["items"], counts["expired"], counts["calls"]) == (1, 2, 1, 1)
    assert counts["w:w:batches"] == 1
    assert counts["capacity"] == 100
    text = generate_latest(runner.metrics.registry).decode()
    assert 'sampling_expired_items_total{worker="w"} 1.0' in text
    assert 'sampling_batch_size_sum{worker="w"} 2.0' in text


def test_a_duplicate_task_of_a_sealed_batch_answers_nothing(aggregator: BatchAggregator) -> None:
    """A hand-over can send a batch's task twice; the second must not store an empty result
    over the first's answers."""
    sampler = RecordingSampler()
    runner = BatchRunner(aggregator, sampler, "w")
    ticket = aggregator.append("p", 5000)
    assert run(runner, ticket.batch_id) == [[ItemOutcome.OK, "P"]]
    assert runner.run(ticket.batch_id) is None
    assert sampler.calls == [["p"]]
    assert runner.batches == 1


def test_each_item_gets_its_own_result(aggregator: BatchAggregator) -> None:
    runner = BatchRunner(aggregator, RecordingSampler(), "w")
    runner.estimate_ms = 100
    tickets = [aggregator.append("late", 10), aggregator.append("a", 5000)]
    results = run(runner, tickets[0].batch_id)
    assert results is not None
    assert results[0] is not results[1]
    assert [r[0] for r in results] == [ItemOutcome.EXPIRED, ItemOutcome.OK]


def test_a_worker_that_cannot_say_goodbye_says_why(
    aggregator: BatchAggregator, caplog: pytest.LogCaptureFixture
) -> None:
    from workers.heartbeat import say_goodbye

    workers_of(aggregator).heartbeat("w")
    runner = BatchRunner(aggregator, RecordingSampler(), "w")
    say_goodbye(runner)
    assert workers_of(aggregator).live_count() == 0
    dead = BatchAggregator(redis.Redis(port=1, socket_connect_timeout=0.2), aggregator.queue)
    with caplog.at_level("WARNING", logger="workers.lifecycle"):
        say_goodbye(BatchRunner(dead, RecordingSampler(), "w"))
    assert any("leaves without saying so" in r.getMessage() for r in caplog.records)


def test_backfill_rides_in_the_places_left_and_answers_to_the_feeder(
    aggregator: BatchAggregator,
) -> None:
    """The batch's own items answer its members as ever; the backfill items its seal took
    share the call, and their answers go to the lane's done list, not to the batch."""
    sampler = RecordingSampler()
    runner = BatchRunner(aggregator, sampler, "w")
    lanes = Backfill(aggregator.client, aggregator.shards)
    lanes.push(BackfillItem("job", line, SampleRequest(prompt=f"offline {line}"))
               for line in range(150))  # fmt: skip
    runner.backfill_left[aggregator.shards[0].tag] = 150  # as a heartbeat would tell it
    tickets = [aggregator.append(f"asked {i}", 500) for i in range(10)]
    results = run(runner, tickets[0].batch_id)
    assert results == [[ItemOutcome.OK, f"ASKED {i}"] for i in range(10)]
    assert sampler.calls == [[f"asked {i}" for i in range(10)]
                             + [f"offline {line}" for line in range(90)]]  # fmt: skip
    record = json.loads(batch_log_of(aggregator).recent(1)[0])
    assert (record["size"], record["backfill"]) == (10, 90)
    found, _ = lanes.collect(1000)
    assert [(d.line, d.answer.text) for d in found] == [(n, f"OFFLINE {n}") for n in range(90)]
    assert lanes.depth() == (60, 0)
    assert runner.backfill_left[aggregator.shards[0].tag] == 60

    # With no batch waiting, a backfill turn runs the rest alone: no answers to publish.
    turn = runner.begin(aggregator.shards[0].batch_id("backfill-1"), BACKFILL_TURN)
    assert turn is not None
    assert not turn.interactive
    runner.sample(turn)
    runner.finish(turn)
    assert turn.answers == []
    assert lanes.depth() == (0, 0)
    assert len(lanes.collect(1000)[0]) == 150
