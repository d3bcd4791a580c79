"""The canary verdict's error rates, by simulation: a thousand canary-days judged by the service's
own test (telemetry.canary, on numpy arrays), against the rule it replaced.

The traffic the routing guide states: each side gets 200 requests a minute, in batches of 1 to
100 requests (uniform). A batch shares one fate with probability 5%: all its requests are late
together, or fail together; otherwise each request's fate is its own. The late rate is the
same on both sides, drawn per day between 1% and 10% (on time 90% to 99%); the error rate is
0.5%. The service judges each 10 s cluster as it completes, so the simulation looks after each.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from telemetry import canary

pytestmark = pytest.mark.timeout(60)

DAY_S = 24 * 3600
PER_MINUTE = 200
BATCH_SIZES = (1, 100)
SHARED_FATE = 0.05
ERROR_RATE = 0.005
RULE = canary.Rule()
# The routing guide's figure: a canary 5 points worse is rolled back within this long.
ROLLED_BACK_WITHIN_S = 3600


def side(rng: Any, seconds: int, late_rate: float, error_rate: float) -> tuple[Any, Any, Any]:
    """One side's requests, late and errors per 10 s cluster."""
    clusters = seconds // canary.CLUSTER_S
    mean_batch = sum(BATCH_SIZES) / 2
    count = rng.poisson(PER_MINUTE * seconds / 60 / mean_batch)
    size = rng.integers(BATCH_SIZES[0], BATCH_SIZES[1] + 1, count)
    where = rng.integers(0, clusters, count)
    shared = rng.random(count) < SHARED_FATE

    def fate(total: Any, rate: float) -> Any:
        return np.where(shared, total * (rng.random(count) < rate), rng.binomial(total, rate))

    errors = fate(size, error_rate)
    late = fate(size - errors, late_rate)
    per_cluster = [np.bincount(where, weights, clusters) for weights in (size, late, errors)]
    return per_cluster[0], per_cluster[1], per_cluster[2]


def sums(requests: Any, bad: Any) -> canary.Sums:
    """The trial's sums after each cluster (cumulative arrays)."""
    return canary.Sums(
        np.cumsum(requests > 0),
        np.cumsum(requests),
        np.cumsum(bad),
        np.cumsum(requests * requests),
        np.cumsum(requests * bad),
        np.cumsum(bad * bad),
    )


def new_rule_fires(ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> Any:
    """Where the service's test rolls the canary back (per cluster)."""
    fired = np.zeros(len(ours[0]), bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for measure in (1, 2):
            a, b = sums(ours[0], ours[measure]), sums(theirs[0], theirs[measure])
            evidence = canary.log_evidence(a, b, RULE, log=np.log, maximum=np.maximum)
            fired |= canary.ready(a, b, RULE) & (evidence >= RULE.threshold)
    return fired


def old_rule_fires(ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> Any:
    """The rule it replaced: over a sliding 60 s window, 200 requests on each side, worse by
    more than 5 points and a pooled two-proportion z above 3."""

    def window(values: Any) -> Any:
        total = np.cumsum(values)
        total[6:] -= total[:-6].copy()
        return total

    fired = np.zeros(len(ours[0]), bool)
    n_a, n_b = window(ours[0]), window(theirs[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        for measure in (1, 2):
            y_a, y_b = window(ours[measure]), window(theirs[measure])
            p_a, p_b = y_a / n_a, y_b / n_b
            pooled = (y_a + y_b) / (n_a + n_b)
            z = (p_a - p_b) / np.sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
            fired |= (n_a >= 200) & (n_b >= 200) & (p_a - p_b > 0.05) & (z > 3)
    return fired


def test_a_canary_as_good_as_its_baseline_is_rarely_rolled_back_in_a_thousand_days() -> None:
    rng = np.random.default_rng(20261128)
    new, old = 0, 0
    for _ in range(1000):
        late_rate = rng.uniform(0.01, 0.10)
        ours = side(rng, DAY_S, late_rate, ERROR_RATE)
        theirs = side(rng, DAY_S, late_rate, ERROR_RATE)
        new += bool(new_rule_fires(ours, theirs).any())
        old += bool(old_rule_fires(ours, theirs).any())
    assert new <= 10, f"{new} false rollbacks in 1,000 canary-days"
    assert old > 10, f"the old rule rolled back only {old} of 1,000 good canaries"


def test_a_canary_five_points_worse_is_rolled_back_within_the_stated_time() -> None:
    rng = np.random.default_rng(5)
    clusters = ROLLED_BACK_WITHIN_S // canary.CLUSTER_S
    in_time = 0
    for _ in range(100):
        late_rate = rng.uniform(0.01, 0.10)
        ours = side(rng, ROLLED_BACK_WITHIN_S, late_rate, ERROR_RATE + 0.05)
        theirs = side(rng, ROLLED_BACK_WITHIN_S, late_rate, ERROR_RATE)
        in_time += bool(new_rule_fires(ours, theirs)[:clusters].any())
    assert in_time >= 99, f"rolled back within {ROLLED_BACK_WITHIN_S} s in {in_time} of 100"


def test_the_rule_in_the_simulation_is_the_services() -> None:
    assert RULE.threshold == pytest.approx(math.log(2 / RULE.false_rollback))
    one = canary.Sums(30, 900, 90, 27_000, 2700, 270)
    two = canary.Sums(30, 900, 9, 27_000, 270, 2.7)
    arrays = canary.Sums(*(np.array([getattr(one, f)]) for f in one.__dataclass_fields__))
    vectorised = canary.log_evidence(arrays, two, RULE, log=np.log, maximum=np.maximum)
    assert vectorised[0] == pytest.approx(canary.log_evidence(one, two, RULE))
