"""The designs a Celery user would pick instead of ours, for `python -m bench compare`.

Small, honest implementations on the same simulated sampler, the same Redis, the same Celery
workers (one per simulated GPU, solo pool) and the same gunicorn as the product; not part of
the product. Served by bench.baselines.settings, which adds their URLs and tasks to the
product's settings:

  POST /baseline/per-request     one Celery task per request (no batching)
  POST /baseline/celery-batches  celery-batches' Batches task: flush_every=100 or a timer
  POST /baseline/timer           a batcher in each web process: T ms after its first
                                 request, or at 100 requests
"""

from __future__ import annotations


def calls_key(queue: str) -> str:
    """The Redis list where the baselines' workers record each sampler call."""
    return f"bench:{queue}:calls"
