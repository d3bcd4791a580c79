"""When a canary is worse than its baseline: a sequential test that stays right however often
it is looked at.

An alias's target marked as a canary runs a **trial** against the alias's other targets that
take traffic (its baseline). The trial adds up both sides' statistics one 10-second bucket at a
time (a `cluster`: telemetry.stats's buckets, which every web process's counts reach within a
second or two). Only quality outcomes count, of the requests that reached a batch:
- the **late rate**: the share that got a 504 (no answer within the deadline);
- the **error rate**: the share that ended in a 5xx of the service's own (a failed sampler or
  row, Redis or the broker away).
Capacity refusals (admission's 503s and the 503s of a target with no live worker) are counted
apart: they say the canary lacks capacity, not that its version is worse, so they pause its
ramp and never roll it back.

Requests end in whole batches (one slow call makes up to 100 late at once), so their outcomes
are not independent. The variance of each rate is therefore estimated from the clusters (the
ratio estimator's: a burst inflates its own variance), never below the binomial one.

The test is a mixture sequential probability ratio test (mSPRT): for each measure, the evidence
that the canary is worse than its baseline by more than `margin`, a normal mixture of scale
`spread` over the difference. It may be computed after every cluster for the trial's whole life:
a canary as good as its baseline (worse by `margin` at most) is rolled back with probability at
most `false_rollback`, however long the trial runs and however often it is judged. Both
measures share that budget (half each).

Every formula here takes plain numbers or numpy arrays alike (`log` and `maximum` are passed
in), so that the simulation test (tests/unit/test_canary_simulation.py) judges a thousand
canary-days with this very code.

Django-free: statistics in, a verdict out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

import redis

from batching.outcomes import RequestOutcome
from telemetry import stats

# One cluster: a 10-second statistics bucket (kept 2 hours in Redis).
CLUSTER_S = stats.TEN_SECONDS
# The two quality measures, each a share of the requests that reached a batch.
LATE, ERRORS = "late", "errors"
MEASURES = (LATE, ERRORS)
# A canary with a ramp doubles its weight after this long watched (operations.canary).
RAMP_EVERY_S = 600
# The trial's states, as the stats page and the registry's history say them.
TOO_EARLY = "too early"  # fewer requests or clusters than a verdict needs
WATCHING = "watching"  # no evidence that the canary is worse
PAUSED = "paused"  # capacity refusals in the last minute: its ramp waits
WORSE = "worse"  # rolled back


@dataclass(frozen=True)
class Rule:
    margin: float = 0.01  # the difference tolerated: worse by more than this is worse
    false_rollback: float = 0.01  # a good canary's chance of ever being rolled back
    min_requests: int = 200  # the canary's quality requests before any verdict
    min_clusters: int = 30  # 10 s clusters on each side before any verdict (5 minutes)
    spread: float = 0.03  # the mixture's scale: the size of difference the test looks for

    @property
    def threshold(self) -> float:
        """The log evidence that rolls back: ln(1 / (false_rollback / measures))."""
        return math.log(len(MEASURES) / self.false_rollback)


@dataclass(frozen=True)
class Cluster:
    """One 10 s bucket of one side: its quality requests and how many went wrong, its
    capacity refusals, and its offline lines (a class of their own, outside the verdict)."""

    requests: int = 0
    late: int = 0
    errors: int = 0
    refused: int = 0
    offline_ok: int = 0
    offline_errors: int = 0

    @classmethod
    def of(cls, counts: Mapping[str, int], via: str = "") -> Cluster:
        """A bucket's cluster: of the requests that came through the alias `via` (all the
        model's requests without one), and the model's offline lines."""
        prefix = f"{stats.VIA_PREFIX}{via}:" if via else ""

        def count(name: str) -> int:
            return max(0, counts.get(prefix + name, 0))  # never below 0, whatever Redis holds

        no_worker = count(stats.NO_WORKER)
        errors = max(0, count("req:" + RequestOutcome.ERROR) - no_worker)
        late = count("req:" + RequestOutcome.TIMEOUT)
        on_time = count("req:" + RequestOutcome.OK)
        refused = count("req:" + RequestOutcome.REJECTED) + no_worker
        offline = (max(0, counts.get(stats.OFFLINE_OK, 0)),
                   max(0, counts.get(stats.OFFLINE_ERRORS, 0)))  # fmt: skip
        return cls(on_time + late + errors, late, errors, refused, *offline)

    def __add__(self, other: Cluster) -> Cluster:
        return Cluster(
            *(mine + theirs for mine, theirs in zip(astuple(self), astuple(other), strict=True))
        )

    def bad(self, measure: str) -> int:
        return self.late if measure == LATE else self.errors


@dataclass(frozen=True)
class Sums:
    """One side's running sums for one measure, over its clusters: what the cluster-robust
    variance of its rate needs. Each field may be a number or a numpy array."""

    clusters: Any = 0  # clusters with at least one request
    requests: Any = 0
    bad: Any = 0
    requests_sq: Any = 0  # the sum of each cluster's requests squared
    cross: Any = 0  # the sum of requests x bad
    bad_sq: Any = 0

    def plus(self, requests: int, bad: int) -> Sums:
        if not requests:
            return self
        return Sums(
            self.clusters + 1,
            self.requests + requests,
            self.bad + bad,
            self.requests_sq + requests * requests,
            self.cross + requests * bad,
            self.bad_sq + bad * bad,
        )

    def rate(self) -> Any:
        return self.bad / self.requests

    def variance(self, maximum: Callable[[Any, Any], Any] = max) -> Any:
        """The variance of `rate()`: the ratio estimator's over the clusters, and at least the
        binomial variance (of a rate smoothed off 0 and 1)."""
        n, k, rate = self.requests, self.clusters, self.rate()
        residuals = self.bad_sq - 2 * rate * self.cross + rate * rate * self.requests_sq
        clustered = residuals / (n * n) * k / (k - 1)
        smoothed = (self.bad + 0.5) / (n + 1)
        return maximum(clustered, smoothed * (1 - smoothed) / n)


def log_evidence(
    canary: Sums,
    baseline: Sums,
    rule: Rule,
    log: Callable[[Any], Any] = math.log,
    maximum: Callable[[Any, Any], Any] = max,
) -> Any:
    """The mSPRT's log likelihood ratio that the canary's rate exceeds the baseline's by more
    than `rule.margin` (normal mixture of scale `rule.spread`; below 0 when it does not)."""
    variance = canary.variance(maximum) + baseline.variance(maximum)
    excess = maximum(canary.rate() - baseline.rate() - rule.margin, 0.0)
    mixture = rule.spread * rule.spread
    return 0.5 * log(variance / (variance + mixture)) + mixture * excess * excess / (
        2 * variance * (variance + mixture)
    )


def ready(canary: Sums, baseline: Sums, rule: Rule) -> Any:
    """Whether both sides have the clusters, and the canary the requests, a verdict needs."""
    return (
        (canary.clusters >= rule.min_clusters)
        & (baseline.clusters >= rule.min_clusters)
        & (canary.requests >= rule.min_requests)
    )


@dataclass(frozen=True)
class Reading:
    """One measure's figures at one look."""

    measure: str
    canary_rate: float
    baseline_rate: float
    log_evidence: float

    def as_json(self) -> dict[str, Any]:
        return {
            "measure": self.measure,
            "canary_rate": round(self.canary_rate, 4),
            "baseline_rate": round(self.baseline_rate, 4),
            "log_evidence": round(self.log_evidence, 2),
        }


