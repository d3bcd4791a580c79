"""A GPU worker's life: load the sampler once at start, run batches through the pipeline,
heartbeat while alive, leave on stop, and exit at once when a call hangs.

Connected to Celery's worker signals when `celery worker` imports workers.tasks
(CELERY_IMPORTS); a web process never imports this module.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis
from celery import current_app, signals
from celery.backends.redis import RedisBackend
from django.conf import settings

from batching import topology
from batching.aggregator import BatchAggregator
from batching.call_cost import load_profile
from batching.policy import Policy, PolicyWatcher, policy_from_settings
from batching.protocol import RUN_BATCH_TASK, UNKNOWN_LANE, task_priority
from batching.result_store import queue_result
from workers.heartbeat import (
    EXIT_DUPLICATE_NAME,
    DuplicateName,
    NameClaim,
    Presence,
    flush_logs,
    say_goodbye,
)
from workers.pipeline import BatchPipeline
from workers.runner import BatchRunner
from workers.samplers import load_sampler
from workers.turns import Result

log = logging.getLogger(__name__)


# The exit status of a worker whose sampler call hung (sysexits' EX_SOFTWARE): its supervisor
# (systemd, compose, `make run`) starts a fresh one.
EXIT_HUNG_CALL = 70
# The exit status of a worker whose sampler failed FAILED_CALLS_UNHEALTHY calls in a row
# (sysexits' EX_UNAVAILABLE): not a healthy GPU. Its supervisor starts a fresh one, whose
# warm-up call shows whether the GPU is back.
EXIT_UNHEALTHY_GPU = 69


# The worker of this process, once its sampler is loaded (Celery's signals find it here).
_worker: SamplingWorker | None = None


def current_pipeline(queue: str) -> BatchPipeline:
    if _worker is None:
        raise RuntimeError("this process is not a sampling worker: no sampler was loaded")
    if queue != _worker.aggregator.queue:
        raise RuntimeError(
            f"batch of queue {queue!r} reached a worker of queue {_worker.aggregator.queue!r}"
        )
    return _worker.pipeline


def queue_answers(
    pipe: redis.client.Pipeline, batch_id: str, answers: list[Result], expires_s: float
) -> None:
    """A batch's answers, stored and published as Celery stores its task's result (the task
    id is the batch id), so that the web side's AsyncResult(batch_id).get() reads them. Kept
    as long as the batch's own data (`expires_s`): no member waits longer, and a queue's
    results then stay a few seconds' worth, not CELERY_RESULT_EXPIRES' minutes."""
    backend = current_app.backend
    if not isinstance(backend, RedisBackend):  # CELERY_RESULT_BACKEND: a Redis backend
        raise TypeError(f"the result backend must be Redis, not {type(backend).__name__}")
    queue_result(pipe, backend, batch_id, answers, expires_s=expires_s)


def store_failure(batch_id: str, exc: Exception) -> None:
    """A batch that failed whole: its waiters' get() raises, and the view answers 502."""
    current_app.backend.mark_as_failure(batch_id, exc)


def _resender(aggregator: BatchAggregator) -> Callable[[str], None]:
    def resend(batch_id: str) -> None:
        current_app.send_task(
            RUN_BATCH_TASK,
            args=(batch_id, aggregator.queue, UNKNOWN_LANE),
            task_id=batch_id,
            queue=aggregator.queue,
            priority=task_priority(UNKNOWN_LANE),
            expires=aggregator.ttl_s,  # as the web's dispatch (serving.submission)
        )

    return resend


def _aggregator() -> BatchAggregator:
    return BatchAggregator(
        topology.redis_client(
            settings.SAMPLING_REDIS_URL, cluster=settings.SAMPLING_REDIS_CLUSTER, socket_timeout=10
        ),
        settings.SAMPLING_QUEUE,
        max_batch_size=settings.SAMPLING_MAX_BATCH_SIZE,
        deadline_ms=settings.SAMPLING_DEADLINE_MS,
        shards=settings.SAMPLING_SHARDS,
    )


