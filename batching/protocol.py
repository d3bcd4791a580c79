"""What web processes and workers exchange through Celery.

A web process sends the batch task by name, so it never imports the worker's runtime; the
worker registers its task under the same name (workers/tasks.py).
"""

from __future__ import annotations

# The task's name is an installed one: web processes and workers import it from here.
from batching.installed_names import RUN_BATCH_TASK as RUN_BATCH_TASK

# Celery's Redis transport keeps one list per priority step and a worker pops them in order,
# step 0 first: CELERY_BROKER_TRANSPORT_OPTIONS sets these ten steps.
PRIORITY_STEPS = list(range(10))
# A batch task's lane when the sender does not know it (a task sent again by a hand-over).
UNKNOWN_LANE = -1
# The lane of a backfill turn: a worker whose GPU would be idle seals with it, taking any batch
# that waits, else a whole batch of offline jobs' items (batching.backfill).
BACKFILL_TURN = -2


def task_priority(lane: int) -> int:
    """The Celery priority of a batch task of `lane` (a tier's priority, higher first): step 9
    for lane 0, one step ahead per 10 of priority, step 0 from 90 up. A task sent again by a
    hand-over (lane unknown) is late already: step 0."""
    if lane < 0:
        return 0
    return PRIORITY_STEPS[-1] - min(lane, 90) // 10
