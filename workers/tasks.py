"""Celery tasks: thin wrappers that take JSON primitives and call domain code."""

from __future__ import annotations

from celery import shared_task

from workers.lifecycle import current_runner


@shared_task(name="sampling.run_batch")
def run_batch(batch_id: str, queue: str) -> list[list[str]]:
    """Seal batch `batch_id` of `queue`, sample it, and return one [outcome, text] per item."""
    return current_runner(queue).run(batch_id)
