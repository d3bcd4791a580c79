"""An offline job through faults: its worker killed (SIGKILL) in the middle of the job, then
its Redis restarted with no data. The job completes, and every custom_id is in its output
exactly once."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import Stack
from tests.support.batches import (
    batch_stack,
    chat_lines,
    completed,
    create,
    ended,
    keyed_client,
    records,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

LINES = 8000  # 4 s of 50 ms calls of 100, for the faults to fall in the middle of it
TAKEN_TIMEOUT_S = 3  # what a killed worker's items wait before they go back


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


def test_a_job_survives_a_killed_worker_and_a_redis_restart(
    start_stack: Callable[..., Stack],
    own_redis: EmbeddedRedis,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    stack = batch_stack(
        start_stack, "batch-faults", tmp_path_factory.mktemp("files"),
        REDIS_URL=own_redis.url, SAMPLING_BACKFILL_TAKEN_TIMEOUT_S=str(TAKEN_TIMEOUT_S),
    )  # fmt: skip
    client = keyed_client(stack)
    lines = chat_lines(stack.env["SAMPLING_QUEUE"], LINES, "faults")
    job = create(client, lines)

    def progressed(at_least: int) -> bool:
        return completed(client.batches.retrieve(job.id)) >= at_least

    wait_until(lambda: progressed(LINES // 8), timeout_s=30, what="the job under way")
    worker = stack.workers[0]
    os.kill(worker.pid, signal.SIGKILL)  # mid-call, most likely: calls run back to back
    worker.wait(timeout=10)
    stack.restart_worker(0)
    wait_until(lambda: progressed(LINES // 2), timeout_s=60, what="the job under way again")
    own_redis.kill()
    own_redis.start()  # empty: the lanes, their taken items and answers are gone
    done = ended(client, job.id, timeout_s=120)
    assert done.status == "completed", done
    output = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(line["custom_id"] for line in lines)
    assert done.error_file_id is None
    assert completed(done) == LINES
