"""The throw-away Valkey cluster (devstack/embedded_cluster.py) under redis-py's
RedisCluster: keys, scripts and sharded pub/sub on every master, and a master that dies
and comes back. Prints how long RedisCluster takes to give up on a dead master."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from devstack.embedded_cluster import EmbeddedCluster

pytestmark = pytest.mark.integration

MASTERS = 3
# Fail fast on a dead or hung master: one try, no retry (redis-py's default is 10 retries,
# each a topology refresh, and 5 s socket timeouts), half a second to connect or answer.
FAST: dict[str, Any] = {
    "retry": Retry(NoBackoff(), 0),
    "socket_connect_timeout": 0.5,
    "socket_timeout": 0.5,
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    started = time.monotonic()
    with EmbeddedCluster(masters=MASTERS) as running:
        print(f"\ncluster of {MASTERS} masters up in {time.monotonic() - started:.2f} s")
        yield running


@pytest.fixture
def client(cluster: EmbeddedCluster) -> Iterator[RedisCluster]:
    with RedisCluster.from_url(cluster.url, decode_responses=True) as connected:
        yield connected


def tag_on(cluster: EmbeddedCluster, index: int, label: str = "t") -> str:
    """A hash tag whose slot node `index` owns."""
    n = 0
    while cluster.node_index_for_slot(key_slot(f"{label}{n}".encode())) != index:
        n += 1
    return f"{{{label}{n}}}"


def timed(call: Callable[[], object]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_keys_are_spread_over_every_master(cluster: EmbeddedCluster, client: RedisCluster) -> None:
    assert len(cluster.urls) == MASTERS
    assert client.cluster_info()["cluster_state"] == "ok"
    for index in range(MASTERS):
        tag = tag_on(cluster, index, "keys")
        for field_ in ("a", "b", "c"):
            key = f"{tag}:{field_}"
            client.set(key, f"{index}-{field_}")
            assert cluster.node_index_for_slot(client.cluster_keyslot(key)) == index
        assert client.mget([f"{tag}:a", f"{tag}:b"]) == [f"{index}-a", f"{index}-b"]
    for index in range(MASTERS):
        with cluster.client(index, decode_responses=True) as node:
            assert node.dbsize() >= 3  # every master holds keys of its own
            assert node.get(f"{tag_on(cluster, index, 'keys')}:c") == f"{index}-c"


def test_scripts_run_on_every_master(cluster: EmbeddedCluster, client: RedisCluster) -> None:
    bump = client.register_script(
        "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('INCRBY', KEYS[2], ARGV[1])"
    )
    for index in range(MASTERS):
        tag = tag_on(cluster, index, "script")
        assert bump(keys=[f"{tag}:last", f"{tag}:total"], args=[5]) == 5
        assert bump(keys=[f"{tag}:last", f"{tag}:total"], args=[2]) == 7  # EVALSHA, cached
        with cluster.client(index, decode_responses=True) as node:
            assert node.get(f"{tag}:total") == "7"
            assert node.script_exists(bump.sha) == [True]


def test_sharded_pubsub_on_the_owning_node(cluster: EmbeddedCluster, client: RedisCluster) -> None:
    for index in range(MASTERS):
        channel = f"{tag_on(cluster, index, 'chan')}:events"
        owner = cluster.node_index_for_slot(key_slot(channel.encode()))
        assert owner == index
        with cluster.client(owner, protocol=2, decode_responses=True) as node:
            pubsub = node.pubsub()
            pubsub.ssubscribe(channel)
            confirm = pubsub.get_message(timeout=2)
            assert confirm is not None
            assert confirm["type"] == "ssubscribe"
            assert client.spublish(channel, f"hello {index}") == 1
            message = pubsub.get_sharded_message(timeout=2)
            assert message is not None
            assert (message["type"], message["channel"]) == ("smessage", channel)
            assert message["data"] == f"hello {index}"
            pubsub.close()


def test_a_dead_master_fails_its_slots_only(cluster: EmbeddedCluster, client: RedisCluster) -> None:
    dead = 1
    tags = [tag_on(cluster, index, "dead") for index in range(MASTERS)]
    fast = RedisCluster.from_url(cluster.url, decode_responses=True, **FAST)
    for tag in tags:
        client.set(f"{tag}:k", "before")
    cluster.kill(dead)
    try:
        for name, each in (("default", client), ("fast", fast)):
            started = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                each.get(f"{tags[dead]}:k")
            print(f"{name} client: GET on the dead master failed in "
                  f"{(time.monotonic() - started) * 1000:.1f} ms")  # fmt: skip
            live = [
                timed(partial(each.set, f"{tag}:k", "during"))
                for tag in tags
                if tag != tags[dead]
                for _ in range(20)
            ]
            assert max(live) < 0.5, live
            print(f"{name} client: live masters' SETs max {max(live) * 1000:.2f} ms")
        for index, tag in enumerate(tags):
            if index != dead:
                assert client.get(f"{tag}:k") == "during"
        with pytest.raises(redis.ConnectionError):
            fast.set(f"{tags[dead]}:k", "during")
    finally:
        started = time.monotonic()
        cluster.restart(dead)
        print(f"restarted master {dead}, cluster ok again in {time.monotonic() - started:.2f} s")
    # It rejoins with its slots; what it held is gone (no persistence: --save "").
    assert client.get(f"{tags[dead]}:k") is None
    client.set(f"{tags[dead]}:k", "after")
    assert fast.get(f"{tags[dead]}:k") == "after"
    assert cluster.node_index_for_slot(client.cluster_keyslot(f"{tags[dead]}:k")) == dead
    fast.close()


def test_a_hung_master_costs_one_socket_timeout(cluster: EmbeddedCluster) -> None:
    """A frozen master (SIGSTOP: connections are accepted, nothing answers) is what a dead
    remote host looks like; with redis-py's defaults a GET to it takes 11 tries x 5 s."""
    hung = 2
    process = cluster.nodes[hung].process
    assert process is not None
    tags = [tag_on(cluster, index, "hung") for index in range(MASTERS)]
    with RedisCluster.from_url(cluster.url, decode_responses=True, **FAST) as fast:
        for tag in tags:
            fast.set(f"{tag}:k", "before")
        os.kill(process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                fast.get(f"{tags[hung]}:k")
            took = time.monotonic() - started
            print(f"fast client: GET on the hung master failed in {took * 1000:.0f} ms")
            assert took < 2
            live = [timed(partial(fast.get, f"{tag}:k")) for tag in tags[:hung] for _ in range(20)]
            assert max(live) < 0.5, live
        finally:
            os.kill(process.pid, signal.SIGCONT)
        cluster.wait_healthy()
        assert fast.get(f"{tags[hung]}:k") == "before"  # it was frozen, not killed
