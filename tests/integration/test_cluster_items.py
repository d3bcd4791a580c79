"""A request's items, its rate limit and its cache lookups in one script call on a Redis
cluster: every key the call names or builds lives on its shard's slot, on every shard."""

from __future__ import annotations

import json
from collections.abc import Iterator
from unittest import mock

import pytest
import redis
from redis.crc import key_slot

from batching.aggregator import BatchAggregator
from batching.join import AppendCounter
from batching.keys import LaneKeys
from batching.topology import WaitingPool, redis_client
from devstack.embedded_cluster import EmbeddedCluster
from tests.support import unique_queue

pytestmark = pytest.mark.integration

SHARDS = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster(masters=3).start() as started:
        yield started


def test_items_limit_and_cache_in_one_call_on_every_shard(cluster: EmbeddedCluster) -> None:
    client = redis_client(cluster.url, cluster=True)
    aggregator = BatchAggregator(client, unique_queue("items"), shards=SHARDS, max_batch_size=4)
    digest = "d" * 32
    with client.pipeline() as pipe:
        aggregator.queue_cached_answers(pipe, {digest: json.dumps(["ok", "cached"])}, 60_000)
        aggregator.queue_cache_version(pipe, 3)
        pipe.execute()
    for shard, keys in enumerate(aggregator.shards):
        counter = AppendCounter(keys.requests_counter(7, 1), 60_000)
        items = [(digest, "cached"), *[("", f"prompt {i}") for i in range(5)]]
        joined = aggregator.append_items(
            items, 500, shard, key_id=7, counter=counter, cost=6, limit=10, version=3
        )
        assert (joined.limited, joined.counted) == (False, 6)
        assert joined.tickets[0].cached is not None
        assert len({ticket.batch_id for ticket in joined.tickets[1:]}) == 2  # 4, then 1
        refused = aggregator.append_items(items, 500, shard, key_id=7, counter=counter, cost=6,
                                          limit=10)  # fmt: skip
        assert (refused.limited, refused.counted) == (True, 6)
        # An older policy's lookup is a miss.
        [stale] = aggregator.append_items(items[:1], 500, shard, version=2).tickets
        assert stale.cached is None


def test_a_request_whose_slot_moved_joins_on_its_new_master(cluster: EmbeddedCluster) -> None:
    """The append's MULTI goes straight to the master the client's slot table names; when the
    slot has moved since (resharding, a failover), that master answers MOVED, nothing is
    applied, and the request joins on the slot's new master, once."""
    client = redis_client(cluster.url, cluster=True)  # its slot table: read now
    aggregator = BatchAggregator(client, unique_queue("moved"), shards=1)
    keys = aggregator.shards[0]
    slot = key_slot(keys.open_batch.encode())
    owner = cluster.node_index_for_slot(slot)
    target = (owner + 1) % cluster.masters
    target_id = cluster.client(target).execute_command("CLUSTER MYID").decode()
    aggregator.append("E equals ", 500)  # what the process reads apart from its MULTI: read
    on_owner = cluster.client(owner)
    on_owner.delete(*on_owner.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100))
    for index in range(cluster.masters):  # an empty slot moves by SETSLOT alone
        cluster.client(index).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    try:
        ticket = aggregator.append("E equals ", 500)
        assert ticket.index == 0
        assert ticket.opened
        moved_to = cluster.client(target)
        assert moved_to.llen(LaneKeys.of(keys, 0).pending) == 1  # joined there, once
        assert client.get_node_from_key(keys.open_batch).port == cluster.ports[target]
        assert aggregator.append("E equals ", 500).index == 1  # straight there now
    finally:
        owner_id = cluster.client(owner).execute_command("CLUSTER MYID").decode()
        client.delete(keys.open_batch, LaneKeys.of(keys, 0).pending)
        for index in range(cluster.masters):
            cluster.client(index).execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner_id)


def test_a_busy_pool_is_not_taken_for_a_master_away(cluster: EmbeddedCluster) -> None:
    """A web process whose pool of a master has no free connection within its wait refuses
    the request (503), and leaves the cluster client's layout alone, on the append sent by
    hand and on redis-py's own commands alike: taken for a master away, a busy pool made
    redis-py read the layout again and drop the pools' free connections, more work for a
    process already too busy."""
    client = redis_client(
        cluster.url, cluster=True, max_connections=1, connection_pool_class=WaitingPool,
        timeout=0.05,
    )  # fmt: skip
    aggregator = BatchAggregator(client, unique_queue("busy"), shards=1)
    aggregator.append("E equals ", 500)  # the process's figures read: only the MULTI is left
    pointer = aggregator.shards[0].open_batch
    pool = client.get_node_from_key(pointer).redis_connection
    assert pool is not None
    held = pool.connection_pool.get_connection()  # another request's, for the whole test
    try:
        with mock.patch.object(
            client.nodes_manager, "initialize", wraps=client.nodes_manager.initialize
        ) as initialize:
            for _ in range(2 * client.reinitialize_steps):
                with pytest.raises(redis.ConnectionError):  # REDIS_FAULTS: a 503
                    aggregator.append("E equals ", 500)
                with pytest.raises(redis.ConnectionError):
                    client.get(pointer)  # redis-py's own path (a batch's close, its clock)
        assert initialize.call_count == 0
    finally:
        pool.connection_pool.release(held)
    assert aggregator.append("E equals ", 500).index == 1