class SamplingWorker:
    """One sampling worker process's life: its runner and batch pipeline, its heartbeat and
    hand-over loops, its warm stop and its exit. `start` once the sampler is loaded; `stop`
    for a warm shutdown; `leave` when the pipeline gave up on the GPU (a hung call, failing
    calls): goodbye in Redis, then the process exits (`exit_process`) for its supervisor to
    start a fresh one."""

    def __init__(
        self,
        runner: BatchRunner,
        resend: Callable[[str], None],
        call_timeout_ms: float | None = None,
        exit_process: Callable[[int], object] = os._exit,
    ) -> None:
        self.runner = runner
        self.aggregator = runner.aggregator
        self._send_again = resend
        self.exit_process = exit_process
        self.pipeline = BatchPipeline(runner, self, call_timeout_ms=call_timeout_ms)
        self.presence = Presence(runner, resend)
        self.leaving = threading.Event()  # set once: the process exits, no warm stop
        self.claim: NameClaim | None = None  # its name's, from `load`

    @classmethod
    def load(cls, worker: str) -> SamplingWorker:
        """The worker of this process as the settings describe it, its sampler loaded and
        warmed up. The policy watcher starts before the model loads, so that the warm-up
        already runs with the published policy."""
        aggregator = _aggregator()
        claim = NameClaim(aggregator, worker).acquire()
        try:
            watcher = PolicyWatcher(
                aggregator.client, aggregator.queue, policy_from_settings(settings)
            ).start()
            sampler = load_sampler()
            runner = BatchRunner(aggregator, sampler, worker, policy=lambda: watcher.current)
            runner.unhealthy_after = settings.SAMPLING_UNHEALTHY_AFTER_FAILED_CALLS or (
                runner.unhealthy_after
            )
            runner.stream_interval_ms = settings.SAMPLING_STREAM_INTERVAL_MS
            runner.costs.backfill_extra_cost_pct = settings.SAMPLING_BACKFILL_EXTRA_COST_PCT
            if settings.SAMPLING_COST_PROFILE:
                runner.costs.profile = load_profile(settings.SAMPLING_COST_PROFILE, 100.0)
            runner.warm_up()
        except BaseException:
            claim.release()
            raise
        loaded = cls(runner, _resender(aggregator), settings.SAMPLING_CALL_TIMEOUT_MS or None)
        loaded.claim = claim
        return loaded

    def start(self) -> SamplingWorker:
        self.pipeline.start()
        self.presence.start()
        return self

    def stop(self) -> None:
        """A warm shutdown: the running call ends and its answers are published, then
        goodbye."""
        if self.leaving.is_set():
            return
        self.pipeline.close(timeout_s=self.pipeline.call_timeout_ms() / 1000 + 1)
        self._stop_loops()
        say_goodbye(self.runner)
        if self.claim is not None:
            self.claim.release()

    def leave(self, state: str, status: int) -> None:
        """Stop counting as a worker at once (admission, /readyz), say why, and exit with
        `status`: a hung call cannot be interrupted in place."""
        self.leaving.set()
        self._stop_loops()
        say_goodbye(self.runner, state=state)
        if self.claim is not None:
            self.claim.release()  # its supervisor's fresh start takes the name at once
        self.pipeline.drain_reports(timeout_s=1.0)  # the last batches' records, if any are left
        log.critical("worker exits with status %d for its supervisor to restart it", status)
        flush_logs()
        self.exit_process(status)

    # The pipeline's sink (workers.pipeline.BatchSink): where its batches' outcomes go.

    def queue_answers(
        self, pipe: redis.client.Pipeline, batch_id: str, answers: list[Result]
    ) -> None:
        queue_answers(pipe, batch_id, answers, self.aggregator.ttl_s)

    def store_failure(self, batch_id: str, exc: Exception) -> None:
        store_failure(batch_id, exc)

    def resend(self, batch_id: str) -> None:
        self._send_again(batch_id)

    def hung(self, batch_id: str, ran_ms: float) -> None:
        self.leave("hung", EXIT_HUNG_CALL)

    def unhealthy(self, reason: str) -> None:
        log.critical("worker leaves: not a healthy GPU: %s", reason)
        self.leave("unhealthy", EXIT_UNHEALTHY_GPU)

    def _stop_loops(self) -> None:
        self.presence.stop()


@signals.worker_process_init.connect
def load_runner(sender: object = None, **kwargs: object) -> None:
    """Fired in the process that runs tasks (the solo pool's main process): load once, then
    start the pipeline and the loops there, whatever the pool (solo: the worker itself;
    prefork: the child)."""
    global _worker
    started = time.perf_counter()
    name = str(sender or f"worker@{socket.gethostname()}")
    try:
        worker = SamplingWorker.load(name)
    except DuplicateName as exc:  # a configuration error: no sampler loaded for nothing
        log.critical("%s: exiting with status %d", exc, EXIT_DUPLICATE_NAME)
        raise SystemExit(EXIT_DUPLICATE_NAME) from exc
    except Exception as exc:  # whatever failed, the worker is useless without its sampler
        # Celery logs and swallows a signal handler's exception: the worker would go on
        # consuming batches it cannot run, failing them. Leave instead (SystemExit is not an
        # Exception, so it stops the worker's start).
        log.critical(
            "worker %s: the sampler could not be loaded, exiting: %s", name, exc, exc_info=True
        )
        raise SystemExit(1) from exc
    # A loaded model leaves its long-lived Python objects to the cyclic collector (SmolLM2's
    # GGUF tokenizer alone: ~350,000), and one full collection over them took ~150 ms on CPU,
    # a pause in the middle of some batch. Move them out of its reach for good.
    gc.collect()
    gc.freeze()
    log.info(
        "worker %s: sampler %s loaded for queue %s in %.1f s (CUDA_VISIBLE_DEVICES=%s)",
        name,
        worker.runner.sampler.name,
        settings.SAMPLING_QUEUE,
        time.perf_counter() - started,
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
    )
    _warn_of_a_cpu_under_a_gpus_deadline(worker.runner.sampler)
    _worker = worker.start()


def _warn_of_a_cpu_under_a_gpus_deadline(sampler: object) -> None:
    """A model on CPU takes seconds a call: worth a warning under the GPU's default deadline,
    not under a longer one set for it (make run's CPU profile)."""
    deadline_ms = settings.SAMPLING_DEADLINE_MS
    if getattr(sampler, "device", None) == "cpu" and deadline_ms <= Policy.deadline_ms:
        log.warning(
            "no GPU: the model runs on CPU, where a call takes seconds, not the ~100 ms that "
            "the deadline of %d ms is sized for",
            deadline_ms,
        )


@signals.worker_shutdown.connect
@signals.worker_process_shutdown.connect
def stop_worker(sender: object = None, **kwargs: object) -> None:
    if _worker is not None:
        _worker.stop()
