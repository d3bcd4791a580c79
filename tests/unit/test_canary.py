from __future__ import annotations

import math
from collections import Counter

import pytest

from batching.outcomes import RequestOutcome
from telemetry import stats
from telemetry.canary import (
    ERRORS,
    LATE,
    PAUSED,
    TOO_EARLY,
    WATCHING,
    WORSE,
    Cluster,
    Rule,
    Sums,
    Trial,
    log_evidence,
    summary,
)

RULE = Rule(min_clusters=10, min_requests=100)


def trial_of(canary: list[Cluster], baseline: list[Cluster]) -> Trial:
    trial = Trial()
    for ours, theirs in zip(canary, baseline, strict=True):
        trial = trial.plus(ours, theirs)
    return trial


def test_a_cluster_counts_quality_outcomes_apart_from_capacity_refusals() -> None:
    counts = Counter(
        {f"req:{RequestOutcome.OK}": 90, f"req:{RequestOutcome.ERROR}": 7,
         f"req:{RequestOutcome.TIMEOUT}": 3, f"req:{RequestOutcome.REJECTED}": 2,
         stats.NO_WORKER: 4, f"req:{RequestOutcome.BAD_REQUEST}": 50,
         f"req:{RequestOutcome.RATE_LIMITED}": 7, f"req:{RequestOutcome.CANCELLED}": 1}
    )  # fmt: skip
    # 4 of the 7 errors were 503s for want of a live worker: capacity, like the 2 rejected.
    assert Cluster.of(counts) == Cluster(requests=96, late=3, errors=3, refused=6)


def test_a_canary_failing_one_request_in_five_is_found_worse() -> None:
    trial = trial_of([Cluster(20, 0, 4)] * 12, [Cluster(20, 0, 0)] * 12)
    assert trial.state(RULE) == WORSE
    errors = {r.measure: r for r in trial.readings(RULE)}[ERRORS]
    assert errors.canary_rate == pytest.approx(0.2)
    assert errors.log_evidence >= RULE.threshold
    assert "errors 20.0% against 0.0%" in summary(trial, RULE)


def test_no_verdict_before_the_clusters_and_requests_it_needs() -> None:
    assert trial_of([Cluster(20, 0, 10)] * 9, [Cluster(20)] * 9).state(RULE) == TOO_EARLY
    assert trial_of([Cluster(9, 0, 0)] * 10, [Cluster(20)] * 10).state(RULE) == TOO_EARLY
    assert trial_of([Cluster(20, 1, 0)] * 10, [Cluster(20, 1, 0)] * 10).state(RULE) == WATCHING


def test_a_difference_within_the_margin_is_never_worse() -> None:
    # 0.5 points worse on a million requests each: certain, but below the 1-point margin.
    trial = trial_of([Cluster(10_000, 150, 0)] * 100, [Cluster(10_000, 100, 0)] * 100)
    assert trial.state(RULE) == WATCHING
    late = {r.measure: r for r in trial.readings(RULE)}[LATE]
    assert late.log_evidence < 0


def test_one_late_batch_inflates_its_own_variance() -> None:
    # 30 quiet clusters, then one batch of 100 all late: a burst, not evidence.
    canary = [Cluster(30, 1, 0)] * 30 + [Cluster(130, 101, 0)]
    baseline = [Cluster(30, 1, 0)] * 31
    trial = trial_of(canary, baseline)
    ours = trial.canary[LATE]
    binomial = ours.rate() * (1 - ours.rate()) / ours.requests
    assert ours.variance() > 10 * binomial
    assert trial.state(RULE) == WATCHING  # 9 points worse, but one cluster made all of it


def test_capacity_refusals_pause_and_do_not_roll_back() -> None:
    refused = [Cluster(20, 1, 0, refused=15)] * 12
    trial = trial_of(refused, [Cluster(20, 1, 0)] * 12)
    assert trial.state(RULE) == PAUSED
    # A minute (6 clusters) without refusals resumes it.
    assert (
        trial_of(refused + [Cluster(20, 1, 0)] * 6, [Cluster(20, 1, 0)] * 18).state(RULE)
        == WATCHING
    )


def test_the_evidence_is_the_normal_mixture_ratio() -> None:
    canary = Sums(clusters=50, requests=1000, bad=100, requests_sq=20_000, cross=2000, bad_sq=200)
    baseline = Sums(clusters=50, requests=1000, bad=50, requests_sq=20_000, cross=1000, bad_sq=50)
    v = canary.variance() + baseline.variance()
    t2 = RULE.spread**2
    expected = 0.5 * math.log(v / (v + t2)) + t2 * (0.05 - RULE.margin) ** 2 / (2 * v * (v + t2))
    assert log_evidence(canary, baseline, RULE) == pytest.approx(expected)
    assert RULE.threshold == pytest.approx(math.log(2 / RULE.false_rollback))


def test_a_trial_round_trips_through_json() -> None:
    trial = trial_of([Cluster(20, 2, 1, 3)] * 8, [Cluster(25, 1, 0)] * 8)
    assert Trial.from_json(trial.to_json()) == trial
    assert Trial.from_json({}) == Trial()
