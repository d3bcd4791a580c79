from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

# Nothing is fetched from a model hub in the tests: set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
# The packaged model's GGUF conversion is kept for the session's processes (converted once, in
# its first load) and removed at its end: a run starts cold whatever an earlier run left.
if "SAMPLING_MODEL_CACHE" not in os.environ:
    os.environ["SAMPLING_MODEL_CACHE"] = tempfile.mkdtemp(prefix="sampling-model-cache-")
    atexit.register(shutil.rmtree, os.environ["SAMPLING_MODEL_CACHE"], True)

from devstack.embedded_redis import redis_url_or_embedded
from devstack.stack import ROOT, Stack
from tests.support import ADMIN_PASSWORD, ADMIN_USER, unique_queue

if TYPE_CHECKING:
    from workers.samplers.hf import HFSampler


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when set (a real server), else an embedded server on a free port."""
    with redis_url_or_embedded() as url:
        yield url


@pytest.fixture
def redis_client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def smollm2() -> HFSampler:
    """The packaged SmolLM2 GGUF in this process, greedy, 8 new tokens, as the service's
    SAMPLER=hf worker loads it: loaded once for the session (~25 s on 2 CPUs)."""
    import gc

    from workers.samplers.base import GenerationSettings
    from workers.samplers.hf import HFSampler

    sampler = HFSampler("", GenerationSettings(max_new_tokens=8))
    # As the worker does (workers/lifecycle.py): without this, every full collection in this
    # process scans the model's ~350,000 objects (~150 ms) and skews the timed tests' clients.
    gc.collect()
    gc.freeze()
    return sampler


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite database with an admin account, shared by the stacks' processes,
    made the way docs/operations/admin-and-statistics.md tells an operator to (manage.py
    migrate, createsuperuser)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'db.sqlite3'}"
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SUPERUSER_PASSWORD": ADMIN_PASSWORD}
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v0"], env=env, check=True)
    subprocess.run(
        [*manage, "createsuperuser", "--noinput", "--username", ADMIN_USER,
         "--email", "operator@example.com"],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return url


# Every stack started in this session, in order (start_stack appends).
STACKS: list[Stack] = []


@pytest.fixture(scope="module", autouse=True)
def stop_the_modules_stacks() -> Iterator[None]:
    """A module's stacks stop when it ends: idle stacks of earlier modules would otherwise
    share the two cores with every later test (the soak at the end lost a third of its
    answers to them)."""
    first = len(STACKS)
    yield
    for stack in STACKS[first:]:
        stack.stop()


@pytest.fixture(scope="session")
def start_stack(
    redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Stack]]:
    """Start a real stack (gunicorn + Celery workers) on the shared Redis; stopped at the end
    of its test module, or earlier by the test. Process logs are printed when a start fails."""
    started = STACKS

    def start(
        label: str, env: dict[str, str] | None = None, gpus: list[int | None] | None = None,
        web_processes: int = 1, timeout_s: float = 60, web_config: Path | None = None,
    ) -> Stack:  # fmt: skip
        log_dir = Path(tmp_path_factory.mktemp(label))
        stack = Stack(
            env={
                "REDIS_URL": redis_url,
                "DATABASE_URL": database_url,
                "SAMPLING_QUEUE": unique_queue(label),
                **(env or {}),
            },
            gpus=[None] if gpus is None else gpus,
            web_processes=web_processes,
            log_dir=log_dir,
        )
        if web_config is not None:
            stack.web_config = web_config
        started.append(stack)
        try:
            stack.start(timeout_s=timeout_s)
        except Exception:  # any failure to start: stop what did start, show the logs, re-raise
            stack.stop()
            for log in sorted(log_dir.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-4000:]}")
            raise
        return stack

    yield start
    for stack in started:
        stack.stop()
