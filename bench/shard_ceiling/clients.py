"""The shard ceiling's client processes: each runs threads that call
BatchAggregator.append open-loop at the step's rate (bench.shard_ceiling)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any

import redis

from batching.aggregator import BatchAggregator

MAX_BATCH = 100
DEADLINE_MS = 500
BUDGET_MS = DEADLINE_MS


@dataclass(frozen=True)
class Step:
    """One client process's part of a step."""

    rate_rps: float  # this process's share of the offered rate
    seconds: float
    start_at: float  # epoch seconds
    arrivals: str  # "poisson" or "even"
    seed: int
    first_thread: int  # this process's first thread, of `threads_total`
    threads_total: int


@dataclass
class Share:
    """One client process's results of a step."""

    latencies_ms: list[float]
    late_ms: list[float]  # actual minus intended send time
    errors: int
    rejected: int
    cpu_s: float
    example_error: str = ""


@dataclass
class ThreadResults:
    latencies_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    rejected: int = 0


def run_thread(
    aggregator: BatchAggregator, step: Step, rate_rps: float, index: int, out: ThreadResults
) -> None:
    """One thread's open loop: send at the intended times until the step's end."""
    rng = random.Random(step.seed * 1000 + index)
    start = time.perf_counter() + (step.start_at - time.time())
    end = start + step.seconds
    global_index = step.first_thread + index
    if step.arrivals == "even":
        at = start + global_index / step.threads_total / rate_rps
    else:
        at = start + rng.expovariate(rate_rps)
    count = 0
    while at < end:
        now = time.perf_counter()
        if now < at:
            time.sleep(at - now)
            now = time.perf_counter()
        if now >= end:
            break
        prompt = f"ceiling {global_index} {count}"
        try:
            before = time.perf_counter()
            ticket = aggregator.append(prompt, BUDGET_MS)
            after = time.perf_counter()
            out.latencies_ms.append((after - before) * 1000)
            out.late_ms.append((before - at) * 1000)
            if ticket.rejected:
                out.rejected += 1
            elif ticket.opened:
                aggregator.dispatched(ticket.batch_id)
        except redis.RedisError as exc:
            out.errors.append(repr(exc))
        count += 1
        at += 1 / rate_rps if step.arrivals == "even" else rng.expovariate(rate_rps)


def client_process(
    url: str, queue: str, threads: int, steps: Queue[Step | None], results: Queue[Any]
) -> None:
    """A client process: `threads` connections of its own; runs the steps it is sent."""
    aggregators = []
    for _ in range(threads):
        client = redis.Redis.from_url(url, socket_timeout=5.0, single_connection_client=True)
        client.ping()
        aggregators.append(
            BatchAggregator(client, queue, max_batch_size=MAX_BATCH, deadline_ms=DEADLINE_MS)
        )
    results.put("ready")
    while (step := steps.get()) is not None:
        outs = [ThreadResults() for _ in range(threads)]
        workers = [
            threading.Thread(
                target=run_thread, args=(aggregators[i], step, step.rate_rps / threads, i, outs[i])
            )
            for i in range(threads)
        ]
        cpu_before = time.process_time()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        errors = [error for out in outs for error in out.errors]
        results.put(
            Share(
                latencies_ms=[value for out in outs for value in out.latencies_ms],
                late_ms=[value for out in outs for value in out.late_ms],
                errors=len(errors),
                rejected=sum(out.rejected for out in outs),
                cpu_s=time.process_time() - cpu_before,
                example_error=errors[0] if errors else "",
            )
        )
