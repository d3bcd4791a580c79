"""The simulated stack every benchmark measures: Redis, Celery workers with the simulated
sampler and gunicorn, its environment written here once."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from accounts.access import POLL_INTERVAL_S
from devstack.stack import ROOT, Stack

__all__ = ["ROOT", "Stack", "make_api_keys", "new_queue", "simulated_env", "simulated_stack"]


def new_queue(prefix: str) -> str:
    """A queue name of its own for one stack, so runs on one Redis never meet."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def simulated_env(
    redis_url: str,
    queue: str,
    *,
    call_ms: int | None = None,
    max_batch: int | None = None,
    deadline_ms: int | None = None,
    log_level: str | None = "warning",
    **extra: str,
) -> dict[str, str]:
    """The settings of a stack whose workers run the simulated sampler: a call of `call_ms`
    (SIMULATED_BATCH_MS), batches of `max_batch`, `deadline_ms` deadlines (None: the
    service's defaults). `log_level` None keeps the service's (info: a line per task, whose
    cost the front-end figures have always included). `extra`: more settings, over these."""
    env = {
        "REDIS_URL": redis_url,
        "SAMPLER": "simulated",
        "SAMPLING_QUEUE": queue,
        "DJANGO_SECRET_KEY": "bench-only-" + uuid.uuid4().hex,
    }
    optional = {
        "SIMULATED_BATCH_MS": call_ms,
        "SAMPLING_MAX_BATCH_SIZE": max_batch,
        "SAMPLING_DEADLINE_MS": deadline_ms,
        "LOG_LEVEL": log_level,
    }
    env.update({name: str(value) for name, value in optional.items() if value is not None})
    return {**env, **extra}


def simulated_stack(
    env: Mapping[str, str],
    gpus: Sequence[int | None],
    *,
    root: Path = ROOT,
    web_processes: int = 2,
    log_dir: Path | None = None,
    worker_args: Sequence[str] = (),
) -> Stack:
    """A stack (not started) of `root`'s code with a migrated database of its own, its
    processes' output in `log_dir` (by default /tmp/bench-QUEUE)."""
    queue = env.get("SAMPLING_QUEUE", "bench")
    return Stack(
        env=dict(env),
        gpus=list(gpus),  # CUDA_VISIBLE_DEVICES only names them: the simulated sampler uses none
        web_processes=web_processes,
        worker_args=list(worker_args),
        root=root,
        log_dir=log_dir or Path("/tmp") / f"bench-{queue}",
        own_database=True,
    )


def make_api_keys(stack: Stack, keys: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """API keys made as an operator makes them (`manage.py createapikey NAME ARGS...`) in the
    stack's own database, once every web process has them (they republish the database's
    keys every POLL_INTERVAL_S)."""
    made = {}
    for name, arguments in keys.items():
        done = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "createapikey", name, *arguments],
            env=stack.environment(), capture_output=True, text=True, check=True,
        )  # fmt: skip
        made[name] = done.stdout.strip().splitlines()[-1]
    time.sleep(2 * POLL_INTERVAL_S + 0.5)
    return made
