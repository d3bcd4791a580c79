"""Front-end figures of the batching service, measured on real processes in one run.

    .venv/bin/python -m bench frontend [--quick]
    .venv/bin/python -m bench frontend --against e921270   # parts 1 and 2, this tree against
                                                           # an older commit, alternating

Starts its own Redis (embedded unless REDIS_URL is set), Celery worker(s) with the simulated
sampler and gunicorn, then measures and prints a markdown table of:
  1. single-request latency (sequential requests) against SIMULATED_BATCH_MS;
  2. front-end CPU ms per request (gunicorn master + workers, from /proc) on the full
     /sample path, on /v1/completions with one prompt (JSON in and out, as the openai client
     sends it), on a bare Django view served the same way (/healthz), same load, and on a
     /sample refused as late (a 503 before any Redis call, its X-Request-Start 5 s old);
  3. the deadline's accuracy: 504 latency minus the deadline, sequential, the queue's one
     worker stalled (it heartbeats and takes no batch: bench.harness.stalled);
  4. simultaneous waits one node (2 processes) holds: N requests sent over 1.5 s to a queue
     whose worker is stalled, with a 3 s deadline, so that all N wait at once, for gevent (the
     default) and gthread (GUNICORN_CMD_ARGS); each should get its 504 at the deadline.
     Latencies are seen by the client, which runs on the same 2 cores.
Rounds alternate between the compared cases and medians are reported: the machine is noisy.
The clients run on gevent: `python -m bench` patches it before this package is imported.
"""

from __future__ import annotations

import argparse
import os

from gevent import monkey

from bench.frontend.against import compare
from bench.frontend.parts import (
    Rows,
    Stacks,
    cpu_per_request,
    deadline_accuracy,
    simultaneous_waits,
    single_latency,
)
from bench.harness.report import markdown_table
from devstack.embedded_redis import redis_url_or_embedded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    parser.add_argument(
        "--cpu-only", action="store_true", help="only the front-end CPU per request (part 2)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of part 2 (default 3)")
    parser.add_argument("--against", help="a git ref: parts 1 and 2 for it and this tree")


def main(args: argparse.Namespace) -> None:
    if not monkey.is_module_patched("socket"):
        raise SystemExit("the front-end benchmark runs on gevent: python -m bench frontend")
    rounds = 1 if args.quick else args.rounds
    cpu_requests = 100 if args.quick else 1000
    sequential = 10 if args.quick else 100
    if args.against:
        return compare(args.against, rounds, cpu_requests, sequential)
    waits = 150 if args.quick else 3000
    batch_ms = int(os.environ.get("SIMULATED_BATCH_MS", "100"))
    deadline_ms = int(os.environ.get("SAMPLING_DEADLINE_MS", "500"))
    rows: Rows = []
    with redis_url_or_embedded() as redis_url:
        stacks = Stacks(redis_url)
        try:
            service = stacks.start("sim", [None])
            rows += single_latency(service, sequential, batch_ms)
            rows += cpu_per_request(service, rounds, cpu_requests)
            if not args.cpu_only:
                rows += deadline_accuracy(stacks, sequential, deadline_ms)
                rows += simultaneous_waits(stacks, waits)
        finally:
            stacks.stop()
    report(rows, batch_ms, deadline_ms, rounds)


def report(rows: Rows, batch_ms: int, deadline_ms: int, rounds: int) -> None:
    print(f"\nMachine: {os.cpu_count()} cores; SIMULATED_BATCH_MS={batch_ms}, "
          f"SAMPLING_DEADLINE_MS={deadline_ms}; medians of {rounds} round(s)\n")  # fmt: skip
    print(markdown_table(["measure", "value"], rows, align="ll"))
