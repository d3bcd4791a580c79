"""Every master of the cluster killed at once, then restarted: every periodic loop of every
process runs again (the key and policy watchers and the statistics flush of each web process,
the worker's heartbeat, policy watcher and hand-over scan). In cluster mode redis-py raises
RedisClusterException, not a RedisError, when no node answers: loops that caught only
RedisError died with the outage, and a key created afterwards stayed refused for good; and
requests that met it were answered 500, not 503. Every request the test sends, during the
outage and after it, gets anything but a 500."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from batching.aggregator import BatchAggregator
from batching.policy import Policy, publish
from batching.topology import redis_client
from devstack.embedded_cluster import EmbeddedCluster
from devstack.embedded_redis import EmbeddedRedis
from devstack.stack import Stack
from telemetry.stats import SECOND, merge, read_buckets
from tests.support.http import Reply, request, sample
from tests.support.keys import bearer, create_key
from tests.support.queue_views import workers_of
from tests.support.waiting import wait_until
from workers.samplers.simulated import expected_completion

pytestmark = pytest.mark.integration

OUTAGE_S = 3.0
PROPAGATION_S = 2.0  # a key created afterwards works everywhere within this long
# A loop's later runs, after the cluster formed again: a read that met a node still joining
# may wait out its socket timeout (5 s) once; a loop that died never gets there.
RECOVERY_S = 10.0


@pytest.fixture
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(masters=3).start() as started:
        yield started


@pytest.fixture
def broker() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


SEEN: list[tuple[str, int]] = []  # the path and status of every request of the test


def ask(stack: Stack, key: str, prompt: str = "E equals ") -> Reply:
    reply = sample(stack.base_url, prompt, headers=bearer(key))
    SEEN.append(("/sample", reply.status))
    return reply


@contextlib.contextmanager
def logs_on_failure(stack: Stack) -> Iterator[None]:
    """An AssertionError inside carries the end of the processes' logs: which loop did not
    run again, and what it met."""
    try:
        yield
    except AssertionError as failure:
        assert stack.log_dir is not None
        tails = [
            f"--- {log.name}:\n" + "\n".join(log.read_text().splitlines()[-40:])
            for log in sorted(stack.log_dir.glob("*.log"))
        ]
        raise AssertionError("\n".join([str(failure), *tails])) from failure


def every_process_answers(stack: Stack, key: str, status: int, prompt: str = "E equals ") -> bool:
    """8 requests in a row (spread over the web processes) all got `status`."""
    return all(ask(stack, key, prompt).status == status for _ in range(8))


def test_every_loop_of_every_process_runs_again_after_every_master_died(
    cluster: EmbeddedCluster, broker: EmbeddedRedis, start_stack: Callable[..., Stack]
) -> None:
    stack = start_stack(
        "cluster-outage",
        env={
            "REDIS_URL": broker.url,
            "CELERY_BROKER_URL": broker.url,
            "SAMPLING_REDIS_URL": cluster.url,
            "SAMPLING_REDIS_CLUSTER": "1",
            "SAMPLING_SHARDS": "3",
            "SAMPLER": "simulated",
            "SAMPLING_REQUIRE_API_KEY": "1",
        },
        gpus=[0],
        web_processes=2,
    )
    queue = stack.env["SAMPLING_QUEUE"]
    client = redis_client(cluster.url, cluster=True)
    aggregator = BatchAggregator(client, queue, shards=3)
    before = create_key(stack, "before the outage")
    wait_until(lambda: every_process_answers(stack, before, 200), 10, "the first key everywhere")

    SEEN.clear()
    for index in range(cluster.masters):
        cluster.kill(index)
    outage_ends = time.monotonic() + OUTAGE_S
    # Requests meanwhile: statistics and keys' last use pile up for flushes that fail.
    while time.monotonic() < outage_ends:
        reply = ask(stack, before)
        assert reply.status == 503, reply.body
        assert reply.headers.get("retry-after") == "1"
        for path in ("/v1/models", "/v1/usage", "/readyz", "/metrics"):  # the GET endpoints too
            got = request(stack.base_url, path, method="GET", headers=bearer(before))
            SEEN.append((path, got.status))
        # The model list needs no Redis: served, without the workers' figures.
        assert SEEN[-4] == ("/v1/models", 200)
        time.sleep(0.1)  # duration: a trickle of requests over the outage
    for node in cluster.nodes:
        node.start()
    # Requests while the cluster forms again, until they are served.
    wait_until(lambda: ask(stack, before).status == 200, 20, "served again after the restart")
    cluster.wait_healthy()
    restarted_at = time.time()

    # The key watcher of every web process: a key created now works everywhere within 2 s.
    after = create_key(stack, "after the outage")
    created_at = time.monotonic()
    wait_until(lambda: every_process_answers(stack, after, 200), PROPAGATION_S + 3, "new key")
    assert time.monotonic() - created_at < PROPAGATION_S
    prompt = f"E equals {uuid.uuid4().hex[:6]} "
    assert ask(stack, after, prompt).body == expected_completion(prompt)

    # The worker's heartbeat.
    def worker_info() -> dict[str, Any]:
        infos = workers_of(aggregator).infos(time.time() - 60)
        assert len(infos) == 1, infos
        return infos[0][1]

    wait_until(lambda: worker_info()["heartbeat_at"] > restarted_at, 5, "a heartbeat after")

    # The statistics flush of the web processes: the requests since the restart are counted.
    def ok_since_restart() -> int:
        end = int(time.time()) + 1
        counts = merge(c for _, c in read_buckets(client, queue, SECOND, int(restarted_at), end))
        return counts["req:ok"]

    wait_until(lambda: ok_since_restart() >= 9, 5, "the requests since the restart flushed")

    # The policy watcher of every process: a policy published now applies in each web process
    # (a long prompt refused) and in the worker (its heartbeat reports the version).
    assert publish(client, queue, Policy(max_prompt_bytes=16, version=7))
    long_prompt = "E equals " + "x" * 32

    def web_applies() -> bool:
        # Housekeeping withdraws a policy with no database row, as this one (published
        # straight to Redis) is, once its loop runs again: publish it again meanwhile.
        publish(client, queue, Policy(max_prompt_bytes=16, version=7))
        return every_process_answers(stack, after, 400, long_prompt)

    with logs_on_failure(stack):
        wait_until(web_applies, RECOVERY_S, "new policy")

        def worker_applies() -> bool:
            publish(client, queue, Policy(max_prompt_bytes=16, version=7))  # as for the web
            return bool(worker_info()["policy_version"] == 7)

        wait_until(worker_applies, RECOVERY_S, "the worker applies")

    # Every loop that failed said once that it runs again (the hand-over scan's only trace).
    assert stack.log_dir is not None
    worker_log = (stack.log_dir / "worker-0.log").read_text()
    web_log = (stack.log_dir / "web.log").read_text()
    for loop in ("heartbeat", "handover", "policy-watcher"):
        assert f"{loop} runs again after" in worker_log, loop
    for loop in ("access-watcher", "catalog-watcher", "model-watcher", "stats-flush"):
        assert f"{loop} runs again after" in web_log, loop
    assert worker_log.count("cannot send the heartbeat") == 1  # once per outage
    assert [seen for seen in SEEN if seen[1] >= 500 and seen[1] != 503] == []
    assert stack.web is not None
    assert all(process.poll() is None for process in [stack.web, *stack.workers])
