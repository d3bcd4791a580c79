"""Celery tasks: thin wrappers that take JSON primitives and call domain code.

Imported by `celery worker` only (CELERY_IMPORTS); importing it connects the worker's life
cycle (workers.lifecycle) to Celery's signals.
"""

from __future__ import annotations

from celery import shared_task
from celery.exceptions import Ignore

from batching.protocol import RUN_BATCH_TASK
from workers.lifecycle import current_runner


@shared_task(name=RUN_BATCH_TASK)
def run_batch(batch_id: str, queue: str) -> list[list[str]]:
    """Seal batch `batch_id` of `queue`, sample it, and return one [outcome, text] per item."""
    results = current_runner(queue).run(batch_id)
    if results is None:
        # A duplicate task of a batch sealed already (a hand-over): its members have their
        # answer, which storing an empty result must not replace.
        raise Ignore
    return results
