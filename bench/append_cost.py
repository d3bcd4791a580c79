"""The web process's CPU per `BatchAggregator.append`, the request's one Redis round trip.

    .venv/bin/python -m bench append_cost [--rounds 5] [--calls 5000]

Against a real Redis (embedded unless REDIS_URL is set), one process appends `--calls`
requests in a row and reads its own CPU time (user + system) per call, for:
  - append: the aggregator's MULTI, sent by hand on a pooled connection;
  - append (Pipeline): the same commands through redis-py's transaction Pipeline;
  - SET: one plain SET through the client, the cheapest round trip there is.
Rounds alternate between the cases and medians are printed: the machine is noisy. Batches
never fill (a max of 100 and a fresh queue per 90 calls): no CLOSE is counted.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable

import redis

from batching.aggregator import BatchAggregator
from bench.harness.report import markdown_table
from bench.harness.stats import median
from inference_site.lib.embedded_redis import redis_url_or_embedded


class PipelineAggregator(BatchAggregator):
    """The aggregator with its MULTI sent through redis-py's Pipeline (as to a cluster), for
    comparison."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        super().__init__(client, queue)
        self._cluster = True


def appender(client: redis.Redis, kind: type[BatchAggregator]) -> Callable[[int], None]:
    aggregators = [kind(client, f"bench-append-{uuid.uuid4().hex[:8]}") for _ in range(64)]

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


def main(args: argparse.Namespace) -> None:
    with redis_url_or_embedded() as url:
        client = redis.Redis.from_url(url)
        cases: dict[str, Callable[[int], None]] = {
            "append": appender(client, BatchAggregator),
            "append (Pipeline)": appender(client, PipelineAggregator),
            "SET": setter(client),
        }
        figures: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, call in cases.items():
                figures[name].append(cpu_us_per_call(call, args.calls))
    header = ["case", f"client CPU µs per call (median of {args.rounds})", "rounds"]
    rows = [
        [name, f"{median(runs):.1f}", ", ".join(f"{run:.1f}" for run in runs)]
        for name, runs in figures.items()
    ]
    print(markdown_table(header, rows, align="lrl"))
