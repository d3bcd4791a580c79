"""Our batching against the designs a Celery user would pick instead, under open-loop load.

    .venv/bin/python -m bench.compare            # `make bench-compare`: about 7 minutes
    .venv/bin/python -m bench.compare --quick    # a tiny run (the test suite's smoke test)

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
import contextlib
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis

from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from batching.policy import MAX_BATCH_SIZE, Policy
from bench import loadgen
from bench.baselines import calls_key
from bench.procstat import cpu_seconds
from inference_site.lib.embedded_redis import redis_url_or_embedded
from inference_site.lib.stack import ROOT, Stack
from planning import simulation
from workers.samplers.simulated import expected_completion

BATCH_MS = 100
MAX_BATCH = MAX_BATCH_SIZE
DEADLINE_MS = Policy.deadline_ms
PER_GPU_RPS = MAX_BATCH * 1000 / BATCH_MS
LOADS = [None, 50, 90, 100, 150, 200]  # None: 10 req/s
OUT = ROOT / "docs" / "benchmarks"
# The client gives up this long after a request's intended send time: 4 deadlines, enough
# for any answer of a server that keeps its deadline; no answer by then is "other".
CLIENT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Design:
    name: str
    path: str
    settings: str = "inference_site.settings"
    env: dict[str, str] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)
    post: bool = True


BASELINES = "bench.baselines.settings"
# Tuned on this machine at N = 1, 50/90/100% load (`--timer-ms`, `--flush-interval-ms`):
# T = 200, 250, 300 ms gave 815, 917, 917 req/s at 90% with p99 515, 381, 404 ms; T + two
# calls stays inside the deadline at 250. celery-batches gave 162, 196 and 190 req/s at 50%
# with 50, 100 and 250 ms: its limit is elsewhere (README, "Benchmarks").
FLUSH_INTERVAL_MS = 100
TIMER_MS = 250
DESIGNS = [
    Design("ours", "/sample"),
    Design("per-request", "/baseline/per-request", BASELINES),
    Design(
        "celery-batches",
        "/baseline/celery-batches",
        BASELINES,
        # celery-batches only sees the messages the worker prefetched: at least flush_every.
        worker_args=["--prefetch-multiplier", str(MAX_BATCH)],
    ),
    Design("timer", "/baseline/timer", BASELINES),
]
BARE = Design("bare view", "/healthz", post=False)


def expected_for(design: Design) -> Callable[[str], str]:
    return expected_completion if design.post else (lambda prompt: "ok\n")


def redis_commands(client: redis.Redis) -> int:
    """Commands Redis has run since it started (INFO commandstats)."""
    return sum(stat["calls"] for stat in client.info("commandstats").values())


def calls_since(client: redis.Redis, design: Design, queue: str) -> list[tuple[int, float, int]]:
    """(items sampled, sampler ms, items expired) of each sampler call since the last reset."""
    if design.name == "ours":
        records = [json.loads(r) for r in client.lrange(QueueKeys(queue).batch_log, 0, -1)]
        return [(r["sampled"], r["sampler_ms"], r["expired"]) for r in records if r["sampled"]]
    rows = [raw.split() for raw in client.lrange(calls_key(queue), 0, -1)]
    return [(int(size), float(ms), 0) for size, ms in rows]


def reset(stack: Stack, client: redis.Redis, design: Design, queue: str, purge: bool) -> None:
    """Start a level from rest: drop a baseline's backlog of queued tasks (ours drains itself:
    its workers drop expired batches at once), let the last calls and buffers finish, wait
    for the web processes to be idle (an overloaded level leaves connections to serve), and
    forget the last level's calls."""
    assert stack.web is not None
    give_up = time.monotonic() + 15
    if purge:
        client.delete(queue)
    while client.llen(queue) and time.monotonic() < give_up:
        time.sleep(0.1)
    time.sleep(0.5)
    while time.monotonic() < give_up:
        before = cpu_seconds(stack.web.pid)
        time.sleep(0.25)
        if cpu_seconds(stack.web.pid) - before < 0.02:  # under 8% of a core
            break
    client.delete(QueueKeys(queue).batch_log, calls_key(queue))


