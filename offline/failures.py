"""Offline jobs' failures counted for /metrics: each failure of a job's step in the feeder
(offline.feeder), and each job whose input could not be validated (offline.validate), one
count in Redis (QueueKeys.feeder_failures, `sampling_batch_job_failures_total`) per failure,
never once per outage."""

from __future__ import annotations

import logging

from batching.keys import QueueKeys
from batching.topology import REDIS_FAULTS
from serving.runtime import web_process

log = logging.getLogger(__name__)


def count_failure(step: str) -> None:
    """One more failure of `step` (best effort: Redis away, the log says it)."""
    process = web_process()
    try:
        process.client.hincrby(QueueKeys(process.default_model).feeder_failures, step, 1)
    except REDIS_FAULTS as exc:
        log.warning("a failure of %s not counted: %s", step, exc)
