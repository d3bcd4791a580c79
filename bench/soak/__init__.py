"""A soak: the service under steady load for minutes, with Redis and a worker restarted on the way.

    .venv/bin/python -m bench soak                 # `make soak`: 10 minutes
    .venv/bin/python -m bench soak --seconds 60    # the version `make test` runs
    .venv/bin/python -m bench soak --rate 700      # 70% of the GPU's limit, on a faster machine

One simulated GPU (100 ms a call, batches of 100: a limit of 1,000 req/s) behind gunicorn with
2 gevent processes, offered 70% of what this machine carries by the harness's load generator
(open loop, Poisson, every 200's body checked, `X-Request-Start` set as a proxy would) on the
same cores. What a 2-core machine of this kind carries is bounded by its web processes' CPU
beside the client: the slowest we ran on carried about 700 req/s (`python -m bench overload
--loads 70 85`: all served at 700, a collapse at 850; faster ones carry the GPU's 1,000), so
490 req/s by default, `--rate` otherwise.
Along the way Redis is killed and started again (at 40% of the run: its data is lost, as in a
crash) and the worker is stopped and started again (at 70%: a deploy). Every few seconds it
samples the RSS of every process and Redis' memory and key count. The verdicts:

- 0 wrong answers, and 0 requests without an answer (a connection error, or none within the
  client's wait of 10 deadlines): a 200, 503 or 504 for each. Answers later than the
  deadline + 100 ms are counted and shown beside, not judged: a restarted worker's start
  takes a core for seconds, and the client shares the cores;
- the RSS of every process at the end within 10% of its value after the warm-up (the first
  minute of a 10-minute soak; a sixth of a shorter one; a restarted process's from its own
  start);
- Redis' memory and key count flat: the number and bytes of the keys that follow traffic
  (everything but the statistics buckets, whose number grows with time up to their TTL and
  is shown beside), their medians over the last third of the run within 10% (plus a small
  floor) of those over the first third after the warm-up.

Prints a table and the verdicts; exits 1 when one fails.
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
from bench.harness.stack import Stack, new_queue, simulated_env, simulated_stack
from bench.soak.samples import key_kinds, sample
from bench.soak.verdict import (
    CALL_MS,
    CLIENT_WAIT_S,
    DEADLINE_MS,
    LATE_MS,
    LOAD_SHARE,
    MACHINE_RPS,
    MAX_BATCH,
    Samples,
    SoakResult,
    report,
    verdict,
)
from devstack.embedded_redis import EmbeddedRedis
from workers.samplers.simulated import expected_completion

__all__ = ["SoakResult", "add_arguments", "main", "report", "run"]
REDIS_RESTART_AT = 0.4
WORKER_RESTART_AT = 0.7


def run(
    seconds: float,
    log_dir: Path | None = None,
    verbose: bool = True,
    rate: float = MACHINE_RPS * LOAD_SHARE,
) -> SoakResult:
    warm_s = min(60.0, seconds / 6)
    segment_s = min(30.0, seconds / 6)
    server = EmbeddedRedis().start()
    queue = new_queue("soak")
    env = simulated_env(
        server.url, queue, call_ms=CALL_MS, max_batch=MAX_BATCH, deadline_ms=DEADLINE_MS
    )
    stack = simulated_stack(env, [0], log_dir=log_dir or Path("/tmp") / f"soak-{queue}")
    outcomes: Counter[str] = Counter()
    examples: dict[str, str] = {}
    samples = Samples()
    stop = threading.Event()
    events: list[str] = []
    segments: list[tuple[float, int, Counter[str]]] = []
    late, slowest_ms = 0, 0.0
    try:
        stack.start(timeout_s=120)
        sampler = threading.Thread(target=sample, args=(stack, server, samples, stop))
        sampler.start()
        started = time.monotonic()
        faults = threading.Thread(
            target=_faults, args=(stack, server, started, seconds, events), daemon=True
        )
        faults.start()
        segment = 0
        while (left := seconds - (time.monotonic() - started)) > 0.5:
            segment_start = time.monotonic() - started
            results = loadgen.run(
                "127.0.0.1", stack.port, "/sample", rate, min(segment_s, left),
                functools.partial(_prompt, segment), expected_completion,
                client_timeout_s=CLIENT_WAIT_S, seed=segment, stamp=True,
            )  # fmt: skip
            outcomes.update(results.outcomes)
            answered = [
                latency
                for latency, outcome in zip(results.latencies_ms, results.outcomes, strict=True)
                if outcome != loadgen.OTHER
            ]
            late += sum(latency > LATE_MS for latency in answered)
            slowest_ms = max([slowest_ms, *answered])
            segments.append((segment_start, results.sent, Counter(results.outcomes)))
            for outcome, example in results.examples.items():
                examples.setdefault(outcome, example)
            if verbose:
                counts = Counter(results.outcomes)
                print(
                    f"  {time.monotonic() - started:6.0f} s: {results.sent} sent, "
                    + ", ".join(f"{name} {count}" for name, count in sorted(counts.items())),
                    flush=True,
                )
            segment += 1
        faults.join(timeout=60)
        if verbose:
            print("  Redis keys at the end, by kind:", key_kinds(server.url), flush=True)
        stop.set()
        sampler.join(timeout=10)
    finally:
        stop.set()
        stack.stop()
        server.stop()
    if verbose:
        for outcome, example in sorted(examples.items()):
            print(f"  e.g. {outcome}: {example[:120]!r}")
    result = verdict(seconds, warm_s, started, outcomes, samples)
    result.segments, result.events, result.examples = segments, events, examples
    result.rate, result.late, result.slowest_ms = rate, late, slowest_ms
    return result


def _prompt(segment: int, index: int) -> str:
    return f"soak {segment} {index}: the prompt"


def _faults(
    stack: Stack, server: EmbeddedRedis, started: float, seconds: float, events: list[str]
) -> None:
    time.sleep(max(0.0, started + seconds * REDIS_RESTART_AT - time.monotonic()))
    server.kill()
    server.start()
    events.append(f"{time.monotonic() - started:.0f} s: Redis killed and started again")
    time.sleep(max(0.0, started + seconds * WORKER_RESTART_AT - time.monotonic()))
    stack.stop_process(stack.workers[0])
    stack.restart_worker(0)
    events.append(f"{time.monotonic() - started:.0f} s: the worker stopped and started again")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=600.0, help="default 600 (10 minutes)")
    parser.add_argument(
        "--rate",
        type=float,
        default=MACHINE_RPS * LOAD_SHARE,
        help=f"requests a second (default {MACHINE_RPS * LOAD_SHARE:.0f}: "
        f"{LOAD_SHARE * 100:.0f}%% of the {MACHINE_RPS} the slowest machine we ran on carries)",
    )


def main(args: argparse.Namespace) -> None:
    result = run(args.seconds, rate=args.rate)
    print()
    print(report(result))
    sys.exit(0 if result.passed else 1)
