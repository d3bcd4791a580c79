"""A GPU worker's batch pipeline: the GPU never waits for the worker between two calls.

Three threads share a BatchRunner:
  - Celery's (the solo pool runs a task in the worker's main thread) hands each batch over
    with `submit` and returns to Celery when the batch's call nears its end, so Celery takes
    the next task message while the GPU is still busy;
  - the GPU thread owns the sampler. Between two calls it does only what cannot move: the
    seal of the next batch (one round trip, lazy: the batch takes everything appended until
    the GPU is free for it), in memory the deadline drops, then the call. With no batch
    waiting when a call ends, it publishes the call's answers itself, at once (and with
    offline jobs' items waiting, seals a turn of them: batching.backfill);
  - the reporter thread does the rest while the GPU already runs the next call: first the
    last batch's answers (the waiters wake on them; published after the next call started,
    not before: the web processes they wake would compete for the CPU the seal needs), then
    the batch's record, statistics and metrics.
A watchdog thread cuts off a call that runs past the call timeout: it answers the batch's
requests at once with an error, hands a batch received but not sealed back to the queue, and
ends the process through its sink's `hung` (a call cannot be interrupted in place; the
supervisor starts a fresh worker).

Why a task returns only near its call's end (PREFETCH_LEAD_MS), not at once: Redis hands a
queued task to the worker whose BRPOP has waited longest, so a worker that asked for the next
task as soon as its call started would take batches that an idle worker could run at once.
Asking in the last few milliseconds of the call keeps the property that made prefetch 1
right (no batch waits behind a busy GPU while another is idle, but for those milliseconds),
and a batch received early is marked held (BatchAggregator.hold) so that it is handed over if
this worker dies before sealing it.

Django- and Celery-free: where a batch's outcome goes is one BatchSink (the worker's, in
workers.lifecycle).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import redis

from batching.protocol import BACKFILL_TURN, UNKNOWN_LANE
from batching.topology import is_cluster
from workers.runner import BatchRunner
from workers.turns import Result, Turn

log = logging.getLogger(__name__)

# Celery takes the next task message when the running call is expected to end within this
# long: more than a message's trip through Redis and Celery into `submit` (~2 ms on an idle
# 2-core machine, up to ~8 ms under load), little enough that a batch rarely waits for a busy
# GPU while another GPU is idle.
PREFETCH_LEAD_MS = 10.0
# A call that runs past max(this, CALL_TIMEOUT_ESTIMATES x the call estimate) is hung, unless
# SAMPLING_CALL_TIMEOUT_MS fixes the timeout.
MIN_CALL_TIMEOUT_MS = 2000
CALL_TIMEOUT_ESTIMATES = 10


# An idle GPU thread wakes this often to apply a newly published policy (well within the
# heartbeat's period: a worker reports a new version at its next heartbeat, busy or idle).
IDLE_POLICY_CHECK_S = 0.2


def auto_call_timeout_ms(estimate_ms: float) -> float:
    return max(MIN_CALL_TIMEOUT_MS, CALL_TIMEOUT_ESTIMATES * estimate_ms)


class Stage(StrEnum):
    """Where a batch's work failed: the `stage` label of sampling_batch_failures_total."""

    RUN = "run"  # a bug of ours in the GPU thread: the batch fails whole
    SEAL = "seal"  # Redis lost mid-seal, say: the batch fails whole
    PUBLISH = "publish"  # its answers not stored: the members time out at their deadline
    RECORD = "record"  # its record, statistics or metrics lost; the answers still go
    REPORT = "report"  # its answers, record or failure not stored: members time out
    RESEND = "resend"  # its task not sent again: its hold hands it over at the next request


@dataclass(frozen=True)
class _Resend:
    """For the reporter: batches due for a hand-over that a seal took, to send again."""

    batch_ids: list[str]


@dataclass(frozen=True)
class _Report:
    """For the reporter: a finished turn (its answers to publish first, or out already), or
    the exception that failed a batch whole."""

    batch_id: str
    outcome: Turn | Exception
    publish: bool = False


class BatchSink(Protocol):
    """Where the pipeline's batches go: their answers, their failures, their tasks sent again,
    and the worker's exit when its GPU hung or keeps failing."""

    def queue_answers(
        self, pipe: redis.client.Pipeline, batch_id: str, answers: list[Result]
    ) -> None:
        """Queue on `pipe` the commands that store and publish a batch's answers."""

    def store_failure(self, batch_id: str, exc: Exception) -> None:
        """Store a batch's failure: its waiters answer 502."""

    def resend(self, batch_id: str) -> None:
        """Send a batch's task again."""

    def hung(self, batch_id: str, ran_ms: float) -> None:
        """A call was cut off, and its batch has its answers: must not return (the process
        exits)."""

    def unhealthy(self, reason: str) -> None:
        """The sampler failed FAILED_CALLS_UNHEALTHY calls in a row, and the batch's answers
        are out: the worker leaves."""


