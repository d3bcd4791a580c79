"""A scaled-down farm: 2 web nodes and 4 simulated GPUs, the request path on 1 Redis or 3 shards.

On this machine: two web nodes and 4 simulated GPUs, the request path on one Redis or spread
as 3 shards over a local 3-master cluster, under the same load.

    .venv/bin/python -m bench farm [--rounds 2] [--rate 400] [--seconds 10]

Each round starts, per topology, a fresh set of servers and processes:
  - the Celery broker on its own Redis (CELERY_BROKER_URL; REDIS_URL points there too);
  - the request path (SAMPLING_REDIS_URL), either one valkey-server with SAMPLING_SHARDS=1,
    or a 3-master valkey cluster (SAMPLING_REDIS_CLUSTER=1) with SAMPLING_SHARDS=3, one
    shard per master;
  - two web nodes: two gunicorn instances of one process each, on their own ports;
  - 4 Celery workers with the simulated sampler (SIMULATED_BATCH_MS, 100 ms a call).
Then it offers open-loop Poisson load split evenly over the two ports (a warm-up, then the
measured part) and prints, per topology, the medians over the rounds of: goodput, the shares
of 503 and 504, p50 and p99 latency, batch fill (items per batch, from the batch records of
the measured part), web CPU per request (both gunicorns), and each Redis node's CPU per
request (`INFO cpu`): the request path's node(s), and the broker. Topologies alternate
between rounds: the machine is noisy. Every 200 is checked against its own prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import redis

from batching.aggregator import BatchAggregator
from batching.outcomes import RequestOutcome
from batching.topology import redis_client
from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.procstat import cpu_seconds, redis_cpu
from bench.harness.report import markdown_table
from bench.harness.stack import Stack, simulated_env, simulated_stack
from bench.harness.stats import median_of_rounds
from bench.harness.trees import in_turn
from inference_site.lib.embedded_cluster import EmbeddedCluster
from inference_site.lib.embedded_redis import EmbeddedRedis, valkey_binary
from workers.samplers.simulated import expected_completion

CALL_MS = 100
GPUS = 4
WEB_NODES = 2
ONE_REDIS = "one Redis"
CLUSTER = "3 shards, 3-master cluster"
TOPOLOGIES = [ONE_REDIS, CLUSTER]
CLUSTER_SHARDS = 3


@contextlib.contextmanager
def request_path(topology: str) -> Iterator[tuple[dict[str, str], list[redis.Redis]]]:
    """The request path's Redis for `topology`: its settings, and a plain client per node."""
    if topology == ONE_REDIS:
        server = EmbeddedRedis(binary=valkey_binary()).start()
        try:
            settings = {"SAMPLING_REDIS_URL": server.url, "SAMPLING_SHARDS": "1"}
            yield settings, [redis.Redis.from_url(server.url)]
        finally:
            server.stop()
        return
    with EmbeddedCluster(masters=CLUSTER_SHARDS).start() as cluster:
        settings = {
            "SAMPLING_REDIS_URL": cluster.url,
            "SAMPLING_REDIS_CLUSTER": "1",
            "SAMPLING_SHARDS": str(CLUSTER_SHARDS),
        }
        yield settings, [cluster.client(i) for i in range(CLUSTER_SHARDS)]


