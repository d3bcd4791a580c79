"""What one request costs the Redis that carries the request path, against a plain SET.

    .venv/bin/python -m bench.redis_cost                     # this tree, 3 rounds (~3 minutes)
    .venv/bin/python -m bench.redis_cost --against 4a03537   # and an older commit, alternating

A Redis server's CPU per request on these VMs is mostly waking up for it (system calls,
context switches, cold caches), so it is compared with what the same server spends on one
plain SET round trip, measured in the same run, two ways:

  SET view     POST /baseline/set on the same gunicorn, at the same rate: one SET per request
               through the same client pool, arriving as the requests do (the fair baseline);
  SET loop     one client running SETs back to back (hot caches, no other load: cheaper).

Each round starts the service (gunicorn with 2 processes, 2 Celery workers with the simulated
sampler, 100 ms a call; DJANGO_SETTINGS_MODULE=bench.baselines.settings, which adds the SET
view) on a fresh sampling Redis, offers open-loop Poisson load (a warm-up, then the measured
part) to /sample, then the same load to /baseline/set, and reads the server's CPU (`INFO
cpu`, user + system) and its commands (`INFO commandstats`, the commands Lua runs included)
around each measured part. Then the SET loop, with the service stopped. Two layouts:

  own broker   the Celery broker on its own Redis (CELERY_BROKER_URL): the sampling Redis
               carries the request path, the results and the statistics;
  one Redis    the broker on the sampling Redis too (REDIS_URL only, as `make run`).

Prints, per code version and layout, the medians over the rounds: Redis CPU per request (µs),
per SET through the view and per SET in the loop, the ratios, and commands per request.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

from batching.outcomes import RequestOutcome
from bench import loadgen
from bench.compare import describe_machine
from bench.gap import Tree, worktree
from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import ROOT, Stack
from workers.samplers.simulated import expected_completion

CALL_MS = 100
WORKERS = 2
SET_ROUND_TRIPS = 20_000
BASELINES = "bench.baselines.settings"
SET_VIEW = "/baseline/set"
LAYOUTS = ["own broker", "one Redis"]


def cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def commands(client: redis.Redis) -> int:
    return sum(stat["calls"] for stat in client.info("commandstats").values())


def set_round_trip_us(client: redis.Redis, count: int = SET_ROUND_TRIPS) -> float:
    """The server's CPU for one plain SET round trip from one client, in µs."""
    key = "bench:redis-cost:set"
    before = cpu_s(client)
    for index in range(count):
        client.set(key, index)
    return (cpu_s(client) - before) / count * 1e6


@dataclass
class Bench:
    rate_rps: float
    seconds: float
    work: Path
    figures: dict[tuple[str, str], list[dict[str, float]]] = field(default_factory=dict)

    def round(self, tree: Tree, layout: str) -> None:
        sampling = EmbeddedRedis().start()
        broker = EmbeddedRedis().start() if layout == "own broker" else sampling
        queue = f"cost-{uuid.uuid4().hex[:8]}"
        stack = Stack(
            env={
                "REDIS_URL": sampling.url,
                "CELERY_BROKER_URL": broker.url,
                "SAMPLER": "simulated",
                "SIMULATED_BATCH_MS": str(CALL_MS),
                "SAMPLING_QUEUE": queue,
                "DJANGO_SECRET_KEY": "bench-only-" + uuid.uuid4().hex,
                "DJANGO_SETTINGS_MODULE": BASELINES,
                "LOG_LEVEL": "warning",
            },
            gpus=[None] * WORKERS,
            root=tree.root,
            own_database=True,
            log_dir=self.work / queue,
        )
        try:
            stack.start(timeout_s=60)
            client = redis.Redis.from_url(sampling.url)
            tag = uuid.uuid4().hex[:6]

            def load(path: str, seconds: float, label: str) -> loadgen.Results:
                expected = expected_completion if path == "/sample" else (lambda p: p)
                return loadgen.run(
                    "127.0.0.1", stack.port, path, self.rate_rps, seconds,
                    lambda i: f"{label} {tag} {i}", expected, client_timeout_s=3.0,
                )  # fmt: skip

            def measured(path: str) -> tuple[loadgen.Results, float, int]:
                load(path, 3.0, "warm")
                cpu_before, commands_before = cpu_s(client), commands(client)
                results = load(path, self.seconds, "cost")
                cpu_us = (cpu_s(client) - cpu_before) / results.sent * 1e6
                return results, cpu_us, commands(client) - commands_before

            results, per_request_us, commands_run = measured("/sample")
            set_view_us = float("nan")  # an older tree has no SET view: compare µs/request
            if tree.root == ROOT:
                set_results, set_view_us, _ = measured(SET_VIEW)
                if set_results.share(RequestOutcome.OK) < 0.99:
                    raise RuntimeError(f"the SET view failed: {set_results.examples}")
            stack.stop()  # nothing else on the server while the SETs run
            set_us = set_round_trip_us(client)
            figures = {
                "request_us": per_request_us,
                "set_view_us": set_view_us,
                "ratio_view": per_request_us / set_view_us,
                "set_loop_us": set_us,
                "ratio_loop": per_request_us / set_us,
                "cmds_per_req": commands_run / results.sent,
                "ok_%": 100 * results.share(RequestOutcome.OK),
                "p99_ms": results.percentile_ms(99),
            }
            wrong = results.count(loadgen.WRONG)
            if wrong:
                raise RuntimeError(f"{wrong} requests got someone else's completion")
        finally:
            stack.stop()
            sampling.stop()
            if broker is not sampling:
                broker.stop()
        self.figures.setdefault((tree.name, layout), []).append(figures)
        shown = "  ".join(f"{name} {value:.2f}" for name, value in figures.items())
        print(f"  {tree.name:<8} {layout:<10}  {shown}", flush=True)


def table(bench: Bench, trees: list[Tree], layouts: list[str]) -> str:
    rounds = max(len(runs) for runs in bench.figures.values())
    lines = [
        f"Redis CPU per request at {bench.rate_rps:g} req/s, {WORKERS} simulated GPUs "
        f"(median of {rounds} rounds)",
        "",
        "| code | layout | µs/request | µs/SET (view) | ratio | µs/SET (loop) | ratio "
        "| commands/request | ok % | p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in layouts:
        for tree in trees:
            runs = bench.figures.get((tree.name, layout), [])
            if not runs:
                continue
            cells = [
                f"{statistics.median(run[name] for run in runs):.{digits}f}"
                for name, digits in (
                    ("request_us", 1), ("set_view_us", 1), ("ratio_view", 2),
                    ("set_loop_us", 1), ("ratio_loop", 2), ("cmds_per_req", 2), ("ok_%", 1),
                    ("p99_ms", 0),
                )
            ]  # fmt: skip
            lines.append(f"| {tree.name} | {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git ref to measure in the same run, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=400.0, help="offered req/s")
    parser.add_argument("--seconds", type=float, default=15.0, help="the measured part")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    args = parser.parse_args()

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-redis-cost-"))
    trees = [Tree("this", ROOT)]
    with contextlib.ExitStack() as resources:
        if args.against:
            trees.insert(0, Tree(args.against[:8], resources.enter_context(worktree(args.against))))
        bench = Bench(args.rate, args.seconds, work)
        for round_number in range(1, args.rounds + 1):
            print(f"round {round_number}/{args.rounds}", flush=True)
            for layout in args.layouts:
                for tree in trees if round_number % 2 else trees[::-1]:
                    bench.round(tree, layout)
    print(f"\n{describe_machine()}; {time.monotonic() - started:.0f} s\n")
    print(table(bench, trees, args.layouts))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
