"""Names that existing installations hold, kept as they were when the whole service was one
app called "sampling" (its HTTP package is `serving/` now). A rename here breaks an upgrade:
a rolling upgrade runs old and new processes on one Redis and one broker, a Redis restarted
with its data keeps its keys, and a database keeps its tables and migration history.
tests/unit/test_installed_names.py pins them, with every Redis key and metric name built from
them, against a recorded list."""

from __future__ import annotations

# Every Redis key begins with it (batching.keys builds them all).
REDIS_KEY_PREFIX = "sampling"
# The batch task's Celery name: queued messages and the older release's workers carry it.
RUN_BATCH_TASK = "sampling.run_batch"
# The operations app's Django label: its tables (sampling_*), migration history, content
# types, permissions and admin URLs (/admin/sampling/...).
OPERATIONS_APP_LABEL = "sampling"
# Every Prometheus metric begins with it: dashboards and alert rules query these names. Each
# metric spells its whole name where it is declared; the pin test checks the prefix.
METRIC_PREFIX = "sampling_"
