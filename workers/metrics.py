"""A worker's Prometheus metrics, published to Redis with each heartbeat.

GPU nodes serve no metrics port: the web nodes' GET /metrics merges what every worker of the
queue published (serving/metrics.py), so Prometheus scrapes the web nodes only.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from batching.keys import QueueKeys
from telemetry.stats import KNOWN_WORKERS_S

# Series of a worker that stopped publishing are dropped after this long.
WORKER_METRICS_TTL_S = 120

BATCH_SIZE_BUCKETS = (1, 2, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 100)
SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 30.0,
)  # fmt: skip


class WorkerMetrics:
    def __init__(self, worker: str) -> None:
        self.worker = worker
        # A registry of its own: nothing else of the process is exported, and no _created
        # series (they would be one more sample per series, per worker, per scrape).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["worker"]
        self.batch_size = Histogram(
            "sampling_batch_size",
            "Prompts per batch when the worker sealed it (expired ones included)",
            buckets=BATCH_SIZE_BUCKETS,
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        self.queue_wait = Histogram(
            "sampling_batch_queue_wait_seconds",
            "Time from a batch's opening (its first request) to its sealing by a free worker",
            buckets=SECONDS_BUCKETS,
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        # Named after vLLM's request_queue_time_seconds.
        self.queue_time = Histogram(
            "sampling_request_queue_time_seconds",
            "Time from a request's arrival to the start of the call that sampled its item",
            buckets=SECONDS_BUCKETS,
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        self.sampler = Histogram(
            "sampling_sampler_seconds",
            "Duration of one batched_sample call",
            buckets=SECONDS_BUCKETS,
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        self.expired = Counter(
            "sampling_expired_items",
            "Items dropped before sampling because their deadline could not be met",
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        self.busy = Counter(
            "sampling_worker_busy_seconds",
            "Time spent in batched_sample calls (busy % = rate of this)",
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        self.batches = Counter(
            "sampling_batches", "Batches run", labelnames=labels, registry=self.registry
        ).labels(worker)
        self.backfill_items = Histogram(
            "sampling_call_backfill_items",
            "Backfill items (offline jobs' lines) per turn of calls, whole backfill turns included",
            buckets=(0, *BATCH_SIZE_BUCKETS),
            labelnames=labels,
            registry=self.registry,
        ).labels(worker)
        places = Counter(
            "sampling_call_places",
            "Places of the calls run (max batch size each), by what filled them: interactive "
            "(requests' items), backfill (offline jobs' lines) or empty",
            labelnames=["worker", "filled"],
            registry=self.registry,
        )
        self._places = {
            filled: places.labels(worker, filled) for filled in ("interactive", "backfill", "empty")
        }
        self._failures = Counter(
            "sampling_batch_failures",
            "Failures of the worker's batch pipeline, by stage (workers.pipeline.Stage)",
            labelnames=["worker", "stage"],
            registry=self.registry,
        )

    def count_failure(self, stage: str) -> None:
        self._failures.labels(self.worker, stage).inc()

    def observe_batch(
        self,
        *,
        size: int,
        expired: int,
        queue_wait_ms: int | None,
        sampler_ms: float,
        queue_times_ms: Iterable[float] = (),
    ) -> None:
        self.batches.inc()
        for queue_time_ms in queue_times_ms:
            self.queue_time.observe(queue_time_ms / 1000)
        self.batch_size.observe(size)
        self.expired.inc(expired)
        if queue_wait_ms is not None:
            self.queue_wait.observe(max(0, queue_wait_ms) / 1000)
        if size > expired:
            self.sampler.observe(sampler_ms / 1000)
            self.busy.inc(sampler_ms / 1000)

    def observe_backfill_call(self, sampler_ms: float) -> None:
        """A call of backfill items only (batching.backfill): busy time, no batch."""
        self.sampler.observe(sampler_ms / 1000)
        self.busy.inc(sampler_ms / 1000)

    def observe_places(self, *, interactive: int, backfill: int, places: int) -> None:
        """A turn's calls' places: taken by requests' items, by backfill items, or empty."""
        self.backfill_items.observe(backfill)
        self._places["interactive"].inc(interactive)
        self._places["backfill"].inc(backfill)
        self._places["empty"].inc(max(0, places - interactive - backfill))

    def publish(self, pipe: redis.client.Pipeline, queue: str, now_s: float) -> None:
        """Queue this worker's exposition and its index entry on `pipe`."""
        keys = QueueKeys(queue)
        pipe.set(
            keys.worker_metrics(self.worker),
            generate_latest(self.registry),
            ex=WORKER_METRICS_TTL_S,
        )
        index = keys.known_workers
        pipe.zadd(index, {self.worker: now_s})
        pipe.zremrangebyscore(index, "-inf", now_s - KNOWN_WORKERS_S)
