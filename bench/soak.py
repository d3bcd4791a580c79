"""A soak: the service under steady load for minutes, with Redis and a worker restarted on the way.

    .venv/bin/python -m bench.soak                 # `make soak`: 10 minutes
    .venv/bin/python -m bench.soak --seconds 60    # the version `make test` runs
    .venv/bin/python -m bench.soak --rate 700      # 70% of the GPU's limit, on a faster machine

One simulated GPU (100 ms a call, batches of 100: a limit of 1,000 req/s) behind gunicorn with 2
gevent processes, offered 70% of what this machine carries by `bench/loadgen.py` (open loop,
Poisson, every 200's body checked, `X-Request-Start` set as a proxy would) on the same cores.
What a 2-core machine of this kind carries is bounded by its web processes' CPU beside the
client: the slowest we ran on carried about 700 req/s (`python -m bench.overload --loads 70
85`: all served at 700, a collapse at 850; faster ones carry the GPU's 1,000), so 490 req/s
by default, `--rate` otherwise.
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
import contextlib
import functools
import re
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from batching.outcomes import RequestOutcome
from bench import loadgen
from bench.overload import CALL_MS, DEADLINE_MS, MAX_BATCH, simulated_env
from inference_site.lib.embedded_redis import EmbeddedRedis
from inference_site.lib.stack import ROOT, Stack
from workers.samplers.simulated import expected_completion

LIMIT_RPS = MAX_BATCH * 1000 / CALL_MS
# What this kind of machine carries (the docstring): the slowest 2-core one we ran on, shared
# with the load generator, served 700 req/s of /sample and collapsed at 850, under the
# simulated GPU's 1,000.
MACHINE_RPS = 700
LOAD_SHARE = 0.7
# The client's wait: a request unanswered this long has no answer.
CLIENT_WAIT_S = 10 * DEADLINE_MS / 1000
LATE_MS = DEADLINE_MS + 100
SAMPLE_EVERY_S = 2.0
RSS_TOLERANCE = 0.10
FLAT_TOLERANCE = 0.10
# Floors under the flatness checks: a few batches' keys and their bytes come and go.
FLAT_KEYS_FLOOR = 50
FLAT_MEMORY_FLOOR_BYTES = 2 * 1024 * 1024
STATS_KEY = re.compile(r":stats:\d+:\d+$")  # batching.keys' statistics buckets
REDIS_RESTART_AT = 0.4
WORKER_RESTART_AT = 0.7


@dataclass
class Samples:
    # pid -> (name, started (monotonic), [(monotonic, rss bytes)])
    rss: dict[int, tuple[str, float, list[tuple[float, int]]]] = field(default_factory=dict)
    # (t, the bytes and number of the keys that follow traffic, statistics keys, used_memory)
    redis: list[tuple[float, int, int, int, int]] = field(default_factory=list)


@dataclass
class SoakResult:
    seconds: float
    outcomes: Counter[str]
    rss_rows: list[tuple[str, int, float, float, float]]  # name, pid, warm MB, end MB, change
    redis_rows: list[tuple[str, float, float, float]]  # what, first third, last third, change
    failures: list[str]
    segments: list[tuple[float, int, Counter[str]]] = field(default_factory=list)  # start s
    events: list[str] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # an answer of each outcome
    rate: float = MACHINE_RPS * LOAD_SHARE
    late: int = 0  # answers later than LATE_MS
    slowest_ms: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


def _processes(stack: Stack, server: EmbeddedRedis) -> dict[int, str]:
    found: dict[int, str] = {}
    if stack.web is not None and stack.web.poll() is None:
        found[stack.web.pid] = "gunicorn master"
        with_children = psutil.Process(stack.web.pid).children()
        for number, child in enumerate(sorted(with_children, key=lambda p: p.pid)):
            found[child.pid] = f"web process {number + 1}"
    for worker in stack.workers:
        if worker.poll() is None:
            found[worker.pid] = "celery worker"
    if server.process is not None and server.process.poll() is None:
        found[server.process.pid] = "redis-server"
    return found


def _sample(stack: Stack, server: EmbeddedRedis, samples: Samples, stop: threading.Event) -> None:
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    while not stop.wait(SAMPLE_EVERY_S):
        now = time.monotonic()
        for pid, name in _processes(stack, server).items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
            if not rss:
                continue  # exited, not yet reaped: no memory to judge
            samples.rss.setdefault(pid, (name, now, []))[2].append((now, rss))
        with contextlib.suppress(redis.RedisError):  # down: restarted meanwhile
            samples.redis.append((now, *_redis_figures(client)))


def _redis_figures(client: redis.Redis) -> tuple[int, int, int, int]:
    """The bytes and number of Redis' keys that follow traffic (batches, items, results,
    counters, heartbeats...); the number of statistics buckets, which grow with time until
    their TTL (batching.stats.TTL_S: 15 minutes of seconds, 2 hours of 10 seconds) and are
    judged by that bound, not here; and INFO's used_memory, for the record."""
    traffic, buckets = [], 0
    for key in client.scan_iter(count=1000):
        if STATS_KEY.search(key.decode(errors="replace")):
            buckets += 1
        else:
            traffic.append(key)
    with client.pipeline(transaction=False) as pipe:
        for key in traffic:
            pipe.memory_usage(key)
        sizes = pipe.execute()
    used = int(client.info("memory")["used_memory"])
    return sum(size or 0 for size in sizes), len(traffic), buckets, used