def one_round(topology: str, rate_rps: float, seconds: float, work: Path) -> dict[str, object]:
    broker = EmbeddedRedis(binary=valkey_binary()).start()
    stacks: list[Stack] = []
    try:
        with request_path(topology) as (settings, nodes):
            queue = f"farm-{uuid.uuid4().hex[:8]}"
            env = {
                **simulated_env(broker.url, queue, call_ms=CALL_MS, CELERY_BROKER_URL=broker.url),
                **settings,
            }
            # The first web node starts the workers too; the second is a gunicorn alone.
            for node in range(WEB_NODES):
                stack = simulated_stack(
                    env,
                    gpus=[None] * GPUS if node == 0 else [],
                    web_processes=1,
                    log_dir=work / queue / f"node-{node}",
                )
                stacks.append(stack)
                stack.start(timeout_s=90)
            aggregator = BatchAggregator(
                redis_client(settings["SAMPLING_REDIS_URL"], "SAMPLING_REDIS_CLUSTER" in settings),
                queue,
            )
            ports = [stack.port for stack in stacks]
            tag = uuid.uuid4().hex[:6]

            def load(duration_s: float, label: str) -> loadgen.Results:
                return loadgen.run(
                    "127.0.0.1", ports, "/sample", rate_rps, duration_s,
                    lambda i: f"{label} {tag} {i}", expected_completion, client_timeout_s=3.0,
                )  # fmt: skip

            load(3.0, "warm")
            time.sleep(1.0)  # the warm-up's last batches recorded
            aggregator.client.delete(aggregator.keys.batch_log)
            broker_client = redis.Redis.from_url(broker.url)
            redis_before = [redis_cpu(node).total_s for node in nodes]
            broker_before = redis_cpu(broker_client).total_s
            web_before = sum(cpu_seconds(stack.web.pid) for stack in stacks if stack.web)
            results = load(seconds, "farm")
            web_used = sum(cpu_seconds(stack.web.pid) for stack in stacks if stack.web)
            web_used -= web_before
            redis_used = [
                redis_cpu(node).total_s - before
                for node, before in zip(nodes, redis_before, strict=True)
            ]
            broker_used = redis_cpu(broker_client).total_s - broker_before
            time.sleep(0.5)  # the last batches recorded
            sizes = [json.loads(raw)["size"] for raw in aggregator.batch_log.recent()]
            wrong = results.count(loadgen.WRONG)
            if wrong:
                raise RuntimeError(f"{wrong} requests got someone else's completion")
            sent = results.sent
            return {
                "goodput": results.goodput_rps,
                "ok_%": 100 * results.share(RequestOutcome.OK),
                "503_%": 100 * results.share(RequestOutcome.REJECTED),
                "504_%": 100 * results.share(RequestOutcome.TIMEOUT),
                "p50_ms": results.percentile_ms(50),
                "p99_ms": results.percentile_ms(99),
                "fill": statistics.mean(sizes) if sizes else 0.0,
                "batches": len(sizes),
                "web_ms": web_used / sent * 1000,
                "redis_us": [used / sent * 1e6 for used in redis_used],
                "broker_us": broker_used / sent * 1e6,
            }
    finally:
        for stack in reversed(stacks):
            stack.stop()
        broker.stop()


def table(figures: dict[str, list[dict[str, object]]], rate_rps: float) -> str:
    rounds = min(len(runs) for runs in figures.values())
    header = [
        "request path", "goodput req/s", "503 %", "504 %", "p50 ms", "p99 ms", "items/batch",
        "web CPU ms/req", "Redis CPU µs/req, per node", "broker µs/req",
    ]  # fmt: skip
    rows = []
    for topology, runs in figures.items():
        row = median_of_rounds(runs)
        per_node = row["redis_us"]
        rows.append([
            topology, f"{row['goodput']:.0f}", f"{row['503_%']:.1f}", f"{row['504_%']:.1f}",
            f"{row['p50_ms']:.0f}", f"{row['p99_ms']:.0f}", f"{row['fill']:.1f}",
            f"{row['web_ms']:.2f}",
            f"{', '.join(f'{us:.0f}' for us in per_node)} (sum {sum(per_node):.0f})",
            f"{row['broker_us']:.0f}",
        ])  # fmt: skip
    title = (
        f"Farm: {WEB_NODES} web nodes (1 gunicorn process each), {GPUS} simulated GPUs "
        f"({CALL_MS} ms a call), {rate_rps:g} req/s offered, medians of {rounds} rounds"
    )
    return f"{title}\n\n{markdown_table(header, rows, align='lrrrrrrrlr')}\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=400.0, help="offered req/s, both nodes")
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured part")


def main(args: argparse.Namespace) -> None:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-farm-"))
    figures: dict[str, list[dict[str, object]]] = {topology: [] for topology in TOPOLOGIES}
    try:
        for round_index in range(args.rounds):
            for topology in in_turn(TOPOLOGIES, round_index):
                row = one_round(topology, args.rate, args.seconds, work)
                figures[topology].append(row)
                shown = "  ".join(
                    f"{name} {value:.1f}" if isinstance(value, float) else f"{name} {value}"
                    for name, value in row.items()
                    if not isinstance(value, list)
                )
                print(f"  round {round_index + 1} {topology}: {shown}", flush=True)
        print()
        print(table(figures, args.rate))
        print(f"{describe_machine()}; {time.monotonic() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