def measure(
    stack: Stack,
    client: redis.Redis,
    design: Design,
    queue: str,
    gpus: int,
    rate: float,
    load: int | None,
    duration_s: float,
) -> dict[str, object]:
    reset(stack, client, design, queue, purge=design.name not in ("ours", "bare view"))
    assert stack.web is not None
    commands_before, cpu_before = redis_commands(client), cpu_seconds(stack.web.pid)
    tag = uuid.uuid4().hex[:8]
    results = loadgen.run(
        "127.0.0.1",
        stack.port,
        design.path,
        rate,
        duration_s,
        lambda i: f"{design.name} {rate:g} {tag} {i}: the prompt",
        expected_for(design),
        post=design.post,
        client_timeout_s=CLIENT_TIMEOUT_S,
        seed=int(rate * 100) + gpus,
    )
    web_cpu = cpu_seconds(stack.web.pid) - cpu_before
    commands = redis_commands(client) - commands_before
    calls = calls_since(client, design, queue) if design.post else []
    sampled = sum(c[0] for c in calls)
    row: dict[str, object] = {
        "design": design.name,
        "gpus": gpus,
        "load_percent": load,
        "offered_rps": rate,
        "sent": results.sent,
        "goodput_rps": results.goodput_rps,
        "goodput_share_of_limit": results.goodput_rps / (gpus * PER_GPU_RPS),
        "p50_ms": results.percentile_ms(50),
        "p95_ms": results.percentile_ms(95),
        "p99_ms": results.percentile_ms(99),
        "max_ms": max(results.latencies_ms, default=float("nan")),
        "ok_share": results.share(RequestOutcome.OK),
        "share_504": results.share(RequestOutcome.TIMEOUT),
        "share_503": results.share(RequestOutcome.REJECTED),
        "share_other": results.share(loadgen.OTHER) + results.share(loadgen.WRONG),
        "wrong": results.count(loadgen.WRONG),
        "calls": len(calls),
        "mean_batch": sampled / len(calls) if calls else None,
        "expired": sum(c[2] for c in calls),
        "gpu_busy": sum(c[1] for c in calls) / (gpus * results.wall_s * 1000) if calls else None,
        "web_cpu_ms": web_cpu / results.sent * 1000,
        "client_cpu_ms": results.client_cpu_s / results.sent * 1000,
        "redis_commands": commands / results.sent,
        "send_lag_p99_ms": loadgen.percentile(results.send_lag_ms, 99),
        "examples": results.examples,
    }
    if results.count(loadgen.WRONG):
        print(f"  !! {design.name}: wrong completions: {results.examples[loadgen.WRONG]}")
    return row


def run_design(
    design: Design,
    gpus: int,
    levels: list[tuple[int | None, float]],
    duration_s: float,
    redis_url: str,
    then_bare: bool,
) -> list[dict[str, object]]:
    queue = f"bench-{design.name.replace(' ', '-')}-{gpus}-{uuid.uuid4().hex[:6]}"
    env = {
        "REDIS_URL": redis_url,
        "SAMPLER": "simulated",
        "SIMULATED_BATCH_MS": str(BATCH_MS),
        "SAMPLING_DEADLINE_MS": str(DEADLINE_MS),
        "SAMPLING_MAX_BATCH_SIZE": str(MAX_BATCH),
        "SAMPLING_QUEUE": queue,
        "DJANGO_SETTINGS_MODULE": design.settings,
        "LOG_LEVEL": "warning",
        **design.env,
    }
    stack = Stack(
        env=env,
        gpus=list(range(gpus)),  # CUDA_VISIBLE_DEVICES only names them: no GPU is used
        web_processes=2,
        worker_args=design.worker_args,
        log_dir=Path("/tmp") / "bench-compare" / queue,
        own_database=True,
    )
    client = redis.Redis.from_url(redis_url)
    rows = []
    try:
        stack.start(timeout_s=120)
        for kind in [design, BARE] if then_bare else [design]:
            for load, rate in levels:
                row = measure(stack, client, kind, queue, gpus, rate, load, duration_s)
                rows.append(row)
                print(summary(row), flush=True)
    finally:
        stack.stop()
    return rows


def summary(row: dict[str, Any]) -> str:
    batch = row["mean_batch"]
    return (
        f"N={row['gpus']} {row['design']:<14} {row['offered_rps']:>6g} req/s: "
        f"goodput {row['goodput_rps']:7.1f}  p50/p99 {row['p50_ms']:5.0f}/{row['p99_ms']:5.0f} ms"
        f"  504 {row['share_504']:5.1%} 503 {row['share_503']:5.1%}"
        f" other {row['share_other']:5.1%}  batch {batch if batch is None else round(batch, 1)}"
        f"  web CPU {row['web_cpu_ms']:.2f} ms/req"
    )


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
    merged = []
    for same in runs.values():
        row = dict(same[0])
        for name, value in row.items():
            values = [other[name] for other in same]
            if isinstance(value, int | float) and all(isinstance(v, int | float) for v in values):
                row[name] = statistics.median(values)  # type: ignore[type-var]
        row["runs"] = len(same)
        merged.append(row)
    return merged


def describe_machine() -> str:
    model = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = parser.parse_args()
    tuned = {
        "celery-batches": {"BENCH_FLUSH_INTERVAL_MS": str(args.flush_interval_ms)},
        "timer": {"BENCH_TIMER_MS": str(args.timer_ms)},
    }
    duration = 1.0 if args.quick else args.duration
    started = time.monotonic()

    rows: list[dict[str, object]] = []
    with redis_url_or_embedded() as redis_url:
        for gpus in [1] if args.quick else args.gpus:
            loads = LOADS if args.loads is None else args.loads
            levels = [
                (load, 10.0 if load is None else gpus * PER_GPU_RPS * load / 100) for load in loads
            ]
            if args.quick:  # the same code paths at a scale a test can afford
                levels = [(None, 10.0), (5, 50.0)]
            for design in DESIGNS:
                if design.name in args.designs:
                    design = replace(design, env={**design.env, **tuned.get(design.name, {})})
                    for _ in range(args.repeat):
                        rows += run_design(
                            design,
                            gpus,
                            levels,
                            duration,
                            redis_url,
                            then_bare=design.name == "ours",
                        )
    rows = median_rows(rows)
    for row in rows:
        if row["design"] == "ours":
            row.update(simulate_row(row, duration))

    machine = describe_machine()
    elapsed = time.monotonic() - started
    from bench.report import write_report

    write_report(rows, args.out, machine=machine, duration_s=duration, elapsed_s=elapsed)
    print(f"\nwrote {args.out}/results.md, results.json and the plots in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
