"""A GPU worker's life: load the sampler once at start, run batches through the pipeline,
heartbeat while alive, leave on stop, and exit at once when a call hangs.

Connected to Celery's worker signals when `celery worker` imports workers.tasks
(CELERY_IMPORTS); a web process never imports this module.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import cast

import redis
from celery import current_app, signals
from celery.backends.redis import RedisBackend
from django.conf import settings

from batching import topology
from batching.admission import AdmissionInputs
from batching.aggregator import HANDOVER_SCAN_MS, BatchAggregator
from batching.call_cost import load_profile
from batching.loop import PeriodicLoop
from batching.policy import PolicyWatcher, policy_from_settings
from batching.protocol import RUN_BATCH_TASK, UNKNOWN_LANE, task_priority
from batching.registry import HEARTBEAT_TIMEOUT_MS, WorkerRegistry
from batching.result_store import queue_result
from batching.topology import REDIS_FAULTS
from telemetry import stats
from workers.pipeline import BatchPipeline
from workers.runner import BatchRunner
from workers.samplers import load_sampler
from workers.turns import Result

log = logging.getLogger(__name__)

# About this many of a queue's workers scan a shard each HANDOVER_SCAN_MS, however many there
# are: a worker scans every HANDOVER_SCAN_MS x live workers / HANDOVER_SCANNERS. Every worker
# scanning every 100 ms cost 21 simulated workers on 3 shards 0.3 of a core at idle (630
# scans/s) on the 2-core bench, where a few scans in a period take a hand-over as soon.
HANDOVER_SCANNERS = 3
# Each scan's wait is its interval within +/- this share, so that workers started together
# do not scan in step (and leave the rest of the interval unscanned).
HANDOVER_SCAN_JITTER = 0.2


def handover_scan_interval_s(live_workers: int) -> float:
    """How often each of `live_workers` workers scans for hand-overs: together, about
    HANDOVER_SCANNERS scans of each shard every HANDOVER_SCAN_MS."""
    return HANDOVER_SCAN_MS / 1000 * max(1.0, live_workers / HANDOVER_SCANNERS)


HEARTBEAT_INTERVAL_S = 1.0
# A stopped worker's row stays on the stats page this long.
WORKER_INFO_TTL_MS = stats.KNOWN_WORKERS_S * 1000
# The exit status of a worker whose sampler call hung (sysexits' EX_SOFTWARE): its supervisor
# (systemd, compose, `make run`) starts a fresh one.
EXIT_HUNG_CALL = 70
# The exit status of a worker whose sampler failed FAILED_CALLS_UNHEALTHY calls in a row
# (sysexits' EX_UNAVAILABLE): not a healthy GPU. Its supervisor starts a fresh one, whose
# warm-up call shows whether the GPU is back.
EXIT_UNHEALTHY_GPU = 69

# The exit status of a worker started under a name another live worker process runs as
# (sysexits' EX_CONFIG): two workers of one name would count as one live worker.
EXIT_DUPLICATE_NAME = 78
# How long a worker waits for its name at start: a predecessor killed without its goodbye
# (SIGKILL, a crash) holds it until its claim expires, HEARTBEAT_TIMEOUT_MS after its last
# renewal; a live one renews it every HEARTBEAT_INTERVAL_S and keeps it.
NAME_CLAIM_WAIT_S = HEARTBEAT_TIMEOUT_MS / 1000 + 1

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


class DuplicateName(Exception):
    """Another live process runs as this worker's name."""


