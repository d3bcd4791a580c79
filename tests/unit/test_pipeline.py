"""The worker's batch pipeline (GPU, reporter and watchdog threads) on a real Redis.

Celery's side is played by the test: it calls `submit` as the run_batch task does, one batch
at a time. The answers leave through a `queue_answers` that queues an RPUSH of them on the
pipeline it is given, so the test reads what was published, in order, from Redis.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from prometheus_client import generate_latest

from batching.aggregator import HELD_SUFFIX, BatchAggregator
from batching.backfill import Backfill, BackfillItem
from batching.generation import SampleRequest
from batching.outcomes import ItemOutcome
from tests.support import unique_queue
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until
from workers.pipeline import BatchPipeline
from workers.runner import BatchRunner
from workers.samplers.base import PromptRejected, Sampler
from workers.turns import Result


class TimedSampler(Sampler):
    """Sleeps `call_s` a call and notes when each call started and ended; a prompt "hang"
    blocks until the test releases it (a hung GPU call)."""

    name = "timed"

    def __init__(self, call_s: float) -> None:
        self.call_s = call_s
        self.calls: list[tuple[list[str], float, float | None]] = []
        self.release = threading.Event()

    def sample(self, prompts: list[str]) -> list[str | PromptRejected]:
        started = time.monotonic()
        self.calls.append((list(prompts), started, None))
        if "hang" in prompts:
            self.release.wait()  # duration: a hung call, until the test releases it
        time.sleep(self.call_s)  # duration: the call's
        self.calls[-1] = (list(prompts), started, time.monotonic())
        return [prompt.upper() for prompt in prompts]

    @property
    def running(self) -> bool:
        return bool(self.calls) and self.calls[-1][2] is None


class Harness:
    def __init__(self, client: redis.Redis, call_s: float = 0.05, **options: Any) -> None:
        self.client = client
        self.aggregator = BatchAggregator(client, unique_queue("pipe"), deadline_ms=5000)
        self.sampler = TimedSampler(call_s)
        self.runner = BatchRunner(self.aggregator, self.sampler, "w")
        self.runner.estimate_ms = call_s * 1000
        self.published_key = f"test:{{{self.aggregator.queue}}}:published"
        self.failures: list[tuple[str, Exception]] = []
        self.resent: list[str] = []
        self.hung_calls: list[tuple[str, float]] = []
        self.unhealthy_reasons: list[str] = []
        self.pipeline = BatchPipeline(self.runner, self, **options).start()

    def queue_answers(
        self, pipe: redis.client.Pipeline, batch_id: str, answers: list[Result]
    ) -> None:
        pipe.rpush(self.published_key, json.dumps([batch_id, answers]))

    # The rest of the pipeline's sink (workers.pipeline.BatchSink), recorded.

    def store_failure(self, batch_id: str, exc: Exception) -> None:
        self.failures.append((batch_id, exc))

    def resend(self, batch_id: str) -> None:
        self.resent.append(batch_id)

    def hung(self, batch_id: str, ran_ms: float) -> None:
        self.hung_calls.append((batch_id, ran_ms))

    def unhealthy(self, reason: str) -> None:
        self.unhealthy_reasons.append(reason)

    def batch(self, *prompts: str) -> str:
        tickets = [self.aggregator.append(prompt, 5000) for prompt in prompts]
        assert len({t.batch_id for t in tickets}) == 1
        return tickets[0].batch_id

    def next_batch(self, *prompts: str) -> str:
        """A batch of its own: close the open one to newcomers first."""
        open_batch = self.aggregator.open_batch_id()
        if open_batch:
            self.aggregator.close(open_batch)
        return self.batch(*prompts)

    def published(self, count: int, timeout_s: float = 5.0) -> list[tuple[str, list[Result]]]:
        """What was published, once `count` batches were (or `timeout_s` passed)."""
        if timeout_s:
            with contextlib.suppress(AssertionError):  # the caller's assert says what is wrong
                wait_until(lambda: self.client.llen(self.published_key) >= count, timeout_s)
        return [tuple(json.loads(raw)) for raw in self.client.lrange(self.published_key, 0, -1)]


MakeHarness = Callable[..., Harness]


@pytest.fixture
def harness(redis_client: redis.Redis) -> Iterator[MakeHarness]:
    made: list[Harness] = []

    def make(**options: Any) -> Harness:
        made.append(Harness(redis_client, **options))
        return made[-1]

    yield make
    for each in made:
        each.sampler.release.set()
        each.pipeline.close(timeout_s=5)


def test_every_batch_is_answered_in_order_and_recorded(harness: MakeHarness) -> None:
    h = harness()
    batches = [h.next_batch(f"a{i}", f"b{i}") for i in range(3)]
    for batch_id in batches:
        h.pipeline.submit(batch_id)
    published = h.published(3)
    assert published == [
        (batch_id, [[ItemOutcome.OK, f"A{i}"], [ItemOutcome.OK, f"B{i}"]])
        for i, batch_id in enumerate(batches)
    ]
    wait_until(lambda: len(batch_log_of(h.aggregator).recent()) >= 3, 5, "3 batch records")
    records = [json.loads(raw) for raw in batch_log_of(h.aggregator).recent()]
    assert sorted(r["batch_id"] for r in records) == sorted(batches)


def test_celery_gets_control_back_before_the_call_ends(harness: MakeHarness) -> None:
    # A lead longer than the default so that a slow CI runner cannot blur the order.
    h = harness(call_s=0.6, prefetch_lead_ms=200)
    batch_id = h.batch("slow")
    started = time.monotonic()
    h.pipeline.submit(batch_id)
    returned = time.monotonic()
    # Back near the end of the call, while the call still runs: Celery fetches the next task
    # while the GPU is busy, and not long before it is free.
    assert h.sampler.running
    assert returned - started >= 0.6 - 0.2 - 0.05


def test_a_batch_received_while_the_gpu_is_busy_is_held_then_sealed(harness: MakeHarness) -> None:
    h = harness(call_s=0.6, prefetch_lead_ms=200)
    first = h.batch("first")
    h.pipeline.submit(first)
    assert h.sampler.running
    second = h.next_batch("second")
    submitted = threading.Thread(target=h.pipeline.submit, args=(second,))
    submitted.start()
    wait_until(  # due for a hand-over if this worker died before the seal
        lambda: h.client.zscore(h.aggregator.shards[0].handover_due, second + HELD_SUFFIX),
        1,
        "the batch held",
    )  # due for a hand-over if this worker died before the seal
    submitted.join(5)
    assert [batch for batch, _ in h.published(2)] == [first, second]
    # Sealed by this worker: no longer due for a hand-over.
    assert h.client.zscore(h.aggregator.shards[0].handover_due, second + HELD_SUFFIX) is None


def test_a_batch_with_nothing_left_to_sample_is_answered_without_a_call(
    harness: MakeHarness,
) -> None:
    h = harness()
    ticket = h.aggregator.append("too late", 1)  # due in 1 ms: expired by the seal
    time.sleep(0.01)  # duration: past the item's deadline
    h.pipeline.submit(ticket.batch_id)
    assert h.published(1) == [
        (ticket.batch_id, [[ItemOutcome.EXPIRED, "deadline could not be met"]])
    ]
    assert h.sampler.calls == []


def test_the_same_task_twice_runs_the_batch_once(harness: MakeHarness) -> None:
    h = harness()
    batch_id = h.batch("once")
    h.pipeline.submit(batch_id)
    h.pipeline.submit(batch_id)  # a hand-over's duplicate: nothing to run, and no wait
    after = h.next_batch("after")
    h.pipeline.submit(after)
    assert [batch for batch, _ in h.published(2)] == [batch_id, after]
    assert [prompts for prompts, _, _ in h.sampler.calls] == [["once"], ["after"]]


def test_a_hung_call_is_cut_off_answered_and_its_waiting_batch_sent_again(
    harness: MakeHarness,
) -> None:
    h = harness(call_timeout_ms=300)
    hung = h.batch("hang", "bystander")
    started = time.monotonic()
    h.pipeline.submit(hung)
    waiting = h.next_batch("next")
    threading.Thread(target=h.pipeline.submit, args=(waiting,), daemon=True).start()
    wait_until(lambda: h.hung_calls, 3, "the call cut off")
    assert [batch for batch, _ in h.hung_calls] == [hung]
    assert h.hung_calls[0][1] >= 300
    assert time.monotonic() - started < 2  # cut off, not waited for
    ((batch_id, answers),) = h.published(1)
    assert batch_id == hung
    assert [outcome for outcome, _ in answers] == [ItemOutcome.ERROR, ItemOutcome.ERROR]
    assert "timed out after" in answers[0][1]
    assert h.resent == [waiting]  # received, never sealed: another worker runs it


def test_the_automatic_call_timeout_follows_the_estimate(harness: MakeHarness) -> None:
    h = harness()
    h.runner.estimate_ms = 100
    assert h.pipeline.call_timeout_ms() == 2000  # at least 2 s
    h.runner.estimate_ms = 900
    assert h.pipeline.call_timeout_ms() == 9000  # 10 calls


def test_close_finishes_the_running_call_and_publishes_it(harness: MakeHarness) -> None:
    h = harness(call_s=0.2)
    batch_id = h.batch("last")
    h.pipeline.submit(batch_id)
    h.pipeline.close(timeout_s=5)
    assert [batch for batch, _ in h.published(1, timeout_s=0)] == [batch_id]
    with pytest.raises(RuntimeError, match="closed"):
        h.pipeline.submit(h.next_batch("too late"))


def test_a_failing_record_does_not_keep_the_answers(harness: MakeHarness) -> None:
    """The reporter sends a batch's answers and its record in one round trip: a record that
    cannot be made (a bug) must not cost the batch's requests their answers."""
    h = harness()

    def broken_record(turn: object, pipe: object) -> None:
        raise ValueError("a record that cannot be made")

    h.runner._record = broken_record  # type: ignore[method-assign]
    first, second = h.next_batch("p1"), h.next_batch("p2")
    h.pipeline.submit(first)
    h.pipeline.submit(second)  # the reporter publishes the first while the GPU runs this one
    assert h.published(2) == [
        (first, [[ItemOutcome.OK, "P1"]]),
        (second, [[ItemOutcome.OK, "P2"]]),
    ]


