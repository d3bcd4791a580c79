"""The web process's CPU per `BatchAggregator.append`, the request's one Redis round trip.

    .venv/bin/python -m bench append_cost [--rounds 5] [--calls 5000] [--cluster]

Against a real Redis (embedded unless REDIS_URL is set), one process appends `--calls`
requests in a row and reads its own CPU time (user + system) per call, for:
  - append: the aggregator's MULTI, sent by hand on a pooled connection;
  - append (Pipeline): the same commands through redis-py's transaction Pipeline;
  - SET: one plain SET through the client, the cheapest round trip there is.
Rounds alternate between the cases and medians are printed: the machine is noisy. Batches
never fill (a max of 100 and a fresh queue per 90 calls): no CLOSE is counted. `--cluster`:
against a local 3-master cluster, through a cluster client (as SAMPLING_REDIS_CLUSTER=1).
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any
from unittest import mock

import redis

from batching import aggregator as aggregator_module
from batching import join as join_module
from batching.aggregator import BatchAggregator
from batching.keys import LaneKeys
from batching.ratelimit import RateCounter
from batching.topology import redis_client
from bench.harness.report import markdown_table
from bench.harness.stats import median
from devstack.embedded_cluster import EmbeddedCluster
from devstack.embedded_redis import redis_url_or_embedded


def pipelined_join(
    client: redis.Redis,
    cluster: bool,
    keys: LaneKeys,
    pointer: str,
    item: str,
    ttl_ms: int,
    read_admission: bool,
    counter: RateCounter | None,
) -> list[Any]:
    """batching.join.join's MULTI through redis-py's transaction Pipeline (a ClusterPipeline
    on a cluster client: how the append went to a cluster before it went to the node)."""
    with client.pipeline(transaction=True) as pipe:
        pipe.set(keys.open_batch, pointer, nx=True, get=True, px=ttl_ms)
        pipe.rpush(keys.pending, item)
        if read_admission:
            pipe.hget(keys.admission, keys.predicted)
        if counter is not None:
            pipe.incr(counter.key)
            if counter.expire_ms:
                pipe.pexpire(counter.key, counter.expire_ms)
        replies = list(pipe.execute())
    return replies[:-1] if counter is not None and counter.expire_ms else replies


PIPELINED = "append (Pipeline)"


def appender(client: redis.Redis) -> Callable[[int], None]:
    aggregators = [
        BatchAggregator(client, f"bench-append-{uuid.uuid4().hex[:8]}") for _ in range(64)
    ]

    def append(i: int) -> None:
        aggregators[(i // 90) % len(aggregators)].append("E equals ", 500)

    return append


def setter(client: redis.Redis) -> Callable[[int], None]:
    key = f"bench-append-set-{uuid.uuid4().hex[:8]}"
    return lambda i: client.set(key, "x")


def cpu_us_per_call(call: Callable[[int], None], calls: int) -> float:
    for i in range(200):  # warm: connections, scripts, caches
        call(i)
    started = time.process_time()
    for i in range(calls):
        call(i)
    return (time.process_time() - started) / calls * 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--cluster", action="store_true", help="on a local 3-master cluster")


def main(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as servers:
        if args.cluster:
            cluster = servers.enter_context(EmbeddedCluster(masters=3).start())
            client = redis_client(cluster.url, cluster=True)
        else:
            client = redis.Redis.from_url(servers.enter_context(redis_url_or_embedded()))
        cases: dict[str, Callable[[int], None]] = {
            "append": appender(client),
            PIPELINED: appender(client),
            "SET": setter(client),
        }
        figures: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, call in cases.items():
                join = pipelined_join if name == PIPELINED else join_module.join
                with mock.patch.object(aggregator_module, "join", join):
                    figures[name].append(cpu_us_per_call(call, args.calls))
    header = ["case", f"client CPU µs per call (median of {args.rounds})", "rounds"]
    rows = [
        [name, f"{median(runs):.1f}", ", ".join(f"{run:.1f}" for run in runs)]
        for name, runs in figures.items()
    ]
    print(markdown_table(header, rows, align="lrl"))
