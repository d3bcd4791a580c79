"""When a canary is worse than its baseline: the rule that rolls a new version back.

An alias's target marked as a canary is compared with the alias's other targets that take
traffic (its baseline), over the last `window_s` seconds of their statistics (every web
process's counts, flushed each second; batching.stats). For each, of the requests that
reached the model (all but those refused before a batch: bad requests, no valid key, over a
rate limit), the **on-time rate** is the share answered 200 within the deadline, and the
**error rate** the share that ended in a 5xx of the service's own (a failed sampler or row,
Redis or the broker away, no live worker).

The canary is worse when, with at least `min_requests` requests on each side, its on-time rate
is below the baseline's, or its error rate above it, by more than `margin`, and the
difference is significant: a one-sided two-proportion z-test (pooled) with z above `z`
(3.0: about one chance in 740 that a canary as good as its baseline is rolled back by chance
at one look). Both conditions at once: the margin keeps a small, real difference from
rolling back a canary; the test keeps noise on few requests from doing it.

Django-free: statistics in, a verdict out.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import redis

from batching import stats
from batching.outcomes import RequestOutcome

# The outcomes of requests that reached the model: all but those refused before any batch.
REACHED_THE_MODEL = (
    RequestOutcome.OK,
    RequestOutcome.TIMEOUT,
    RequestOutcome.ERROR,
    RequestOutcome.REJECTED,
)


@dataclass(frozen=True)
class Rule:
    window_s: int = 60
    min_requests: int = 200
    margin: float = 0.05
    z: float = 3.0


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: requests that reached the model, and how they ended."""

    requests: int = 0
    on_time: int = 0
    errors: int = 0

    @classmethod
    def of(cls, counts: Counter[str]) -> Arm:
        summary = stats.Summary(counts, 1)
        return cls(
            sum(summary.requests(outcome) for outcome in REACHED_THE_MODEL),
            summary.requests(RequestOutcome.OK),
            summary.requests(RequestOutcome.ERROR),
        )

    def __add__(self, other: Arm) -> Arm:
        return Arm(
            self.requests + other.requests,
            self.on_time + other.on_time,
            self.errors + other.errors,
        )

    def rate(self, count: int) -> float:
        return count / self.requests if self.requests else 0.0

    def as_json(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "on_time_rate": round(self.rate(self.on_time), 4),
            "error_rate": round(self.rate(self.errors), 4),
        }


@dataclass(frozen=True)
class Verdict:
    """Why a canary is rolled back: the measure, both arms' figures and the test's z."""

    measure: str  # "on-time rate" or "error rate"
    canary: Arm
    baseline: Arm
    z: float

    def summary(self) -> str:
        c, b = self.canary, self.baseline
        if self.measure == "on-time rate":
            ours, theirs = c.rate(c.on_time), b.rate(b.on_time)
        else:
            ours, theirs = c.rate(c.errors), b.rate(b.errors)
        return (
            f"{self.measure} {ours:.1%} of {c.requests:,} requests against the baseline's "
            f"{theirs:.1%} of {b.requests:,} (z = {self.z:.1f})"
        )


def z_score(successes_a: int, total_a: int, successes_b: int, total_b: int) -> float:
    """How many standard errors a's proportion is above b's (pooled two-proportion test)."""
    if not total_a or not total_b:
        return 0.0
    pooled = (successes_a + successes_b) / (total_a + total_b)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / total_a + 1 / total_b))
    difference = successes_a / total_a - successes_b / total_b
    if spread == 0:
        return 0.0 if difference == 0 else math.copysign(math.inf, difference)
    return difference / spread


def verdict(canary: Arm, baseline: Arm, rule: Rule) -> Verdict | None:
    """The reason to roll `canary` back, or None (not worse, or too few requests to tell)."""
    if canary.requests < rule.min_requests or baseline.requests < rule.min_requests:
        return None
    late_z = z_score(baseline.on_time, baseline.requests, canary.on_time, canary.requests)
    late_by = baseline.rate(baseline.on_time) - canary.rate(canary.on_time)
    if late_by > rule.margin and late_z > rule.z:
        return Verdict("on-time rate", canary, baseline, late_z)
    error_z = z_score(canary.errors, canary.requests, baseline.errors, baseline.requests)
    errors_by = canary.rate(canary.errors) - baseline.rate(baseline.errors)
    if errors_by > rule.margin and error_z > rule.z:
        return Verdict("error rate", canary, baseline, error_z)
    return None


def arm_of(client: redis.Redis, model: str, window_s: int, now_s: float) -> Arm:
    """A model's requests over the last `window_s` whole seconds."""
    current = int(now_s)
    buckets = stats.read_buckets(client, model, stats.SECOND, current - window_s, current)
    return Arm.of(stats.merge(counts for _, counts in buckets))
