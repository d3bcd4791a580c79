"""The soak's verdicts and report: every request answered and none wrong, no process growing,
Redis' keys flat (bench.soak)."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass, field

from batching.outcomes import RequestOutcome
from bench.harness import loadgen
from bench.harness.report import markdown_table

CALL_MS = 100
MAX_BATCH = 100
DEADLINE_MS = 500
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


def verdict(
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
    names = [RequestOutcome.OK, RequestOutcome.REJECTED, RequestOutcome.TIMEOUT,
             loadgen.OTHER, loadgen.WRONG]  # fmt: skip
    labels = {RequestOutcome.OK: "200", RequestOutcome.REJECTED: "503",
              RequestOutcome.TIMEOUT: "504", loadgen.OTHER: "other or none",
              loadgen.WRONG: "wrong"}  # fmt: skip
    answers = [
        [labels[name], result.outcomes[name], f"{result.outcomes[name] / max(1, total):.2%}"]
        for name in names
    ]
    lines = [
        f"Soak of {result.seconds:.0f} s at {result.rate:.0f} req/s: {total} requests; "
        f"{result.late} answered later than {LATE_MS} ms, the slowest in "
        f"{result.slowest_ms:.0f} ms",
        "",
        markdown_table(["answer", "requests", "share"], answers),
    ]
    if result.segments:
        segments = [
            [f"{start:.0f}", sent, *(counts[name] for name in names)]
            for start, sent, counts in result.segments
        ]
        header = ["from (s)", "sent", *(labels[name] for name in names)]
        lines += ["", markdown_table(header, segments, align="r" * len(header))]
    lines += [f"- {event}" for event in result.events]
    for name, example in sorted(result.examples.items()):
        if name != RequestOutcome.OK:
            lines.append(f"- e.g. {labels.get(name, name)}: {example[:160]!r}")
    processes = [
        [name, pid, f"{warm:.1f}", f"{end:.1f}", f"{change:+.1%}"]
        for name, pid, warm, end, change in result.rss_rows
    ]
    header = ["process", "pid", "RSS after warm-up (MB)", "at the end (MB)", "change"]
    lines += ["", markdown_table(header, processes)]
    keys = [
        [what, f"{first:.1f}", f"{last:.1f}", f"{change:+.1%}"]
        for what, first, last, change in result.redis_rows
    ]
    header = ["Redis", "first third (median)", "last third (median)", "change"]
    lines += ["", markdown_table(header, keys), ""]
    lines.append("PASS" if result.passed else "FAIL: " + "; ".join(result.failures))
    return "\n".join(lines)
