"""What web processes and workers exchange through Celery.

A web process sends the batch task by name, so it never imports the worker's runtime; the
worker registers its task under the same name (workers/tasks.py).
"""

from __future__ import annotations

# The name predates the split into apps: queued messages and running workers keep it.
RUN_BATCH_TASK = "sampling.run_batch"
