from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import Stack


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when set (a real server), else an embedded server on a free port."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    server = EmbeddedRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def unique_queue(label: str) -> str:
    return f"t-{label}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def start_stack(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Stack]]:
    """Start a real stack (gunicorn + Celery workers) on the shared Redis; stopped at the end
    of the session, or earlier by the test. Process logs are printed when a start fails."""
    started: list[Stack] = []

    def start(
        label: str, env: dict[str, str] | None = None, gpus: list[int | None] | None = None,
        web_processes: int = 1,
    ) -> Stack:  # fmt: skip
        log_dir = Path(tmp_path_factory.mktemp(label))
        stack = Stack(
            env={"REDIS_URL": redis_url, "SAMPLING_QUEUE": unique_queue(label), **(env or {})},
            gpus=[None] if gpus is None else gpus,
            web_processes=web_processes,
            log_dir=log_dir,
        )
        started.append(stack)
        try:
            stack.start(timeout_s=60)
        except Exception:
            stack.stop()
            for log in sorted(log_dir.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-4000:]}")
            raise
        return stack

    yield start
    for stack in started:
        stack.stop()
