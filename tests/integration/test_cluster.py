"""The request path on a real 3-master Valkey cluster, the Celery broker on a plain Redis beside
it: SAMPLING_REDIS_URL + SAMPLING_REDIS_CLUSTER=1, SAMPLING_SHARDS=6, CELERY_BROKER_URL.

Every answer must reach its own request, batches must come from every shard and every master
must run the hot path; a master killed under load answers its shards' requests with a fast
503 while the other shards keep serving, and the service recovers when it returns.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis.crc import key_slot

from batching.aggregator import BatchAggregator
from batching.keys import ShardKeys, tag_of
from batching.topology import redis_client
from devstack.embedded_cluster import EmbeddedCluster
from devstack.embedded_redis import EmbeddedRedis
from devstack.stack import Stack
from serving.redis_client import MAX_CONNECTIONS_PER_PROCESS, connect
from tests.support.bursts import burst_until_answered
from tests.support.http import Reply, sample
from tests.support.queue_views import batch_log_of
from tests.support.waiting import wait_until

SHARDS = 6
DEADLINE_MS = 3000  # 6 shards' batches queue for 3 workers: nothing here is about the deadline


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(masters=3).start() as started:
        yield started


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def farm(
    cluster: EmbeddedCluster, broker: EmbeddedRedis, start_stack: Callable[..., Stack]
) -> Stack:
    return start_stack(
        "cluster",
        env={
            "REDIS_URL": broker.url,
            "CELERY_BROKER_URL": broker.url,
            "SAMPLING_REDIS_URL": cluster.url,
            "SAMPLING_REDIS_CLUSTER": "1",
            "SAMPLING_SHARDS": str(SHARDS),
            "SAMPLER": "simulated",
            "SIMULATED_BATCH_MS": "50",
            "SAMPLING_DEADLINE_MS": str(DEADLINE_MS),
        },
        gpus=[0, 1, 2],
        web_processes=2,
    )


def aggregator_of(farm: Stack, cluster: EmbeddedCluster) -> BatchAggregator:
    client = redis_client(cluster.url, cluster=True)
    return BatchAggregator(client, farm.env["SAMPLING_QUEUE"], shards=SHARDS)


def master_of(cluster: EmbeddedCluster, keys: ShardKeys) -> int:
    return cluster.node_index_for_slot(key_slot(keys.open_batch.encode()))


def test_every_request_gets_its_own_completion_from_every_shard_and_master(
    farm: Stack, cluster: EmbeddedCluster
) -> None:
    aggregator = aggregator_of(farm, cluster)
    rpush_before = [
        cluster.client(i).info("commandstats").get("cmdstat_rpush", {}).get("calls", 0)
        for i in range(len(cluster.nodes))
    ]
    prompts = [f"cluster prompt {i} of a burst" for i in range(600)]
    burst_until_answered(farm.base_url, prompts)

    records = [json.loads(raw) for raw in batch_log_of(aggregator).recent()]
    served_tags = {tag_of(record["batch_id"]) for record in records if record["size"]}
    assert served_tags == {keys.tag for keys in aggregator.shards}  # batches from every shard
    masters = {master_of(cluster, keys) for keys in aggregator.shards}
    assert masters == set(range(len(cluster.nodes)))  # the shards spread over every master
    rpush_after = [
        cluster.client(i).info("commandstats").get("cmdstat_rpush", {}).get("calls", 0)
        for i in range(len(cluster.nodes))
    ]
    # Every master ran requests' appends (the RPUSH of the append).
    assert all(after > before for before, after in zip(rpush_before, rpush_after, strict=True))


def test_a_dead_master_fails_its_shards_fast_and_the_others_keep_serving(
    farm: Stack, cluster: EmbeddedCluster
) -> None:
    aggregator = aggregator_of(farm, cluster)
    queue_master = cluster.node_index_for_slot(key_slot(aggregator.keys.policy.encode()))
    victim = next(i for i in range(len(cluster.nodes)) if i != queue_master)
    victim_tags = {keys.tag for keys in aggregator.shards if master_of(cluster, keys) == victim}
    assert victim_tags  # two of the six shards live there

    replies: list[tuple[float, Reply]] = []
    stop = threading.Event()

    def load(lane: int) -> None:
        n = 0
        while not stop.is_set():
            started = time.monotonic()
            reply = sample(farm.base_url, f"lane {lane} request {n}")
            replies.append((started, reply))
            n += 1
            time.sleep(0.02)  # duration: a lane's pace

    lanes = [threading.Thread(target=load, args=(lane,)) for lane in range(8)]
    for lane in lanes:
        lane.start()

    def served_after(at: float) -> list[Reply]:
        return [reply for started, reply in list(replies) if started > at]

    try:
        wait_until(lambda: len(served_after(0)) >= 40, 10, "the load served")
        killed_at = time.monotonic()
        cluster.kill(victim)
        time.sleep(3.0)  # duration: the outage
        cluster.restart(victim)
        restarted_at = time.monotonic()
        # Recovered: the load's last requests are all served again.
        wait_until(
            lambda: (
                len(after := served_after(restarted_at)) >= 16
                and all(reply.status == 200 for reply in after[-16:])
            ),
            10,
            "16 requests in a row served after the restart",
        )
    finally:
        stop.set()
        for lane in lanes:
            lane.join()

    during = [reply for started, reply in replies if killed_at + 0.5 < started < restarted_at]
    statuses = Counter(reply.status for reply in during)
    assert statuses[200] > 0, statuses  # the other shards kept serving
    assert statuses[503] > 0, statuses  # the dead master's shards said so
    assert set(statuses) <= {200, 503}, statuses
    refused = [reply for reply in during if reply.status == 503]
    assert max(reply.seconds for reply in refused) < 0.5, "a 503 must be fast, not a timeout"
    assert all(reply.headers.get("retry-after") for reply in refused)
    for _, reply in replies:  # nothing anywhere waited past its deadline
        assert reply.seconds < DEADLINE_MS / 1000 + 0.5, reply

    # Recovered: each prompt of a burst after the restart gets its own completion.
    prompts = [f"after the restart {i}" for i in range(120)]
    burst_until_answered(farm.base_url, prompts)


def test_a_cluster_client_refuses_a_dead_master_at_once(cluster: EmbeddedCluster) -> None:
    """The topology's cluster options: a command to a dead master's slot fails in
    milliseconds (no retries with back-off), and the other masters answer meanwhile."""
    client = redis_client(cluster.url, cluster=True)
    tags = {cluster.node_index_for_slot(key_slot(f"k{i}".encode())): f"k{i}" for i in range(200)}
    victim = len(cluster.nodes) - 1
    cluster.kill(victim)
    try:
        started = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            client.set(tags[victim], "x")
        assert time.monotonic() - started < 0.5
        for index, key in tags.items():
            if index != victim:
                assert client.set(key, "x")
    finally:
        cluster.restart(victim)


def test_a_web_process_cluster_client_waits_for_a_free_connection(
    cluster: EmbeddedCluster,
) -> None:
    """More calls at once on one master than a web process's pool holds: each waits for a
    connection, as on one Redis (redis-py's default cluster pool raised MaxConnectionsError at
    its limit, a 503 for a request a single Redis serves)."""
    client = connect(cluster.url, cluster=True)
    calls = MAX_CONNECTIONS_PER_PROCESS + 16
    key = "{pool-wait}nothing"  # one slot: one master's pool

    def hold_a_connection(_: int) -> object:
        return client.blpop([key], timeout=0.2)  # duration: holds its connection that long

    with ThreadPoolExecutor(calls) as pool:
        assert list(pool.map(hold_a_connection, range(calls))) == [None] * calls