class NameClaim:
    """This process's claim on its worker name, held from before its sampler loads until it
    stops: one live process a name in the heartbeats (batching.registry). A second process
    started under a live worker's name refuses to start; one that finds its claim taken
    later (Redis lost it for longer than the claim lasts, and another process took it)
    exits at once, without the goodbye that would remove the other's heartbeat."""

    def __init__(self, aggregator: BatchAggregator, worker: str) -> None:
        self.registry = WorkerRegistry(aggregator.client, aggregator.keys)
        self.worker = worker
        self.token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}"
        self.loop = PeriodicLoop(
            "name-claim", self.renew, HEARTBEAT_INTERVAL_S, f"renew the claim on {worker}"
        )

    def acquire(self, wait_s: float = NAME_CLAIM_WAIT_S) -> NameClaim:
        """Claim the name, waiting up to `wait_s` for a dead predecessor's claim to expire;
        raises DuplicateName when a live process holds it all along."""
        deadline = time.monotonic() + wait_s
        while (owner := self._try_claim()) is not None:
            if time.monotonic() >= deadline:
                raise DuplicateName(
                    f"worker {self.worker}: another live worker process runs under this name "
                    f"({owner}); give each worker a name of its own (celery worker --hostname)"
                )
            time.sleep(0.2)  # duration: the poll of a claim that expires by itself
        self.loop.start()
        return self

    def _try_claim(self) -> str | None:
        try:
            return self.registry.claim(self.worker, self.token)
        except topology.REDIS_FAULTS as exc:  # Redis away at start: the renewals claim it
            log.warning("worker %s: its name cannot be claimed yet: %s", self.worker, exc)
            return None

    def renew(self) -> None:
        owner = self.registry.claim(self.worker, self.token)
        if owner is not None:
            log.critical(
                "worker %s: its name was claimed by another live process (%s): exiting with "
                "status %d, without a goodbye (the name's heartbeat is the other's now)",
                self.worker,
                owner,
                EXIT_DUPLICATE_NAME,
            )
            _flush_logs()
            os._exit(EXIT_DUPLICATE_NAME)

    def release(self) -> None:
        self.loop.stop(timeout_s=0.5)
        try:
            self.registry.release(self.worker, self.token)
        except topology.REDIS_FAULTS as exc:  # it expires by itself
            log.warning("worker %s: its name's claim not released: %s", self.worker, exc)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


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
        self.resend = resend
        self.exit_process = exit_process
        self.pipeline = BatchPipeline(
            runner,
            queue_answers=lambda pipe, batch_id, answers: queue_answers(
                pipe, batch_id, answers, self.aggregator.ttl_s
            ),
            store_failure=store_failure,
            resend=resend,
            on_hung=lambda batch_id, ran_ms: self.leave("hung", EXIT_HUNG_CALL),
            on_unhealthy=self._leave_unhealthy,
            call_timeout_ms=call_timeout_ms,
        )
        self.heartbeat = PeriodicLoop(
            "heartbeat", self.beat, HEARTBEAT_INTERVAL_S, "send the heartbeat", first_wait_s=0
        )
        self.handover = PeriodicLoop(
            "handover",
            self.scan_handovers,
            handover_scan_interval_s(runner.live_workers),
            "scan for hand-overs",
            jitter=HANDOVER_SCAN_JITTER,
        )
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
        self.heartbeat.start()
        self.handover.start()
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
        _flush_logs()
        self.exit_process(status)

    def _leave_unhealthy(self, reason: str) -> None:
        log.critical("worker leaves: not a healthy GPU: %s", reason)
        self.leave("unhealthy", EXIT_UNHEALTHY_GPU)

    def _stop_loops(self) -> None:
        # A heartbeat in flight finishes first: it would count the worker again after its
        # goodbye.
        self.heartbeat.stop(timeout_s=0.5)
        self.handover.stop()

    def scan_handovers(self) -> None:
        """Send again the task of any batch due for a hand-over (a dispatcher or a worker
        died before the send or the seal) on a shard this worker has not sealed lately: a
        seal takes a shard's hand-overs itself, so under load this costs nothing. Every shard
        is scanned; the first failure is raised after."""
        scan_s = HANDOVER_SCAN_MS / 1000
        failure: Exception | None = None
        now = time.monotonic()
        for index, keys in enumerate(self.aggregator.shards):
            # Sealed lately (by this worker; the others' seals take hand-overs too): a shard
            # with traffic needs no scan. Three periods, as a worker's own seals come about
            # one call apart.
            if now - self.runner.sealed_at.get(keys.tag, float("-inf")) < 3 * scan_s:
                continue
            try:
                for batch_id in self.aggregator.take_due_handovers(index):
                    log.warning(
                        "batch %s was due for a hand-over: sending its task again", batch_id
                    )
                    self.resend(batch_id)
            except Exception as exc:  # noqa: BLE001 - Redis or the broker away: next shard
                failure = failure or exc
        if failure is not None:
            raise failure

    def beat(self) -> None:
        """Liveness (for admission and /readyz), the worker's row of the stats page, its
        alive-seconds (for busy %), its Prometheus metrics, and every shard's admission
        figures: two round trips, and one per shard (and one more on a cluster)."""
        runner, aggregator = self.runner, self.aggregator
        now = time.time()
        runner.live_workers = max(1, runner.workers.heartbeat(runner.worker))
        self.handover.interval_s = handover_scan_interval_s(runner.live_workers)
        info = worker_info(runner, now)
        # The policy version on every shard before the info reports it: the response cache
        # serves no answer of an older one once every worker reports a newer.
        version = cast(int, info["policy_version"])
        cluster = topology.is_cluster(aggregator.client)
        if cluster:  # other masters: one away must not keep the heartbeat from the others
            try:
                with aggregator.client.pipeline(transaction=False) as pipe:
                    aggregator.queue_cache_version(pipe, version)
                    pipe.execute()
            except REDIS_FAULTS as exc:
                log.warning("policy version %d not written on every shard: %s", version, exc)
        with aggregator.client.pipeline(transaction=False) as pipe:
            if not cluster:
                aggregator.queue_cache_version(pipe, version)
            pipe.set(
                aggregator.keys.worker_info(runner.worker), json.dumps(info), px=WORKER_INFO_TTL_MS
            )
            counts = runner.take_queue_times(now)
            counts.update(stats.alive_counts(runner.worker))
            stats.add_counts(pipe, aggregator.queue, now, counts)
            runner.metrics.publish(pipe, aggregator.queue, now)
            runner.batch_log.queue_turn_ms(pipe, runner.turn_ms, aggregator.ttl_ms)
            for keys in aggregator.shards:  # offline jobs' items waiting (batching.backfill)
                pipe.llen(keys.backfill)
            replies = pipe.execute()
        waiting = replies[len(replies) - len(aggregator.shards) :]
        for keys, left in zip(aggregator.shards, waiting, strict=True):
            runner.backfill_left[keys.tag] = int(left)
        aggregator.refresh_admission(AdmissionInputs(runner.live_workers, runner.turn_ms))


