"""A GPU worker's life: load the sampler once at start, heartbeat while alive, leave on stop.

Connected to Celery's worker signals when `celery worker` imports workers.tasks
(CELERY_IMPORTS); a web process never imports this module.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time

import redis
from celery import signals
from django.conf import settings

from batching import stats
from batching.aggregator import HEARTBEAT_TIMEOUT_MS, BatchAggregator
from batching.policy import PolicyWatcher, policy_from_settings
from workers.runner import BatchRunner
from workers.samplers import load_sampler

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# A call running longer than this is taken for a hung sampler: the worker stops advertising
# itself, so /readyz and admission no longer count it.
STUCK_CALL_S = 60.0
# A stopped worker's row stays on the stats page this long.
WORKER_INFO_TTL_MS = stats.KNOWN_WORKERS_S * 1000

_runner: BatchRunner | None = None
_stop = threading.Event()


def current_runner(queue: str) -> BatchRunner:
    if _runner is None:
        raise RuntimeError("this process is not a sampling worker: no sampler was loaded")
    if queue != _runner.aggregator.queue:
        raise RuntimeError(
            f"batch of queue {queue!r} reached a worker of queue {_runner.aggregator.queue!r}"
        )
    return _runner


def _aggregator() -> BatchAggregator:
    return BatchAggregator(
        redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10),
        settings.SAMPLING_QUEUE,
        max_batch_size=settings.SAMPLING_MAX_BATCH_SIZE,
        deadline_ms=settings.SAMPLING_DEADLINE_MS,
    )


def _watcher(aggregator: BatchAggregator) -> PolicyWatcher:
    # Started before the model loads, so the warm-up already runs with the published policy.
    return PolicyWatcher(
        aggregator.client, aggregator.queue, policy_from_settings(settings)
    ).start()


@signals.worker_process_init.connect
def load_runner(sender: object = None, **kwargs: object) -> None:
    """Fired in the process that runs tasks (the solo pool's main process): load once."""
    global _runner
    started = time.perf_counter()
    worker = str(sender or f"worker@{socket.gethostname()}")
    try:
        aggregator = _aggregator()
        watcher = _watcher(aggregator)
        sampler = load_sampler()
        _runner = BatchRunner(aggregator, sampler, worker, policy=lambda: watcher.current)
        _runner.warm_up()
    except Exception as exc:  # whatever failed, the worker is useless without its sampler
        # Celery logs and swallows a signal handler's exception: the worker would go on
        # consuming batches it cannot run, failing them. Leave instead (SystemExit is not an
        # Exception, so it stops the worker's start).
        log.critical(
            "worker %s: the sampler could not be loaded, exiting: %s", worker, exc, exc_info=True
        )
        raise SystemExit(1) from exc
    # A loaded model leaves its long-lived Python objects to the cyclic collector (SmolLM2's
    # GGUF tokenizer alone: ~350,000), and one full collection over them took ~150 ms on CPU,
    # a pause in the middle of some batch. Move them out of its reach for good.
    gc.collect()
    gc.freeze()
    log.info(
        "worker %s: sampler %s loaded for queue %s in %.1f s (CUDA_VISIBLE_DEVICES=%s)",
        worker,
        sampler.name,
        settings.SAMPLING_QUEUE,
        time.perf_counter() - started,
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
    )
    # Started here rather than on worker_ready so that it runs in the process holding the
    # sampler whatever the pool (solo: the worker itself; prefork: the child).
    _stop.clear()
    threading.Thread(target=_heartbeat_loop, args=(_runner,), name="heartbeat", daemon=True).start()


def _heartbeat_loop(runner: BatchRunner) -> None:
    """Once a second: liveness (for admission and /readyz), the worker's row of the stats
    page, its alive-seconds (for busy %), and its Prometheus metrics: two round trips."""
    aggregator = runner.aggregator
    info_key = aggregator.keys.worker_info(runner.worker)
    while not _stop.is_set():
        busy_since = runner.busy_since
        stuck = busy_since is not None and time.monotonic() - busy_since > STUCK_CALL_S
        now = time.time()
        try:
            if stuck:
                log.error("sampler call running for over %.0f s: not advertising", STUCK_CALL_S)
                aggregator.forget_worker(runner.worker)
            else:
                aggregator.heartbeat(runner.worker)
            policy = runner.policy()
            info = {
                "worker": runner.worker,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "sampler": runner.sampler.name,
                "batches": runner.batches,
                "busy_s": round(runner.busy_s, 3),
                "estimate_ms": round(runner.estimate_ms, 2),
                "policy_version": policy.version,
                "max_batch_size": policy.max_batch_size,
                "max_new_tokens": runner.sampler.generation.max_new_tokens,
                "state": "stuck" if stuck else ("busy" if busy_since is not None else "idle"),
                "heartbeat_at": now,
            }
            with aggregator.client.pipeline(transaction=False) as pipe:
                pipe.set(info_key, json.dumps(info), px=WORKER_INFO_TTL_MS)
                stats.add_counts(pipe, aggregator.queue, now, stats.alive_counts(runner.worker))
                runner.metrics.publish(pipe, aggregator.queue, now)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
        _stop.wait(HEARTBEAT_INTERVAL_S)


@signals.worker_shutdown.connect
@signals.worker_process_shutdown.connect
def stop_heartbeat(sender: object = None, **kwargs: object) -> None:
    _stop.set()
    if _runner is not None:
        say_goodbye(_runner)


def say_goodbye(runner: BatchRunner) -> None:
    """Stop counting as a live worker at once (not 5 s later), and show as stopped, not as
    silent, on the stats page. Best effort: the process is leaving."""
    aggregator = runner.aggregator
    info_key = aggregator.keys.worker_info(runner.worker)
    try:
        aggregator.forget_worker(runner.worker)
        raw = aggregator.client.get(info_key)
        if raw:
            info = {**json.loads(raw), "state": "stopped", "heartbeat_at": time.time()}
            aggregator.client.set(info_key, json.dumps(info), px=WORKER_INFO_TTL_MS)
    except (redis.RedisError, ValueError) as exc:
        log.warning(
            "worker %s leaves without saying so in Redis (counted for up to %d ms more): %s",
            runner.worker,
            HEARTBEAT_TIMEOUT_MS,
            exc,
        )