def run(
    seconds: float,
    log_dir: Path | None = None,
    verbose: bool = True,
    rate: float = MACHINE_RPS * LOAD_SHARE,
) -> SoakResult:
    warm_s = min(60.0, seconds / 6)
    segment_s = min(30.0, seconds / 6)
    server = EmbeddedRedis().start()
    queue = f"soak-{uuid.uuid4().hex[:6]}"
    env = simulated_env(server.url, queue)
    stack = Stack(env=env, gpus=[0], web_processes=2, root=ROOT,
                  log_dir=log_dir or Path("/tmp") / f"soak-{queue}", own_database=True)  # fmt: skip
    outcomes: Counter[str] = Counter()
    examples: dict[str, str] = {}
    samples = Samples()
    stop = threading.Event()
    events: list[str] = []
    segments: list[tuple[float, int, Counter[str]]] = []
    late, slowest_ms = 0, 0.0
    try:
        stack.start(timeout_s=120)
        sampler = threading.Thread(target=_sample, args=(stack, server, samples, stop))
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
            print("  Redis keys at the end, by kind:", _key_kinds(server.url), flush=True)
        stop.set()
        sampler.join(timeout=10)
    finally:
        stop.set()
        stack.stop()
        server.stop()
    if verbose:
        for outcome, example in sorted(examples.items()):
            print(f"  e.g. {outcome}: {example[:120]!r}")
    result = _verdict(seconds, warm_s, started, outcomes, samples)
    result.segments, result.events, result.examples = segments, events, examples
    result.rate, result.late, result.slowest_ms = rate, late, slowest_ms
    return result


def _prompt(segment: int, index: int) -> str:
    return f"soak {segment} {index}: the prompt"


def _key_kinds(url: str) -> dict[str, int]:
    """Redis' keys by their name less ids and numbers: what a growing key count is made of."""
    kinds: Counter[str] = Counter()
    for key in redis.Redis.from_url(url).scan_iter(count=1000):
        name = key.decode(errors="replace")
        kinds[re.sub(r"[0-9a-f]{12,}|\d+", "#", name)] += 1
    return dict(kinds.most_common(12))


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


