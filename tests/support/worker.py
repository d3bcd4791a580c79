"""A real Celery worker process run to its exit: for the tests of a worker that must not
start (a sampler that cannot load)."""

from __future__ import annotations

import os
import subprocess

from devstack.stack import ROOT
from tests.support import unique_queue
from workers.launch import worker_command, worker_environment


def worker_output_at_exit(redis_url: str, label: str, **settings: str) -> tuple[int, str]:
    """Starts `python -m celery worker` as workers.launch does, with `settings` over this
    process's environment and a queue of its own; its exit status and output once it exits
    (within 2 minutes)."""
    base = {**os.environ, "REDIS_URL": redis_url, **settings}
    env = worker_environment(None, {**base, "SAMPLING_QUEUE": unique_queue(label)})
    env["PYTHONPATH"] = str(ROOT)
    worker = subprocess.run(
        worker_command(None, env["SAMPLING_QUEUE"]),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return worker.returncode, worker.stdout + worker.stderr
