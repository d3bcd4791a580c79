from __future__ import annotations

from collections import Counter

import pytest

from batching.canary import Arm, Rule, verdict, z_score
from batching.outcomes import RequestOutcome

RULE = Rule(window_s=60, min_requests=100, margin=0.05, z=3.0)


def arm(ok: int, errors: int = 0, late: int = 0) -> Arm:
    return Arm(ok + errors + late, ok, errors)


def test_a_canary_failing_one_request_in_five_is_rolled_back_on_its_on_time_rate() -> None:
    found = verdict(arm(160, errors=40), arm(200), RULE)
    assert found is not None
    assert found.measure == "on-time rate"
    assert found.z > RULE.z
    assert "80.0% of 200 requests" in found.summary()


def test_errors_alone_decide_when_the_on_time_rates_agree() -> None:
    # The baseline is late as often as the canary fails: only the error rate tells them apart.
    found = verdict(arm(800, errors=200), arm(800, late=200), RULE)
    assert found is not None
    assert found.measure == "error rate"


def test_no_rollback_on_too_few_requests_a_small_difference_or_noise() -> None:
    assert verdict(arm(0, errors=99), arm(1000), RULE) is None  # 99 < 100 requests
    assert verdict(arm(9600, late=400), arm(10_000), RULE) is None  # 4 points < the margin
    noisy = Rule(min_requests=10, margin=0.05)
    assert verdict(arm(18, errors=2), arm(20), noisy) is None  # 10 points, z = 1.45
    assert verdict(arm(200), arm(180, errors=20), RULE) is None  # the canary is better


def test_the_z_score_of_two_proportions() -> None:
    assert z_score(20, 20, 18, 20) == pytest.approx(0.1 / (0.95 * 0.05 * 0.1) ** 0.5)
    assert z_score(5, 10, 5, 10) == 0.0
    assert z_score(0, 0, 1, 1) == 0.0


def test_an_arm_counts_the_requests_that_reached_the_model() -> None:
    counts = Counter(
        {f"req:{RequestOutcome.OK}": 90, f"req:{RequestOutcome.ERROR}": 5,
         f"req:{RequestOutcome.TIMEOUT}": 3, f"req:{RequestOutcome.REJECTED}": 2,
         f"req:{RequestOutcome.BAD_REQUEST}": 50, f"req:{RequestOutcome.RATE_LIMITED}": 7}
    )  # fmt: skip
    assert Arm.of(counts) == Arm(100, 90, 5)
    assert arm(1) + arm(2, errors=1) == Arm(4, 3, 1)