def worker_info(runner: BatchRunner, now: float) -> dict[str, object]:
    """The worker's row of the stats page. Its policy is the one it runs under: a published
    version its sampler refused is reported as refused (with why), not as its version."""
    policy = runner.applied
    return {
        "worker": runner.worker,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "sampler": runner.sampler.name,
        "batches": runner.batches,
        "busy_s": round(runner.busy_s, 3),
        "estimate_ms": round(runner.estimate_ms, 2),
        "policy_version": runner.applied_version,
        "policy_refused": runner.refused_version,
        "policy_refused_reason": runner.refused_reason,
        "max_batch_size": policy.max_batch_size,
        "max_new_tokens": runner.sampler.generation.max_new_tokens,
        "state": "busy" if runner.busy_since is not None else "idle",
        "heartbeat_at": now,
    }


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
    _worker = worker.start()


@signals.worker_shutdown.connect
@signals.worker_process_shutdown.connect
def stop_worker(sender: object = None, **kwargs: object) -> None:
    if _worker is not None:
        _worker.stop()


def say_goodbye(runner: BatchRunner, state: str = "stopped") -> None:
    """Stop counting as a live worker at once (not 5 s later), and show as stopped (or hung),
    not as silent, on the stats page. Best effort: the process is leaving."""
    aggregator = runner.aggregator
    info_key = aggregator.keys.worker_info(runner.worker)
    try:
        runner.workers.forget(runner.worker)
        raw = aggregator.client.get(info_key)
        if raw:
            info = {**json.loads(raw), "state": state, "heartbeat_at": time.time()}
            aggregator.client.set(info_key, json.dumps(info), px=WORKER_INFO_TTL_MS)
    except (redis.RedisError, ValueError) as exc:
        log.warning(
            "worker %s leaves without saying so in Redis (counted for up to %d ms more): %s",
            runner.worker,
            HEARTBEAT_TIMEOUT_MS,
            exc,
        )
