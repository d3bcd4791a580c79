"""A burst inside a lighter minute: what the GPU recommendation says during and after it.

    .venv/bin/python -m bench burst [--base-rate 500] [--burst-rate 1300]
        [--before-seconds 40] [--burst-seconds 20] [--after-seconds 30]

One simulated GPU (100 ms a call, batches of 100: a limit of 1,000 req/s) behind gunicorn
with 2 gevent processes, offered `--base-rate` for `--before-seconds`, then `--burst-rate`
for `--burst-seconds`, then the base rate again, by the harness's open-loop generator on
the same cores. Every second it reads `sampling_gpus_recommended` from `/metrics`, as an
autoscaler would. It prints, per phase, what was offered and answered, and the gauge's
values (the first second each value was read, from the phase's start). The bar: 1 GPU
before the burst, 2 within the burst's first 10 s until its end, and 2 through the base
rate's first 30 s after it (the recommendation plans for the last minute's busiest 10 s:
batching.recommendation).
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench.harness import loadgen
from bench.harness.machine import describe_machine
from bench.harness.procstat import metric_samples
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from devstack.embedded_redis import EmbeddedRedis
from workers.samplers.simulated import expected_completion

CALL_MS, MAX_BATCH = 100, 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-rate", type=float, default=500.0, help="req/s, default 500")
    parser.add_argument("--burst-rate", type=float, default=1300.0, help="req/s, default 1,300")
    parser.add_argument("--before-seconds", type=float, default=40.0, help="default 40")
    parser.add_argument("--burst-seconds", type=float, default=20.0, help="default 20")
    parser.add_argument("--after-seconds", type=float, default=30.0, help="default 30")


def _prompt(phase: str, index: int) -> str:
    return f"{phase} {index}"


def _gauge(stack: Stack) -> float | None:
    samples = metric_samples(stack.port, "sampling_gpus_recommended")
    return samples[0][1] if samples else None


def _poll(stack: Stack, readings: list[tuple[float, float]], stop: threading.Event) -> None:
    started = time.monotonic()
    while not stop.wait(1.0):
        try:
            value = _gauge(stack)
        except OSError:
            continue
        if value is not None:
            readings.append((time.monotonic() - started, value))


def main(args: argparse.Namespace) -> None:
    phases = [
        ("before", args.base_rate, args.before_seconds),
        ("burst", args.burst_rate, args.burst_seconds),
        ("after", args.base_rate, args.after_seconds),
    ]
    server = EmbeddedRedis().start()
    queue = new_queue("burst")
    env = simulated_env(server.url, queue, call_ms=CALL_MS, max_batch=MAX_BATCH)
    stack = simulated_stack(env, [0], log_dir=Path("/tmp") / f"bench-{queue}")
    readings: list[tuple[float, float]] = []
    stop = threading.Event()
    rows, spans = [], []
    try:
        stack.start(timeout_s=120)
        poller = threading.Thread(target=_poll, args=(stack, readings, stop), daemon=True)
        poller.start()
        started = time.monotonic()
        for seed, (name, rate, seconds) in enumerate(phases, start=1):
            begin = time.monotonic() - started
            results = loadgen.run(
                "127.0.0.1", stack.port, "/sample", rate, seconds,
                functools.partial(_prompt, name), expected_completion, seed=seed, stamp=True,
            )  # fmt: skip
            spans.append((name, begin, time.monotonic() - started))
            rows.append((name, rate, seconds, Counter(results.outcomes)))
        stop.set()
        poller.join(timeout=10)
    finally:
        stack.stop()
        server.stop()
    print(report(rows, spans, readings))
    print(describe_machine())
    sys.exit(0 if verdict(spans, readings) else 1)


def _values(readings: list[tuple[float, float]], begin: float, end: float) -> str:
    """The gauge's values in [begin, end), each with the second it was first read at."""
    first: dict[float, float] = {}
    for at, value in readings:
        if begin <= at < end:
            first.setdefault(value, at - begin)
    return ", ".join(f"{value:g} (from {at:.0f} s)" for value, at in first.items()) or "-"


def report(
    rows: list[tuple[str, float, float, Counter[str]]],
    spans: list[tuple[str, float, float]],
    readings: list[tuple[float, float]],
) -> str:
    lines = [
        "| phase | offered req/s | seconds | 200 | 503 | 504 | other | sampling_gpus_recommended |",
        "|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for (name, rate, seconds, outcomes), (_, begin, end) in zip(rows, spans, strict=True):
        other = sum(outcomes.values()) - outcomes["ok"] - outcomes["rejected"]
        other -= outcomes["timeout"]
        lines.append(
            f"| {name} | {rate:,.0f} | {seconds:g} | {outcomes['ok']:,} | "
            f"{outcomes['rejected']:,} | {outcomes['timeout']:,} | {other:,} | "
            f"{_values(readings, begin, end)} |"
        )
    return "\n".join(lines)


def verdict(spans: list[tuple[str, float, float]], readings: list[tuple[float, float]]) -> bool:
    """1 before the burst (its first 20 s aside: the minute fills), 2 from the burst's 10th
    second to its end and through the next 30 s."""
    (_, before_start, before_end), (_, burst_start, burst_end), _ = spans
    checks = {
        "before": ([v for at, v in readings if before_start + 20 <= at < before_end], {1.0}),
        "burst": ([v for at, v in readings if burst_start + 10 <= at < burst_end], {2.0}),
        "after": ([v for at, v in readings if burst_end <= at < burst_end + 30], {2.0}),
    }
    passed = True
    for name, (values, wanted) in checks.items():
        ok = bool(values) and set(values) <= wanted
        passed &= ok
        print(f"{name}: {'as planned' if ok else 'NOT as planned'} ({sorted(set(values))})")
    return passed