def test_a_batch_that_cannot_be_sealed_is_answered_logged_and_counted_once(
    harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """The one failure path: the batch's waiters get its failure (a 502), the log its
    traceback, the metrics a count by stage; the GPU thread goes on with the next batch."""
    h = harness()
    begin = h.runner.begin

    def lost_mid_seal(batch_id: str, lane: int) -> object:
        raise redis.ConnectionError("Redis lost mid-seal")

    h.runner.begin = lost_mid_seal  # type: ignore[assignment,method-assign]
    failed = h.next_batch("lost")
    with caplog.at_level("ERROR", logger="workers.pipeline"):
        h.pipeline.submit(failed)
        wait_until(lambda: h.failures, 5, "the failure stored")
    assert [(batch_id, str(exc)) for batch_id, exc in h.failures] == [
        (failed, "Redis lost mid-seal")
    ]
    assert [r.getMessage() for r in caplog.records] == [f"batch {failed} failed (seal)"]
    text = generate_latest(h.runner.metrics.registry).decode()
    assert 'sampling_batch_failures_total{stage="seal",worker="w"} 1.0' in text
    h.runner.begin = begin  # type: ignore[method-assign]
    h.pipeline.submit(h.next_batch("after"))  # its seal takes the oldest batch first
    ((_, answers),) = h.published(1)
    assert answers == [[ItemOutcome.OK, "LOST"]]


def test_an_idle_gpu_runs_backfill_and_a_batch_waits_at_most_one_call(
    harness: MakeHarness,
) -> None:
    """Offline jobs' items run in whole batches while no task comes; a batch that comes
    meanwhile waits for the running call only, and its members' answers publish as ever."""
    h = harness(call_s=0.05)
    lanes = Backfill(h.client, h.aggregator.shards)
    lanes.push(BackfillItem("job", line, SampleRequest(prompt=f"offline {line}"))
               for line in range(1000))  # fmt: skip
    h.runner.backfill_left[h.aggregator.shards[0].tag] = 1000  # as a heartbeat tells it
    wait_until(lambda: len(h.sampler.calls) >= 2, 5, "backfill calls")
    batch_id = h.next_batch("asked")
    calls_before = len(h.sampler.calls)  # the last of them may be running
    h.pipeline.submit(batch_id)
    assert h.published(1)[0] == (batch_id, [[ItemOutcome.OK, "ASKED"]])
    with_it = [i for i, (prompts, _, _) in enumerate(h.sampler.calls) if "asked" in prompts]
    # In the call after the one running when it came (one more if a call started between
    # the count and the submit), topped up with backfill.
    assert len(with_it) == 1
    assert with_it[0] <= calls_before + 1
    assert len(h.sampler.calls[with_it[0]][0]) == 100
    wait_until(lambda: lanes.depth() == (0, 0), 10, "the lane emptied")
    found, _ = lanes.collect(2000)
    assert sorted(done.line for done in found) == list(range(1000))  # each once
    assert all(len(prompts) <= 100 for prompts, _, _ in h.sampler.calls)
    assert [batch for batch, _ in h.published(1, timeout_s=0)] == [batch_id]  # nothing else