def _verdict(
    seconds: float, warm_s: float, started: float, outcomes: Counter[str], samples: Samples
) -> SoakResult:
    failures = []
    if outcomes[loadgen.WRONG]:
        failures.append(f"{outcomes[loadgen.WRONG]} wrong answers")
    if outcomes[loadgen.OTHER]:
        failures.append(f"{outcomes[loadgen.OTHER]} requests without a 200, 503 or 504")
    rss_rows = []
    for pid, (name, first_seen, points) in sorted(samples.rss.items()):
        if name == "redis-server":
            continue  # its memory is judged by INFO below (a restart empties it)
        warm_at = max(started + warm_s, first_seen + warm_s)
        warm = [rss for at, rss in points if at >= warm_at]
        if len(warm) < 2:
            continue  # started too late in the run to have a warm value
        change = warm[-1] / warm[0] - 1
        rss_rows.append((name, pid, warm[0] / 2**20, warm[-1] / 2**20, change))
        if change > RSS_TOLERANCE:
            failures.append(f"{name} (pid {pid}) RSS grew {change:.1%} after its warm-up")
    redis_rows = []
    after_warm = [point for point in samples.redis if point[0] >= started + warm_s]
    third = max(1, len(after_warm) // 3)
    for what, column, floor, judged in [
        ("memory of the keys that follow traffic (MB)", 1, FLAT_MEMORY_FLOOR_BYTES, True),
        ("keys that follow traffic", 2, FLAT_KEYS_FLOOR, True),
        ("statistics buckets (bounded by their TTL)", 3, 0, False),
        ("Redis used_memory (MB)", 4, 0, False),
    ]:
        if len(after_warm) < 3:
            failures.append(f"{what}: too few samples")
            continue
        first = statistics.median(point[column] for point in after_warm[:third])
        last = statistics.median(point[column] for point in after_warm[-third:])
        change = last / first - 1 if first else 0.0
        scale = 2**20 if column in (1, 4) else 1
        redis_rows.append((what, first / scale, last / scale, change))
        if judged and last > first * (1 + FLAT_TOLERANCE) + floor:
            failures.append(f"{what} grew from {first / scale:.1f} to {last / scale:.1f}")
    return SoakResult(seconds, outcomes, rss_rows, redis_rows, failures)


def report(result: SoakResult) -> str:
    total = sum(result.outcomes.values())
    lines = [
        f"Soak of {result.seconds:.0f} s at {result.rate:.0f} req/s: {total} requests; "
        f"{result.late} answered later than {LATE_MS} ms, the slowest in "
        f"{result.slowest_ms:.0f} ms",
        "",
        "| answer | requests | share |",
        "|---|--:|--:|",
    ]
    names = [RequestOutcome.OK, RequestOutcome.REJECTED, RequestOutcome.TIMEOUT,
             loadgen.OTHER, loadgen.WRONG]  # fmt: skip
    labels = {RequestOutcome.OK: "200", RequestOutcome.REJECTED: "503",
              RequestOutcome.TIMEOUT: "504", loadgen.OTHER: "other or none",
              loadgen.WRONG: "wrong"}  # fmt: skip
    for name in names:
        count = result.outcomes[name]
        lines.append(f"| {labels[name]} | {count} | {count / max(1, total):.2%} |")
    if result.segments:
        lines += ["", "| from (s) | sent | " + " | ".join(labels[name] for name in names) + " |",
                  "|--:|--:|" + "--:|" * len(names)]  # fmt: skip
        for start, sent, counts in result.segments:
            cells = " | ".join(str(counts[name]) for name in names)
            lines.append(f"| {start:.0f} | {sent} | {cells} |")
    lines += [f"- {event}" for event in result.events]
    for name, example in sorted(result.examples.items()):
        if name != RequestOutcome.OK:
            lines.append(f"- e.g. {labels.get(name, name)}: {example[:160]!r}")
    lines += ["", "| process | pid | RSS after warm-up (MB) | at the end (MB) | change |",
              "|---|--:|--:|--:|--:|"]  # fmt: skip
    for name, pid, warm, end, change in result.rss_rows:
        lines.append(f"| {name} | {pid} | {warm:.1f} | {end:.1f} | {change:+.1%} |")
    lines += ["", "| Redis | first third (median) | last third (median) | change |",
              "|---|--:|--:|--:|"]  # fmt: skip
    for what, first, last, change in result.redis_rows:
        lines.append(f"| {what} | {first:.1f} | {last:.1f} | {change:+.1%} |")
    lines.append("")
    lines.append("PASS" if result.passed else "FAIL: " + "; ".join(result.failures))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="default 600 (10 minutes)")
    parser.add_argument(
        "--rate",
        type=float,
        default=MACHINE_RPS * LOAD_SHARE,
        help=f"requests a second (default {MACHINE_RPS * LOAD_SHARE:.0f}: {LOAD_SHARE:.0%} of "
        f"the {MACHINE_RPS} the slowest machine we ran on carries)",
    )
    args = parser.parse_args()
    result = run(args.seconds, rate=args.rate)
    print()
    print(report(result))
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    main()
