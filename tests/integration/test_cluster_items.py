"""A request's items, its rate limit and its cache lookups in one script call on a Redis
cluster: every key the call names or builds lives on its shard's slot, on every shard."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from batching.aggregator import BatchAggregator
from batching.ratelimit import RateCounter
from batching.topology import redis_client
from inference_site.lib.embedded_cluster import EmbeddedCluster
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
        counter = RateCounter(keys.requests_counter(7, 1), 60_000)
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
