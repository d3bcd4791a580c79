"""Our batching against the designs a Celery user would pick instead, under open-loop load.

    .venv/bin/python -m bench compare            # `make bench-compare`: about 7 minutes
    .venv/bin/python -m bench compare --quick    # a tiny run (the test suite's smoke test)

For N = 1 and N = 2 simulated GPUs (Celery workers with the simulated sampler, 100 ms per
call whatever the batch size), each design gets its own service (gunicorn with 2 processes,
N workers, one Redis started here) and a Poisson load at 10 req/s and at 50, 90, 100, 150
and 200% of N x 1,000 req/s (100 per call / 100 ms: the GPUs' limit). Designs:
  ours            POST /sample (the product)
  per-request     one Celery task per request              (bench/baselines)
  celery-batches  celery-batches, flush_every=100 or timer  (bench/baselines)
  timer           a batcher in each web process            (bench/baselines)
  bare view       GET /healthz on our service: the front end's floor
Every 200's body is checked against the simulated sampler's completion of its prompt.
Each of our rows is also simulated (planning/simulation.py) to validate the capacity planner.
Writes docs/benchmarks/results.md, results.json and three PNG plots; prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.compare.designs import (
    BATCH_MS,
    DEADLINE_MS,
    DESIGNS,
    FLUSH_INTERVAL_MS,
    LOADS,
    MAX_BATCH,
    PER_GPU_RPS,
    TIMER_MS,
    run_design,
)
from bench.compare.report import write_report
from bench.harness.machine import describe_machine
from bench.harness.stack import ROOT
from bench.harness.stats import median_of_rounds
from devstack.embedded_redis import redis_url_or_embedded
from planning import simulation

OUT = ROOT / "docs" / "benchmarks"


def simulate_row(row: dict[str, object], duration_s: float, seeds: int = 5) -> dict[str, float]:
    """Our row as the capacity planner's simulation predicts it: medians over `seeds` runs
    of the same length."""
    outcomes = [
        simulation.simulate(
            simulation.Scenario(
                rate_rps=float(row["offered_rps"]),  # type: ignore[arg-type]
                gpus=int(row["gpus"]),  # type: ignore[call-overload]
                batch_ms=BATCH_MS,
                max_batch=MAX_BATCH,
                deadline_ms=DEADLINE_MS,
                duration_s=duration_s,
                seed=seed,
            )
        )
        for seed in range(1, seeds + 1)
    ]
    return {
        "sim_goodput_rps": statistics.median(o.goodput_rps for o in outcomes),
        "sim_p99_ms": statistics.median(o.answer_percentile_ms(99) for o in outcomes),
        "sim_mean_batch": statistics.median(o.mean_batch for o in outcomes),
    }


def median_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per (design, N, load): each number the median of its runs (--repeat), the
    rest from the first run; with one run each, the rows as they are."""
    runs: dict[tuple[object, ...], list[dict[str, object]]] = {}
    for row in rows:
        runs.setdefault((row["design"], row["gpus"], row["offered_rps"]), []).append(row)
    return [{**median_of_rounds(same), "runs": len(same)} for same in runs.values()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny scale: a smoke test")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per level")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--designs", nargs="+", default=[d.name for d in DESIGNS])
    parser.add_argument("--loads", type=int, nargs="+", help="percent of the limit (default: all)")
    parser.add_argument("--timer-ms", type=int, default=TIMER_MS, help="the timer baseline's T")
    parser.add_argument(
        "--flush-interval-ms", type=int, default=FLUSH_INTERVAL_MS, help="celery-batches' timer"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run each level N times; report each figure's median"
    )
    parser.add_argument("--out", type=Path, default=OUT)


def levels_of(
    gpus: int, loads: Sequence[int | None], quick: bool
) -> list[tuple[int | None, float]]:
    """(percent of the limit, offered req/s) of each level; None: 10 req/s."""
    if quick:  # the same code paths at a scale a test can afford
        return [(None, 10.0), (5, 50.0)]
    return [(load, 10.0 if load is None else gpus * PER_GPU_RPS * load / 100) for load in loads]


def main(args: argparse.Namespace) -> None:
    tuned = {
        "celery-batches": {"BENCH_FLUSH_INTERVAL_MS": str(args.flush_interval_ms)},
        "timer": {"BENCH_TIMER_MS": str(args.timer_ms)},
    }
    duration = 1.0 if args.quick else args.duration
    started = time.monotonic()
    rows: list[dict[str, object]] = []
    with redis_url_or_embedded() as redis_url:
        for gpus in [1] if args.quick else args.gpus:
            levels = levels_of(gpus, LOADS if args.loads is None else args.loads, args.quick)
            for design in DESIGNS:
                if design.name in args.designs:
                    design = replace(design, env={**design.env, **tuned.get(design.name, {})})
                    for _ in range(args.repeat):
                        then_bare = design.name == "ours"
                        rows += run_design(design, gpus, levels, duration, redis_url, then_bare)
    rows = median_rows(rows)
    for row in rows:
        if row["design"] == "ours":
            row.update(simulate_row(row, duration))
    elapsed = time.monotonic() - started
    machine = describe_machine()
    write_report(rows, args.out, machine=machine, duration_s=duration, elapsed_s=elapsed)
    print(f"\nwrote {args.out}/results.md, results.json and the plots in {elapsed:.0f} s")
