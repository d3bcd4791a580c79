"""The designs compared, and one design's service measured at each load level (bench.compare)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batching.keys import QueueKeys
from batching.outcomes import RequestOutcome
from batching.policy import MAX_BATCH_SIZE, Policy
from bench.baselines import calls_key
from bench.harness import loadgen
from bench.harness.procstat import cpu_seconds, redis_commands
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from bench.harness.stats import percentile
from workers.samplers.simulated import expected_completion

BATCH_MS = 100
MAX_BATCH = MAX_BATCH_SIZE
DEADLINE_MS = Policy.deadline_ms
PER_GPU_RPS = MAX_BATCH * 1000 / BATCH_MS
LOADS = [None, 50, 90, 100, 150, 200]  # None: 10 req/s
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
# with 50, 100 and 250 ms: its limit is elsewhere (docs/benchmarks/compare.md).
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
    if design.post:
        return expected_completion
    return lambda prompt: "ok\n"


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
        "send_lag_p99_ms": percentile(results.send_lag_ms, 99),
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
    queue = new_queue(f"bench-{design.name.replace(' ', '-')}-{gpus}")
    env = simulated_env(
        redis_url, queue, call_ms=BATCH_MS, max_batch=MAX_BATCH, deadline_ms=DEADLINE_MS,
        DJANGO_SETTINGS_MODULE=design.settings,
    ) | design.env  # fmt: skip
    stack = simulated_stack(
        env, list(range(gpus)), worker_args=design.worker_args,
        log_dir=Path("/tmp") / "bench-compare" / queue,
    )  # fmt: skip
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
