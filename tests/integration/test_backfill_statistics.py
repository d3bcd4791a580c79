"""A job beside a trickle of requests on a GPU whose calls grow with their rows: the
statistics page's mean call is the requests' calls' mean, not one swollen by the job's own
calls of 100 rows, and the job's share of the GPU's time shows on its own."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from batching.aggregator import BatchAggregator
from batching.policy import Policy
from devstack.stack import Stack
from operations import dashboard
from tests.support.batches import batch_stack, chat_lines, create, keyed_client
from tests.support.http import sample
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

EXTRA_WORDS = 40


@pytest.fixture(scope="module")
def curve(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    files = tmp_path_factory.mktemp("files")
    curve = {"SIMULATED_COST": "h100-graphs-135m", "SIMULATED_EXTRA_WORDS": str(EXTRA_WORDS),
             "SAMPLING_MAX_NEW_TOKENS": "16"}  # fmt: skip
    return batch_stack(start_stack, "bfstats", Path(files), 1, **curve)


def test_the_mean_call_is_the_requests_calls_mean_beside_a_job(curve: Stack) -> None:
    client = keyed_client(curve)
    queue = curve.env["SAMPLING_QUEUE"]
    job = create(client, chat_lines(queue, 3000, uuid.uuid4().hex[:6]))
    aggregator = BatchAggregator(redis.Redis.from_url(curve.env["REDIS_URL"]), queue)

    def records() -> list[dict[str, object]]:
        return [json.loads(raw) for raw in batch_log_of(aggregator).recent()]

    def job_alone() -> bool:  # the job's own calls of 100 lines: the GPU had no request
        return any(r["size"] == 0 and r["backfill"] == 100 for r in records())

    wait_until(job_alone, 60, "a call of the job's lines alone")

    def page_matches() -> bool:
        prompt = f"trickle {uuid.uuid4().hex[:6]}"  # a request a second
        reply = sample(curve.base_url, prompt)
        assert (reply.status, reply.body) == (200, expected_completion(prompt, EXTRA_WORDS))
        time.sleep(max(0.0, 1.0 - reply.seconds))  # duration: the trickle's pace
        requests = [float(str(r["sampler_ms"])) for r in records() if int(str(r["size"])) > 0]
        shown = dashboard.build(aggregator.client, queue, Policy()).recent
        mean = shown.mean_sampler_ms()
        return (len(requests) >= 5 and mean is not None
                and abs(mean - statistics.mean(requests)) <= 0.02 * statistics.mean(requests)
                and (shown.backfill_busy_percent() or 0) > 0)  # fmt: skip

    wait_until(page_matches, 90, "the page's mean call is the requests' calls' mean")
    client.batches.cancel(job.id)
