"""The open-loop load generator's pure parts; the whole of it runs in test_bench_compare."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from bench.harness.loadgen import Results, poisson_schedule
from bench.harness.stats import percentile, slope


def test_poisson_schedule_has_the_rate_and_memoryless_gaps() -> None:
    offsets = poisson_schedule(1000, 20, seed=7)
    # 20,000 expected; the count's standard deviation is sqrt(20,000) = 141.
    assert abs(len(offsets) - 20_000) < 5 * 141
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.001, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed spacing would be 0).
    assert statistics.stdev(gaps) == pytest.approx(0.001, rel=0.05)
    assert offsets == sorted(offsets)
    assert offsets[-1] < 20
    assert poisson_schedule(1000, 20, seed=7) == offsets  # reproducible


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([5.0], 99) == 5


def test_a_rate_read_in_steps_is_the_slope_of_the_reads() -> None:
    # 100 a second, written 25 at a time every 0.25 s, read every 0.1 s for 10 s: the first
    # and last reads' difference is off by most of a step; the slope is not.
    times = [0.01 + k / 10 for k in range(100)]
    reads = [(t, 25.0 * math.floor(t / 0.25)) for t in times]
    (first_t, first), (last_t, last) = reads[0], reads[-1]
    assert (last - first) / (last_t - first_t) < 99
    assert slope(reads) == pytest.approx(100, abs=0.2)
    assert math.isnan(slope(reads[:1]))  # no rate from one read


def test_results_shares_and_goodput() -> None:
    results = Results(rate_rps=10, duration_s=2)
    results.outcomes = ["ok", "ok", "504", "503"]
    results.latencies_ms = [100.0, 120.0, 500.0, 3.0]
    assert results.goodput_rps == 1.0
    assert results.share("504") == 0.25
    assert results.percentile_ms(50, outcome="ok") == 100
