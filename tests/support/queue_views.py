"""A queue's live workers and batch log, read beside its aggregator as the service reads them
(the aggregator owns neither)."""

from __future__ import annotations

from batching.aggregator import BatchAggregator
from batching.registry import WorkerRegistry
from telemetry.batch_log import BatchLog


def workers_of(aggregator: BatchAggregator) -> WorkerRegistry:
    return WorkerRegistry(aggregator.client, aggregator.keys)


def batch_log_of(aggregator: BatchAggregator) -> BatchLog:
    return BatchLog(aggregator.client, aggregator.queue)