class BatchPipeline:
    def __init__(
        self,
        runner: BatchRunner,
        sink: BatchSink,
        *,
        call_timeout_ms: float | None = None,
        prefetch_lead_ms: float = PREFETCH_LEAD_MS,
    ) -> None:
        """`call_timeout_ms` None: the automatic timeout from the call estimate."""
        self.runner = runner
        self.sink = sink
        self._cluster = is_cluster(runner.aggregator.client)
        self._call_timeout_ms = call_timeout_ms
        self._lead_s = prefetch_lead_ms / 1000
        self._changed = threading.Condition()
        # All below guarded by _changed.
        # Handed over (batch id, lane), not yet taken by the GPU thread.
        self._waiting: tuple[str, int] | None = None
        self._taken: str | None = None  # the batch the GPU thread seals or samples
        self._turn: Turn | None = None  # its turn, once sealed
        self._call_started: float | None = None  # monotonic start of the turn's calls
        # Batches handed over and batches whose calls are over, counted: the n-th `submit`
        # returns at the latest when `_finished` reaches n (a batch id can come twice).
        self._submitted = 0
        self._finished = 0
        self._closed = False
        self._backfill_turns = 0  # backfill turns run: their ids
        # For the reporter: a sampled turn whose answers are out, or a batch that failed.
        self._reports: queue.SimpleQueue[_Report | _Resend | None] = queue.SimpleQueue()
        # A seal's hand-overs are sent by the reporter, not between the seal and the call.
        runner.on_handovers = lambda batch_ids: self._reports.put(_Resend(batch_ids))
        self._threads = [
            threading.Thread(target=self._gpu_loop, name="gpu", daemon=True),
            threading.Thread(target=self._report_loop, name="reporter", daemon=True),
            threading.Thread(target=self._watchdog_loop, name="watchdog", daemon=True),
        ]

    def start(self) -> BatchPipeline:
        for thread in self._threads:
            thread.start()
        return self

    def call_timeout_ms(self) -> float:
        if self._call_timeout_ms is not None:
            return self._call_timeout_ms
        return auto_call_timeout_ms(self.runner.estimate_ms)

    # --- the one failure path ---------------------------------------------------------------
    @contextmanager
    def _failure_of(self, batch_id: str, stage: Stage) -> Iterator[None]:
        """Whatever the block raises is this batch's failure at `stage`: logged with its
        traceback, counted, and for a batch that fails whole (RUN, SEAL) answered (the
        reporter stores the failure: its waiters' get() raises, the view answers 502). The
        thread goes on with its next batch."""
        try:
            yield
        except Exception as exc:
            log.exception("batch %s failed (%s)", batch_id, stage)
            self.runner.metrics.count_failure(stage)
            if stage in (Stage.RUN, Stage.SEAL):
                self._reports.put(_Report(batch_id, exc))

    def _resend_safely(self, batch_id: str) -> None:
        with self._failure_of(batch_id, Stage.RESEND):
            self.sink.resend(batch_id)

    # --- Celery's thread -------------------------------------------------------------------
    def submit(self, batch_id: str, lane: int = UNKNOWN_LANE) -> None:
        """Hand the batch's task to the GPU thread; return when Celery may take the next task:
        the call it runs is about to end, or it is done."""
        with self._changed:
            if self._closed:
                raise RuntimeError("the batch pipeline is closed")
            if self._waiting is not None:  # never: a task returns only once its batch is taken
                raise RuntimeError(f"batch {self._waiting[0]} is still waiting for the GPU")
            self._waiting = (batch_id, lane)
            self._submitted += 1
            number = self._submitted
            gpu_busy = self._taken is not None
            seal_in_s = self._expected_end_s() - time.monotonic()
            self._changed.notify_all()
        if gpu_busy:
            try:
                self.runner.aggregator.hold(batch_id, seal_in_s * 1000)
            except redis.RedisError as exc:  # only a death before the seal would need it
                log.warning("batch %s received early but not marked held: %s", batch_id, exc)
        with self._changed:
            while (wait_s := self._prefetch_wait_s(number)) != 0.0:
                self._changed.wait(wait_s)

    def _expected_end_s(self) -> float:
        """When the GPU thread's current turn should end (monotonic); now when idle."""
        if self._call_started is None or self._turn is None:
            return time.monotonic()
        predicted_ms = self._turn.predicted_ms or len(self._turn.chunks) * self.runner.estimate_ms
        return self._call_started + predicted_ms / 1000

    def _prefetch_wait_s(self, number: int) -> float | None:
        """0.0 once Celery may take the task after the `number`-th; else how long to wait at
        most (None: until the GPU thread says something)."""
        if self._finished >= number:
            return 0.0
        if self._waiting is not None or self._call_started is None:
            return None  # not taken yet, or being sealed
        return max(0.0, self._expected_end_s() - self._lead_s - time.monotonic())

    # --- the GPU thread --------------------------------------------------------------------
    def _gpu_loop(self) -> None:
        unpublished: Turn | None = None  # sampled, its answers not out yet
        while True:
            with self._changed:
                while self._waiting is None and unpublished is None and not self._closed:
                    if self._backfill_waiting():
                        break  # no batch waits, but offline jobs' items do
                    if not self._changed.wait(IDLE_POLICY_CHECK_S):
                        break  # idle a while: the policy is applied below
                task, self._waiting = self._waiting, None
                # A turn of backfill only has no answers to publish: when another follows, its
                # record is built after that one's seal, as a batch's is (_run), not during
                # it, where the reporter would take the GIL from the seal.
                after_backfill = unpublished is not None and not unpublished.interactive
                backfilling = (
                    task is None
                    and not self._closed
                    and (unpublished is None or (after_backfill and self._backfill_waiting()))
                )
                if backfilling:
                    task = self._backfill_turn()
                self._taken = task[0] if task else None
                closed = self._closed
            if task is None:
                if unpublished is None:
                    if closed:
                        return  # closed, and nothing left to answer
                    self._apply_policy()
                    continue
                # No batch for the GPU: the answers leave at once, from here.
                self._publish(unpublished.batch_id, unpublished.answers)
                self._reports.put(_Report(unpublished.batch_id, unpublished))
                unpublished = None
                continue
            batch_id, lane = task
            try:
                sampled, unpublished = unpublished, None
                with self._failure_of(batch_id, Stage.RUN):
                    unpublished = self._run(batch_id, lane, sampled)
            finally:
                with self._changed:
                    self._taken, self._turn, self._call_started = None, None, None
                    if lane != BACKFILL_TURN:  # a backfill turn is none of Celery's tasks
                        self._finished += 1
                    self._changed.notify_all()

    def _backfill_waiting(self) -> bool:
        return any(left > 0 for left in self.runner.backfill_left.values())

    def _backfill_turn(self) -> tuple[str, int] | None:
        """A turn for an idle GPU (id, BACKFILL_TURN) on a shard whose backfill lane holds
        items, in turn over the shards; None when none is known to."""
        shards = [tag for tag, left in self.runner.backfill_left.items() if left > 0]
        if not shards:
            return None
        self._backfill_turns += 1
        tag = shards[self._backfill_turns % len(shards)]
        return f"{{{tag}}}backfill-{self._backfill_turns}", BACKFILL_TURN

    def _apply_policy(self) -> None:
        """An idle GPU takes a new policy (or refuses it) now, not at its next batch: its
        heartbeat reports what it runs under. From the GPU thread, the sampler's owner."""
        try:
            self.runner.apply_policy()
        except Exception:  # the next batch tries again
            log.exception("the policy could not be applied while idle")

    def _run(self, batch_id: str, lane: int, unpublished: Turn | None) -> Turn | None:
        """Seal a batch for the task of `batch_id` (that one, or a higher lane's), have the
        reporter publish `unpublished`'s answers, and sample the batch; return its turn,
        sampled (None when it has no call)."""
        turn = None
        with self._failure_of(batch_id, Stage.SEAL):
            turn = self.runner.begin(batch_id, lane)
        if unpublished is not None:
            self._reports.put(_Report(unpublished.batch_id, unpublished, publish=True))
        if turn is None:
            return None  # failed, or a duplicate task: the batch was sealed before
        if not turn.chunks:  # every item expired: answered without a call
            self._reports.put(_Report(turn.batch_id, turn, publish=True))
            return None
        with self._changed:
            self._turn, self._call_started = turn, time.monotonic()
            self._changed.notify_all()
        self.runner.sample(turn)  # a sampler's failure is its items' answers, not raised
        if self.runner.unhealthy:
            self._leave_unhealthy(turn)
        return turn

    def _leave_unhealthy(self, turn: Turn) -> None:
        """The sampler failed its last calls: answer this batch now, send a batch received
        meanwhile to another worker, and leave (its sink's `unhealthy`)."""
        self._publish(turn.batch_id, turn.answers)
        self._reports.put(_Report(turn.batch_id, turn))
        with self._changed:
            waiting, self._waiting = self._waiting, None
            self._closed = True
        if waiting is not None:
            self._resend_safely(waiting[0])
        self.sink.unhealthy(
            f"{self.runner.failed_calls} sampler calls failed in a row, the last: "
            f"{self.runner.last_failure}"
        )

    def _publish(self, batch_id: str, answers: list[Result]) -> None:
        if not answers:  # a turn of backfill items only: no batch's members wait
            return
        with (
            self._failure_of(batch_id, Stage.PUBLISH),
            self.runner.aggregator.client.pipeline(transaction=False) as pipe,
        ):
            self.sink.queue_answers(pipe, batch_id, answers)
            pipe.execute()

    # --- the reporter thread ---------------------------------------------------------------
    def _report_loop(self) -> None:
        while (report := self._reports.get()) is not None:
            if isinstance(report, _Resend):
                self._hand_over(report.batch_ids)
                continue
            with self._failure_of(report.batch_id, Stage.REPORT):
                self._report(report)

    def _report(self, report: _Report) -> None:
        batch_id, outcome = report.batch_id, report.outcome
        if isinstance(outcome, Exception):
            self.sink.store_failure(batch_id, outcome)
            return
        # The answers, then the record and statistics: one round trip. On a cluster the
        # record also writes to other masters' slots (token charges, the cache on every
        # shard): the answers go first, so that a master down elsewhere cannot keep them from
        # their batch's own. With backfill items, too: their answers and the record took the
        # reporter long enough to keep the requests' answers back (at half load, with a job,
        # the requests' p99 read 23% higher: `bench backfill`).
        with self.runner.aggregator.client.pipeline(transaction=False) as pipe:
            if report.publish and outcome.interactive:
                self.sink.queue_answers(pipe, batch_id, outcome.answers)
                if self._cluster or outcome.backfill:
                    pipe.execute()
            with self._failure_of(batch_id, Stage.RECORD):  # the answers go all the same
                self.runner.finish(outcome, pipe)
            pipe.execute()

    def _hand_over(self, batch_ids: list[str]) -> None:
        for batch_id in batch_ids:
            log.warning("batch %s was due for a hand-over: sending its task again", batch_id)
            self._resend_safely(batch_id)

    # --- the watchdog thread ---------------------------------------------------------------
    def _watchdog_loop(self) -> None:
        while True:
            with self._changed:
                if self._closed:
                    return
                turn, started = self._turn, self.runner.busy_since
                if turn is None:
                    self._changed.wait()  # until a turn's calls start
                    continue
                if started is None:  # just before the turn's first call, or between two
                    self._changed.wait(0.005)
                    continue
                remaining_s = started + self.call_timeout_ms() / 1000 - time.monotonic()
                if remaining_s > 0:
                    self._changed.wait(remaining_s)
                    continue
                waiting = self._waiting[0] if self._waiting else None
            self._cut_off(turn, started, waiting)
            return  # the sink's `hung` ends the process: a hung pipeline runs nothing more

    def _cut_off(self, turn: Turn, started: float, waiting: str | None) -> None:
        ran_ms = (time.monotonic() - started) * 1000
        log.critical(
            "sampler call on batch %s has run %.0f ms, past the %.0f ms call timeout: "
            "answering its requests with an error and leaving",
            turn.batch_id,
            ran_ms,
            self.call_timeout_ms(),
        )
        reason = f"sampler call timed out after {ran_ms:.0f} ms"
        self._publish(turn.batch_id, turn.answers_failing_the_rest(reason))
        if waiting is not None:  # received, never sealed: another worker runs it
            self._resend_safely(waiting)
        self.sink.hung(turn.batch_id, ran_ms)

    def drain_reports(self, timeout_s: float) -> None:
        """Let the reporter finish what it has (records, statistics) and stop: a process that
        leaves because of a hung call calls it, bounded, before it exits."""
        self._reports.put(None)
        self._threads[1].join(timeout_s)

    # --- shutdown --------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Finish the batch on the GPU (and one handed over), publish every answer, stop."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        gpu, reporter, _ = self._threads
        if gpu.is_alive():
            gpu.join(timeout_s)
        self._reports.put(None)
        if reporter.is_alive():
            reporter.join(timeout_s)
