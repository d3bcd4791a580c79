"""An offline job through faults: its worker killed (SIGKILL) in the middle of the job, then
its Redis restarted with no data. The job completes, and every custom_id is in its output
exactly once. The same with Redis restarted with its data less its last writes. A feeder run
that failed (Redis away) keeps the feeder's lock: with Redis back with its data, the next job
is fed within seconds, not once the lock's TTL has run out. A feeder killed while it
finalizes a job: the next one finalizes it again."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable, Iterator

import pytest
import redis
from openai import OpenAI

from batching.keys import QueueKeys, ShardKeys, shard_tags
from devstack.embedded_redis import EmbeddedRedis
from devstack.stack import Stack
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
CUT_ITEMS = 300  # the lane's last pushed items a Redis restart is made to lose
# A job of a few lines after a failed feeder run: fed and done within this, well inside the
# feeder lock's TTL (SAMPLING_FEEDER_LOCK_TTL_S, 60 s) that a locked-out feeder waited for.
FED_WITHIN_S = 15
# The feeder lock's TTL where a test waits for it to pass to another feeder.
LOCK_TTL_S = 8
# A job whose finalization takes long enough to be caught in it, and the tries at that.
FINALIZED_LINES = 20_000
FINALIZING_TRIES = 3


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture
def durable_redis() -> Iterator[EmbeddedRedis]:
    """A Redis that keeps its data across a kill (every write in its append-only file)."""
    server = EmbeddedRedis(extra_args=["--appendonly", "yes", "--appendfsync", "always"]).start()
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


def test_a_job_loses_no_line_to_a_redis_restarted_with_its_data(
    start_stack: Callable[..., Stack],
    durable_redis: EmbeddedRedis,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Redis restarted with its data, its last writes lost (as an AOF cut loses them): the
    lane's last pushed items are removed first, so the loss is certain. The epoch stays, so
    only reconciliation can find those lines; the job completes without waiting for expiry."""
    stack = batch_stack(
        start_stack, "batch-aof", tmp_path_factory.mktemp("files"),
        REDIS_URL=durable_redis.url, SAMPLING_BACKFILL_TAKEN_TIMEOUT_S=str(TAKEN_TIMEOUT_S),
    )  # fmt: skip
    client = keyed_client(stack)
    model = stack.env["SAMPLING_QUEUE"]
    lines = chat_lines(model, LINES, "aof")
    job = create(client, lines)
    wait_until(lambda: completed(client.batches.retrieve(job.id)) >= LINES // 8, 30, "under way")
    direct = redis.Redis.from_url(durable_redis.url)
    (lane,) = [ShardKeys(tag).backfill for tag in shard_tags(model, 1)]
    # Cut as soon as items wait (a busy machine's feeder may leave the lane empty a moment).
    wait_until(lambda: direct.rpop(lane, CUT_ITEMS), 30, "items waiting in the lane, cut")
    durable_redis.kill()
    durable_redis.start()  # with its data, the epoch included: less the items cut
    done = ended(client, job.id, timeout_s=TAKEN_TIMEOUT_S + 60)
    assert done.status == "completed", done
    output = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in output) == sorted(line["custom_id"] for line in lines)
    assert completed(done) == LINES


def test_a_failed_feeder_run_keeps_its_lock(
    start_stack: Callable[..., Stack],
    durable_redis: EmbeddedRedis,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    stack = batch_stack(
        start_stack, "feeder-lock", tmp_path_factory.mktemp("files"), REDIS_URL=durable_redis.url
    )
    client = keyed_client(stack)
    model = stack.env["SAMPLING_QUEUE"]
    assert ended(client, create(client, chat_lines(model, 10, "before")).id).status == "completed"
    assert stack.log_dir is not None
    feeder_log = stack.log_dir / "feeder.log"
    durable_redis.kill()
    wait_until(lambda: "cannot feed offline jobs" in feeder_log.read_text(), 10, "a failed run")
    durable_redis.start()  # with its data: the feeder's lock too, with most of its TTL
    lock = QueueKeys(model).feeder_lock
    assert redis.Redis.from_url(durable_redis.url).pttl(lock) > FED_WITHIN_S * 1000
    done = ended(client, create(client, chat_lines(model, 10, "after")).id, FED_WITHIN_S)
    assert done.status == "completed", done


def test_a_feeder_killed_while_it_finalizes_a_job_is_followed_by_one_that_finishes_it(
    start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory
) -> None:
    stack = batch_stack(
        start_stack, "finalizing", tmp_path_factory.mktemp("files"),
        SAMPLING_FEEDER_LOCK_TTL_S=str(LOCK_TTL_S),
    )  # fmt: skip
    client = keyed_client(stack)
    model = stack.env["SAMPLING_QUEUE"]
    for attempt in range(FINALIZING_TRIES):
        lines = chat_lines(model, FINALIZED_LINES, f"finalizing-{attempt}")
        job = create(client, lines)
        found = wait_until(functools.partial(_finalizing, client, job.id), 120, "finalizing")
        assert stack.feeder is not None
        if found == "finalizing":
            os.kill(stack.feeder.pid, signal.SIGKILL)
            stack.feeder.wait(timeout=10)
            if client.batches.retrieve(job.id).status == "finalizing":
                break  # killed in the middle of it
            stack.start_feeder()  # too late: the job had completed
    else:
        pytest.fail(f"the feeder was never killed while it finalized, in {FINALIZING_TRIES} jobs")
    stack.start_feeder()
    # The killed feeder's lock holds the new one off until it expires.
    done = ended(client, job.id, timeout_s=LOCK_TTL_S + FED_WITHIN_S)
    assert done.status == "completed", done
    output = records(client, done.output_file_id)
    assert [r["custom_id"] for r in output] == [line["custom_id"] for line in lines]
    assert completed(done) == FINALIZED_LINES


def _finalizing(client: OpenAI, batch_id: str) -> str:
    """The job's status once it is finalizing or completed; "" before."""
    status = client.batches.retrieve(batch_id).status
    return status if status in ("finalizing", "completed") else ""
