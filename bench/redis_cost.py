"""What one request costs the Redis that carries the request path, against a plain SET.

    .venv/bin/python -m bench redis_cost                     # this tree, 3 rounds (~3 minutes)
    .venv/bin/python -m bench redis_cost --against 4a03537   # and an older commit, alternating

With `--against`, the older tree runs twice a round, as REF and REF (A/A): how far two runs of
the same code read apart is the spread a difference must clear (`--no-aa`: once).

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
from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.procstat import redis_commands, redis_cpu
from bench.harness.report import markdown_table
from bench.harness.stack import simulated_env, simulated_stack
from bench.harness.stats import median_of_rounds
from bench.harness.trees import Tree, in_turn, trees
from devstack.embedded_redis import EmbeddedRedis
from workers.samplers.simulated import expected_completion

CALL_MS = 100
WORKERS = 2
SET_ROUND_TRIPS = 20_000
BASELINES = "bench.baselines.settings"
SET_VIEW = "/baseline/set"
LAYOUTS = ["own broker", "one Redis"]


def _echoed(prompt: str) -> str:
    """What /baseline/set answers: the prompt it stored."""
    return prompt


def set_round_trip_us(client: redis.Redis, count: int = SET_ROUND_TRIPS) -> float:
    """The server's CPU for one plain SET round trip from one client, in µs."""
    key = "bench:redis-cost:set"
    before = redis_cpu(client).total_s
    for index in range(count):
        client.set(key, index)
    return (redis_cpu(client).total_s - before) / count * 1e6


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
        env = simulated_env(
            sampling.url, queue, call_ms=CALL_MS, CELERY_BROKER_URL=broker.url,
            DJANGO_SETTINGS_MODULE=BASELINES,
        )  # fmt: skip
        stack = simulated_stack(env, [None] * WORKERS, root=tree.root, log_dir=self.work / queue)
        try:
            stack.start(timeout_s=60)
            client = redis.Redis.from_url(sampling.url)
            tag = uuid.uuid4().hex[:6]

            def load(path: str, seconds: float, label: str) -> loadgen.Results:
                expected = expected_completion if path == "/sample" else _echoed
                return loadgen.run(
                    "127.0.0.1", stack.port, path, self.rate_rps, seconds,
                    lambda i: f"{label} {tag} {i}", expected, client_timeout_s=3.0,
                )  # fmt: skip

            def measured(path: str) -> tuple[loadgen.Results, float, int]:
                load(path, 3.0, "warm")
                cpu_before, commands_before = redis_cpu(client).total_s, redis_commands(client)
                results = load(path, self.seconds, "cost")
                cpu_us = (redis_cpu(client).total_s - cpu_before) / results.sent * 1e6
                return results, cpu_us, redis_commands(client) - commands_before

            results, per_request_us, commands_run = measured("/sample")
            set_view_us = float("nan")  # an older tree has no SET view: compare µs/request
            if tree.is_this:
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
        print(f"  {tree.name:<15} {layout:<10}  {shown}", flush=True)


COLUMNS = (
    ("request_us", "µs/request", 1), ("set_view_us", "µs/SET (view)", 1),
    ("ratio_view", "ratio", 2), ("set_loop_us", "µs/SET (loop)", 1), ("ratio_loop", "ratio", 2),
    ("cmds_per_req", "commands/request", 2), ("ok_%", "ok %", 1), ("p99_ms", "p99 ms", 0),
)  # fmt: skip


def table(bench: Bench, trees: list[Tree], layouts: list[str]) -> str:
    """Medians over the rounds; with an older tree, each tree's µs/request against the older
    one's in the same round and layout, the median of those ratios (a round's noise is
    shared by the trees it ran)."""
    rounds = max(len(runs) for runs in bench.figures.values())
    rows = []
    for layout in layouts:
        base = bench.figures.get((trees[0].name, layout), [])
        for tree in trees:
            runs = bench.figures.get((tree.name, layout), [])
            if runs:
                row = median_of_rounds(runs)
                cells = [f"{row[name]:.{digits}f}" for name, _, digits in COLUMNS]
                paired = zip(runs, base, strict=True)
                ratios = [run["request_us"] / old["request_us"] - 1 for run, old in paired]
                against = f"{statistics.median(ratios):+.1%}" if len(trees) > 1 else "-"
                rows.append([tree.name, layout, *cells, against])
    header = ["code", "layout", *(title for _, title, _ in COLUMNS), f"vs {trees[0].name}"]
    title = (
        f"Redis CPU per request at {bench.rate_rps:g} req/s, {WORKERS} simulated GPUs "
        f"(median of {rounds} rounds)"
    )
    align = "ll" + "r" * (len(COLUMNS) + 1)
    return f"{title}\n\n{markdown_table(header, rows, align=align)}\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", help="a git ref to measure in the same run, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=400.0, help="offered req/s")
    parser.add_argument("--seconds", type=float, default=15.0, help="the measured part")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    parser.add_argument(
        "--no-aa", dest="aa", action="store_false", help="run the older tree once a round"
    )


def main(args: argparse.Namespace) -> None:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-redis-cost-"))
    with contextlib.ExitStack() as resources:
        versions = trees(resources, args.against)
        if args.against and args.aa:
            before = versions[0]
            versions.insert(1, Tree(f"{before.name} (A/A)", before.root))
        bench = Bench(args.rate, args.seconds, work)
        for round_index in range(args.rounds):
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
            for layout in args.layouts:
                for tree in in_turn(versions, round_index):
                    bench.round(tree, layout)
    print(f"\n{describe_machine()}; {time.monotonic() - started:.0f} s\n")
    print(table(bench, versions, args.layouts))
    shutil.rmtree(work, ignore_errors=True)
