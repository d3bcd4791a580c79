"""Celery tasks: thin wrappers that take JSON primitives and call domain code.

Imported by `celery worker` only (CELERY_IMPORTS); importing it connects the worker's life
cycle (workers.lifecycle) to Celery's signals.
"""

from __future__ import annotations

from celery import shared_task

from batching.protocol import RUN_BATCH_TASK, UNKNOWN_LANE
from workers.lifecycle import current_pipeline


# ignore_result: the batch's answers are stored under its id (the task id) by the pipeline's
# reporter when the call ends, in the shape Celery stores a result; the task itself returns
# before that, so that the worker takes the next task while the GPU is busy.
@shared_task(name=RUN_BATCH_TASK, ignore_result=True)
def run_batch(batch_id: str, queue: str, lane: int = UNKNOWN_LANE) -> None:
    """Hand batch `batch_id` of `queue` (of `lane`, a tier's priority) to this worker's GPU
    pipeline (workers.pipeline): one turn of the GPU, which seals that batch or a higher
    lane's (batching/lua/seal.lua). Messages sent before lanes carry no lane."""
    current_pipeline(queue).submit(batch_id, lane)
