"""The GPU-count recommendation against hand calculations."""

from __future__ import annotations

from collections import Counter

from telemetry.recommendation import (
    IDLE,
    OVER,
    RIGHT,
    UNDER,
    needed_gpus,
    peak_demand,
    recommend,
)
from telemetry.stats import CACHE_HITS


def test_the_issue_example_by_hand() -> None:
    # 22,500 req/s x 0.1 s per call = 2,250 requests in flight per call round; at 100 per
    # batch and a 100% fill target that is 22.5 GPUs, so 23; 25 are running: 2 too many.
    advice = recommend(
        rate_rps=22_500, sampler_ms=100, max_batch_size=100, fill_target_percent=100,
        live_gpus=25, deadline_ms=500, mean_batch=90,
    )  # fmt: skip
    assert advice.needed_gpus == 23
    assert advice.verdict == OVER
    assert advice.message.startswith(
        "average batch 90 with 25 GPUs at 22,500 req/s: 2 GPUs could be released"
    )
    assert advice.per_gpu_rps == 1000


def test_fill_target_leaves_headroom() -> None:
    # 20,000 x 0.1 / (100 x 0.9) = 22.2 -> 23; at 100%: exactly 20, not 21.
    assert needed_gpus(20_000, 100, 100, 90) == 23
    assert needed_gpus(20_000, 100, 100, 100) == 20
    # smaller batches need proportionally more: 20,000 x 0.1 / (32 x 1.0) = 62.5 -> 63
    assert needed_gpus(20_000, 100, 32, 100) == 63


def test_under_right_and_idle() -> None:
    common = {
        "sampler_ms": 100,
        "max_batch_size": 100,
        "fill_target_percent": 90,
        "deadline_ms": 500,
    }
    under = recommend(rate_rps=5_000, live_gpus=2, mean_batch=100, **common)
    assert (under.needed_gpus, under.verdict) == (6, UNDER)
    assert "4 more GPUs needed" in under.message
    right = recommend(rate_rps=850, live_gpus=1, **common)
    assert (right.needed_gpus, right.verdict) == (1, RIGHT)
    idle = recommend(rate_rps=0, live_gpus=3, **common)
    assert (idle.needed_gpus, idle.verdict) == (1, IDLE)


def test_a_call_longer_than_the_deadline_is_called_out() -> None:
    advice = recommend(
        rate_rps=10, sampler_ms=9_000, max_batch_size=100, fill_target_percent=90,
        live_gpus=1, deadline_ms=500,
    )  # fmt: skip
    assert "more GPUs will not meet it" in advice.message


def test_the_peak_is_the_busiest_window_of_demand() -> None:
    def second(ok: int, bad: int = 0, cached: int = 0) -> Counter[str]:
        return Counter({"req:ok": ok, "req:bad_request": bad, CACHE_HITS: cached})

    # Refused before any batch (bad requests) and cache hits ask no GPU: not demand.
    seconds = [second(1), second(1, bad=50), second(9, cached=4), second(11), second(1)]
    assert peak_demand(seconds, window_s=2) == (5 + 11) / 2
    assert peak_demand(seconds, window_s=10) == (1 + 1 + 5 + 11 + 1) / 5  # fewer seconds
    assert peak_demand([], window_s=10) == 0.0


def test_the_peak_is_planned_for_and_said() -> None:
    advice = recommend(
        rate_rps=767, peak_rps=1_300, sampler_ms=100, max_batch_size=100,
        fill_target_percent=90, live_gpus=1, deadline_ms=500,
    )  # fmt: skip
    assert (advice.needed_gpus, advice.verdict, advice.planned_rps) == (2, UNDER, 1_300)
    assert "at 767 req/s (the busiest 10 s: 1,300 req/s): 1 more GPU needed" in advice.message
