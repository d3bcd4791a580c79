"""A scaled-down farm: 2 web nodes and simulated GPUs (4; 21 --slow-motion), on 1 Redis or 3 shards.

On this machine: two web nodes and 4 simulated GPUs, the request path on one Redis or spread
as 3 shards over a local 3-master cluster, under the same load.

    .venv/bin/python -m bench farm [--rounds 2] [--rate 400] [--seconds 10] [--gpus 4]
        [--call-ms 100] [--deadline-ms D] [--max-in-flight N] [--connections N]
        [--topology both|one|cluster]
    .venv/bin/python -m bench farm --slow-motion [--topology cluster] [--cost h100-graphs-135m]

`--slow-motion` is the 20,000 req/s farm (21 GPUs, 100 ms calls, 500 ms deadlines) slowed
down 20 times so that this machine carries it: 21 simulated workers with 2,000 ms calls and
10,000 ms deadlines (and so 20 times the web processes' in-flight cap and connections) under
1,000 req/s for 60 s, one round. Its bar: at least 99.9% of the requests answered 200 and
none 500 on the cluster, as on one Redis (the line after the table says whether each topology
met it).
`--cost` prices the calls on a cost profile (requests of 16 new tokens): with `--slow-motion`,
its every time 20 times longer, on the planner's GPUs for 20,000 req/s (`--gpus` overrides).
Last, the planner's check: the farm's batch fill and p50/p99 in calls beside the planner's
simulation of the same run (bench/farm/check.py).

Each round starts, per topology, a fresh set of servers and processes:
  - the Celery broker on its own Redis (CELERY_BROKER_URL; REDIS_URL points there too);
  - the request path (SAMPLING_REDIS_URL), either one valkey-server with SAMPLING_SHARDS=1,
    or a 3-master valkey cluster (SAMPLING_REDIS_CLUSTER=1) with SAMPLING_SHARDS=3, one
    shard per master;
  - two web nodes: two gunicorn instances of one process each, on their own ports;
  - `--gpus` Celery workers with the simulated sampler (SIMULATED_BATCH_MS: `--call-ms`).
Then it offers open-loop Poisson load split evenly over the two ports (a warm-up, then the
measured part) and prints, per topology, the medians over the rounds of: goodput, the shares
of 200, 503 (and those the web processes refused themselves: too many in flight, late), 504
and any other answer (a 500, a connection error, no answer within the deadline and 2 s: one
example is printed), p50 and p99 latency, batch fill (items per batch, from the batch records
of the measured part), web CPU per request (both gunicorns), and each Redis node's CPU per
request (`INFO cpu`): the request path's node(s), and the broker.
Topologies alternate between rounds: the machine is noisy. Every 200 is checked against its
own prompt.
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
from batching.call_cost import CONTRACT
from batching.policy import Policy
from batching.topology import redis_client
from bench.farm.check import check_table, planned_gpus, records_of, scenario_of, turn_gap_ms
from bench.farm.report import round_row, table, verdicts
from bench.farm.shape import (
    CALL_MS,
    CHOSEN,
    CLUSTER_SHARDS,
    GPUS,
    ONE_REDIS,
    SLOW_MOTION,
    SLOWED,
    WEB_NODES,
    Shape,
    slow_motion,
    slowed_profile,
)
from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.procstat import cpu_seconds, redis_cpu, shed_counts
from bench.harness.stack import Stack, simulated_env, simulated_stack
from bench.harness.trees import in_turn
from devstack.embedded_cluster import EmbeddedCluster
from devstack.embedded_redis import EmbeddedRedis, valkey_binary

SHED_REASONS = ("in_flight", "late")  # sampling.shedding.ShedReason's values


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


def one_round(
    topology: str, rate_rps: float, seconds: float, work: Path, shape: Shape
) -> dict[str, object]:
    broker = EmbeddedRedis(binary=valkey_binary()).start()
    stacks: list[Stack] = []
    try:
        with request_path(topology) as (settings, nodes):
            queue = f"farm-{uuid.uuid4().hex[:8]}"
            env = {
                **simulated_env(
                    broker.url,
                    queue,
                    call_ms=shape.call_ms,
                    deadline_ms=shape.deadline_ms,
                    CELERY_BROKER_URL=broker.url,
                ),
                **shape.calls.env(),
                **settings,
            }
            env.update(shape.web_env())
            # The first web node starts the workers too; the second is a gunicorn alone.
            for node in range(WEB_NODES):
                stack = simulated_stack(
                    env,
                    gpus=[None] * shape.gpus if node == 0 else [],
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
                    lambda i: f"{label} {tag} {i}", shape.calls.expected(),
                    client_timeout_s=shape.client_timeout_s,
                )  # fmt: skip

            load(3.0, "warm")
            time.sleep(shape.calls.full_call_ms / 1000 + 0.9)  # the warm-up's batches recorded
            aggregator.client.delete(aggregator.keys.batch_log)
            broker_client = redis.Redis.from_url(broker.url)
            redis_before = [redis_cpu(node).total_s for node in nodes]
            broker_before = redis_cpu(broker_client).total_s
            web_before = sum(cpu_seconds(stack.web.pid) for stack in stacks if stack.web)
            shed_before = shed_counts(ports)
            results = load(seconds, "farm")
            shed_after = shed_counts(ports)
            shed = {r: shed_after.get(r, 0.0) - shed_before.get(r, 0.0) for r in SHED_REASONS}
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
            row = round_row(results, sizes, web_used, redis_used, broker_used, shed)
            return {**row, "gap_ms": turn_gap_ms(records_of(aggregator.batch_log.recent()))}
    finally:
        for stack in reversed(stacks):
            stack.stop()
        broker.stop()


# The options' defaults; --slow-motion's (SLOW_MOTION) over them; any option given over both.
DEFAULTS = {"gpus": GPUS, "call_ms": CALL_MS, "deadline_ms": None, "max_in_flight": None,
            "connections": None, "rate": 400.0, "seconds": 10.0, "rounds": 2}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help=f"default {DEFAULTS['rounds']}")
    parser.add_argument("--rate", type=float, help="offered req/s, both nodes (default 400)")
    parser.add_argument("--seconds", type=float, help="the measured part (default 10)")
    parser.add_argument("--gpus", type=int, help=f"simulated workers (default {GPUS})")
    parser.add_argument("--call-ms", type=int, help=f"a simulated call (default {CALL_MS})")
    parser.add_argument("--deadline-ms", type=int, help="default: the service's")
    parser.add_argument("--max-in-flight", type=int, help="WEB_MAX_IN_FLIGHT per web process")
    parser.add_argument("--connections", type=int, help="WEB_WORKER_CONNECTIONS per process")
    parser.add_argument("--topology", choices=sorted(CHOSEN), default="both")
    parser.add_argument("--cost", default=CONTRACT, help="calls on a cost profile (contract)")
    parser.add_argument(
        "--slow-motion",
        action="store_true",
        help=f"the 20,000 req/s farm slowed {SLOWED}x: "
        + ", ".join(f"--{name.replace('_', '-')} {value:g}" for name, value in SLOW_MOTION.items()),
    )
    parser.add_argument("--slowed", type=float, default=SLOWED, help="--slow-motion's factor")


def main(args: argparse.Namespace) -> None:
    slowed = slow_motion(args.slowed)
    gpus_given = args.gpus is not None
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            value = slowed[name] if args.slow_motion else default
            if value is not None and name not in ("rate", "seconds"):
                value = int(value)
            setattr(args, name, value)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-farm-"))
    limits = {"max_in_flight": args.max_in_flight, "connections": args.connections}
    shape = Shape(args.gpus, args.call_ms, args.deadline_ms, cost=args.cost, **limits)
    if args.slow_motion and shape.calls.on_curve:  # the planner's GPUs; every call slowed
        if not gpus_given:
            args.gpus = planned_gpus(shape.calls.profile, 20_000, Policy().deadline_ms)
        profile = slowed_profile(args.cost, args.slowed, work)
        shape = Shape(args.gpus, args.call_ms, args.deadline_ms, cost=profile, **limits)
    topologies = CHOSEN[args.topology]
    figures: dict[str, list[dict[str, object]]] = {topology: [] for topology in topologies}
    try:
        for round_index in range(args.rounds):
            for topology in in_turn(topologies, round_index):
                row = one_round(topology, args.rate, args.seconds, work, shape)
                figures[topology].append(row)
                shown = "  ".join(
                    f"{name} {value:.1f}" if isinstance(value, float) else f"{name} {value}"
                    for name, value in row.items()
                    if not isinstance(value, list) and name != "other_example"
                )
                print(f"  round {round_index + 1} {topology}: {shown}", flush=True)
        print()
        print(table(figures, args.rate, shape))
        print("\n".join(verdicts(figures)))
        deadline_ms = shape.deadline_ms or Policy().deadline_ms
        for topology, runs in figures.items():
            farm = {name: statistics.median(float(run[name]) for run in runs)  # type: ignore[arg-type]
                    for name in ("fill", "p50_ms", "p99_ms", "gap_ms")}  # fmt: skip
            scenario = scenario_of(args.rate, shape.gpus, shape.call_ms, deadline_ms,
                                   args.seconds, shape.calls.profile)  # fmt: skip
            check = check_table(farm, scenario, farm["gap_ms"], shape.calls.full_call_ms)
            print(f"\n{topology}: {check}")
        print(f"{describe_machine()}; {time.monotonic() - started:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
