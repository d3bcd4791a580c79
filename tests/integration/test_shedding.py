"""Front-end shedding on a real stack: a request that waited its deadline before it reached
its view, and one over a process's in-flight bound, get a fast 503 before any Redis call."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from batching.aggregator import BatchAggregator
from bench.harness.stalled import StalledWorker
from devstack.stack import Stack
from tests.support.http import request, sample
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

DEADLINE_MS = 2000


def shed_count(stack: Stack, reason: str) -> float:
    body = request(stack.base_url, "/metrics", method="GET").body
    prefix = f'sampling_shed_requests_total{{reason="{reason}"}} '
    return sum(float(line[len(prefix) :]) for line in body.splitlines() if line.startswith(prefix))


def test_a_request_that_waited_its_deadline_upstream_gets_a_fast_503(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack(
        "shed-late", env={"SAMPLER": "simulated", "SAMPLING_DEADLINE_MS": str(DEADLINE_MS)}
    )
    waited_s = DEADLINE_MS / 1000 - 0.01
    for endpoint, body in [
        ("/sample", "late"),
        ("/v1/completions", '{"prompt": "late"}'),
        ("/api/inference", '{"prompt": "late"}'),
    ]:
        stamp = f"t={(time.time() - waited_s) * 1_000_000:.0f}"  # us, as a balancer writes it
        started = time.monotonic()
        reply = request(stack.base_url, endpoint, body, headers={"X-Request-Start": stamp})
        assert reply.status == 503, (endpoint, reply.body)
        assert time.monotonic() - started < 0.2
        assert int(reply.headers["retry-after"]) >= 1
    assert shed_count(stack, "late") == 3
    # The same header a moment old: served, its deadline counted from it.
    fresh = f"t={time.time():.3f}"
    reply = sample(stack.base_url, "on time", headers={"X-Request-Start": fresh})
    assert (reply.status, reply.body) == (200, expected_completion("on time"))


def test_one_request_over_the_in_flight_bound_gets_a_fast_503(
    start_stack: Callable[..., Stack],
) -> None:
    bound = 3
    # The queue's one worker is stalled: every admitted request waits its whole deadline.
    stack = start_stack(
        "shed-in-flight",
        env={"WEB_MAX_IN_FLIGHT": str(bound), "SAMPLING_DEADLINE_MS": str(DEADLINE_MS)},
        gpus=[],
    )
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    pending = BatchAggregator(client, stack.env["SAMPLING_QUEUE"]).shards[0].pending
    stalled = StalledWorker(stack.env["REDIS_URL"], stack.env["SAMPLING_QUEUE"])
    with stalled, ThreadPoolExecutor(bound) as pool:
        wait_until(lambda: request(stack.base_url, "/readyz", method="GET").status == 200)
        waiting = [pool.submit(sample, stack.base_url, f"wait {i}") for i in range(bound)]
        # All three in their views: each has joined the open batch, which no worker seals.
        wait_until(lambda: client.llen(pending) == bound, 5, "every request in its view")
        started = time.monotonic()
        refused = sample(stack.base_url, "one too many")
        assert refused.status == 503, refused.body
        assert time.monotonic() - started < 0.2
        assert [future.result().status for future in waiting] == [504] * bound
        assert shed_count(stack, "in_flight") == 1
        # The bound frees as requests end.
        assert sample(stack.base_url, "after", timeout=5).status == 504


def test_a_request_with_less_time_left_than_the_models_quickest_answers_gets_a_fast_503(
    start_stack: Callable[..., Stack],
) -> None:
    call_ms = 300
    stack = start_stack(
        "shed-least-work",
        env={
            "SAMPLER": "simulated",
            "SIMULATED_BATCH_MS": str(call_ms),
            "SAMPLING_DEADLINE_MS": str(DEADLINE_MS),
        },
        web_processes=1,  # every answer below teaches the one process that serves the probe
    )

    def probe(left_ms: int) -> tuple[int, str, float]:
        """A request stamped as having waited its deadline less `left_ms`."""
        stamp = f"t={time.time() - (DEADLINE_MS - left_ms) / 1000:.3f}"
        started = time.monotonic()
        reply = sample(stack.base_url, "probe", headers={"X-Request-Start": stamp})
        return reply.status, reply.body, time.monotonic() - started

    seen: list[tuple[int, str, float]] = []

    def refused_after_a_burst() -> bool:
        # 30 answers of at least a call each, then at once a request with less time left
        # than a call: before, it was admitted and could only end 504.
        with ThreadPoolExecutor(30) as pool:
            replies = list(pool.map(lambda i: sample(stack.base_url, f"burst {i}"), range(30)))
        assert {reply.status for reply in replies} == {200}
        seen.append(probe(call_ms // 2))
        return seen[-1][0] == 503

    wait_until(refused_after_a_burst, 30, "a probe refused after a burst")
    assert {status for status, _, _ in seen} <= {503, 504}, seen
    _, body, took_s = seen[-1]
    assert body.startswith("overloaded: predicted"), body
    assert took_s < 0.2
    # Time enough for a call and more: served.
    assert probe(call_ms * 4)[:2] == (200, expected_completion("probe"))