@dataclass(frozen=True)
class Trial:
    """A canary's trial so far: both sides' sums per measure, and its recent refusals."""

    canary: dict[str, Sums] = field(default_factory=lambda: dict.fromkeys(MEASURES, Sums()))
    baseline: dict[str, Sums] = field(default_factory=lambda: dict.fromkeys(MEASURES, Sums()))
    refused: tuple[int, ...] = ()  # the canary's capacity refusals, last 6 clusters
    # Offline lines answered 200 and failed (5xx): the canary's, then the baseline's.
    offline: tuple[int, ...] = (0, 0, 0, 0)

    def plus(self, canary: Cluster, baseline: Cluster) -> Trial:
        lines = (canary.offline_ok, canary.offline_errors, baseline.offline_ok,
                 baseline.offline_errors)  # fmt: skip
        return Trial(
            {m: s.plus(canary.requests, canary.bad(m)) for m, s in self.canary.items()},
            {m: s.plus(baseline.requests, baseline.bad(m)) for m, s in self.baseline.items()},
            (*self.refused, canary.refused)[-6:],
            tuple(total + more for total, more in zip(self.offline, lines, strict=True)),
        )

    def readings(self, rule: Rule) -> list[Reading]:
        found = []
        for measure in MEASURES:
            ours, theirs = self.canary[measure], self.baseline[measure]
            if ours.clusters < 2 or theirs.clusters < 2:
                continue
            evidence = log_evidence(ours, theirs, rule) if ready(ours, theirs, rule) else 0.0
            found.append(Reading(measure, ours.rate(), theirs.rate(), evidence))
        return found

    def state(self, rule: Rule) -> str:
        readings = self.readings(rule)
        if any(reading.log_evidence >= rule.threshold for reading in readings):
            return WORSE
        if sum(self.refused):
            return PAUSED
        if not ready(self.canary[LATE], self.baseline[LATE], rule):
            return TOO_EARLY
        return WATCHING

    def to_json(self) -> dict[str, Any]:
        return {
            "canary": {m: asdict(s) for m, s in self.canary.items()},
            "baseline": {m: asdict(s) for m, s in self.baseline.items()},
            "refused": list(self.refused),
            "offline": list(self.offline),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trial:
        if not data:
            return cls()
        return cls(
            {m: Sums(**data["canary"][m]) for m in MEASURES},
            {m: Sums(**data["baseline"][m]) for m in MEASURES},
            tuple(data.get("refused", ())),
            tuple(data.get("offline", (0, 0, 0, 0))),
        )


def summary(trial: Trial, rule: Rule) -> str:
    """One line for the history and the log: each measure's rates and evidence."""
    parts = [
        f"{r.measure} {r.canary_rate:.1%} against {r.baseline_rate:.1%} "
        f"(log evidence {r.log_evidence:.1f} of {rule.threshold:.1f})"
        for r in trial.readings(rule)
    ]
    requests = trial.canary[LATE].requests
    return f"{'; '.join(parts) or 'no figures yet'} over {requests:,} requests"


def offline_summary(trial: Trial) -> str:
    """The trial's offline lines on each side, and the share the service failed."""
    ok_c, errors_c, ok_b, errors_b = trial.offline

    def side(ok: int, errors: int) -> str:
        return f"{ok + errors:,} ({errors / (ok + errors):.1%} failed)" if ok + errors else "0"

    return f"offline lines: canary {side(ok_c, errors_c)}, baseline {side(ok_b, errors_b)}"


def clusters_of(
    client: redis.Redis, models: list[str], first_s: int, last_s: int, via: str = ""
) -> list[Cluster]:
    """The clusters starting from `first_s` to `last_s` (both included) of `models` together
    (a baseline may have several), of their requests through the alias `via`: one pipeline
    per model."""
    if last_s < first_s:
        return []
    total = [Cluster()] * ((last_s - first_s) // CLUSTER_S + 1)
    for model in models:
        buckets = stats.read_buckets(client, model, CLUSTER_S, first_s, last_s + 1)
        total = [
            cluster + Cluster.of(counts, via)
            for cluster, (_, counts) in zip(total, buckets, strict=True)
        ]
    return total
