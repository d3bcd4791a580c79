"""The capacity planner's discrete-event simulation of the batching policy, and its command."""

from __future__ import annotations

import io
import math
import re
from dataclasses import replace

import pytest
from django.core.management import CommandError, call_command

from planning.costs import MEASURED, MEASURED_SHARD, MeasuredCosts
from planning.management.commands.capacity import TABLE_RATES
from planning.simulation import Scenario, fewest_gpus, redis_shards, simulate, web_nodes


def test_a_lone_request_costs_dispatch_call_and_path() -> None:
    # 0.5 req/s: a request nearly always finds an idle GPU and is its batch alone; the rare
    # one arriving during a call waits for it, never less.
    scenario = Scenario(rate_rps=0.5, gpus=1, duration_s=120, seed=3)
    out = simulate(scenario)
    assert out.requests > 30
    expected = scenario.dispatch_ms + scenario.batch_ms + scenario.path_ms
    alone = [latency for latency in out.latencies_ms if latency == pytest.approx(expected)]
    assert len(alone) >= 0.9 * out.requests
    assert min(out.latencies_ms) == pytest.approx(expected)
    assert out.timeouts == out.rejected == 0


def test_lazy_sealing_grows_batches_with_the_load() -> None:
    light = simulate(Scenario(rate_rps=200, gpus=1))
    heavy = simulate(Scenario(rate_rps=900, gpus=1))
    # While the GPU runs a call (~103 ms with the gap), the next batch collects about
    # rate x 0.103 requests.
    assert light.mean_batch == pytest.approx(200 * 0.103, rel=0.15)
    assert heavy.mean_batch == pytest.approx(900 * 0.103, rel=0.1)
    assert heavy.ok_share == 1.0
    assert max(heavy.latencies_ms) <= heavy.scenario.deadline_ms


def test_overload_is_refused_at_once_and_the_gpus_stay_full() -> None:
    out = simulate(Scenario(rate_rps=2000, gpus=1, duration_s=20))
    limit = 100 / (out.scenario.batch_ms + out.scenario.gap_ms) * 1000  # full batches
    assert out.goodput_rps == pytest.approx(limit, rel=0.03)
    assert out.mean_batch > 98
    assert out.rejected / out.requests == pytest.approx(1 - limit / 2000, abs=0.03)
    assert out.timeouts / out.requests < 0.01  # admission, not expiry, sheds the excess


def test_deadline_drops_never_answer_late() -> None:
    # A 150 ms deadline and 100 ms calls: a batch that waits for a busy GPU mostly expires.
    out = simulate(Scenario(rate_rps=3000, gpus=1, deadline_ms=150, duration_s=5))
    assert out.expired > 0
    assert max(out.latencies_ms) <= 150
    assert out.ok + out.timeouts + out.rejected == out.requests


def test_percentile_counts_failures_as_late() -> None:
    out = simulate(Scenario(rate_rps=2000, gpus=1, duration_s=5))
    assert out.ok_share < 0.6
    assert math.isinf(out.percentile_ms(99))
    assert out.percentile_ms(40) < 500
    assert out.answer_percentile_ms(99) <= 500  # as a client sees it: 503s and 504s answer


def test_fewest_gpus_is_the_smallest_count_that_meets_the_percentile() -> None:
    base = Scenario(rate_rps=5_000, gpus=1, duration_s=20)
    plan = fewest_gpus(base, 99)
    turn_s = (base.batch_ms + base.gap_ms) / 1000
    assert plan.lower_bound == math.floor(5_000 * turn_s / 100) + 1
    assert plan.gpus >= plan.lower_bound
    assert plan.outcome.percentile_ms(99) <= 500
    fewer = plan.gpus - 1
    if fewer >= plan.lower_bound:
        assert simulate(replace(base, gpus=fewer)).percentile_ms(99) > 500
    else:  # one GPU fewer cannot carry the rate even in full batches: never planned
        assert fewer * base.max_batch * 1000 / (base.batch_ms + base.gap_ms) <= base.rate_rps


def test_web_nodes_round_up() -> None:
    # 20,000 req/s x 1 ms = 20 cores; 16-core nodes at 60% carry 9.6 cores each: 3 nodes.
    assert web_nodes(20_000, 1.0, 16, 0.6) == 3
    assert web_nodes(1, 1.0, 16, 0.6) == 1


def test_capacity_command_answers_the_issue_question() -> None:
    out = io.StringIO()
    call_command("capacity", "--rps", "20000", "--deadline-ms", "500", "--seconds", "10",
                 stdout=out)  # fmt: skip
    text = out.getvalue()
    gpus = int(re.search(r"GPUs needed:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    bound = int(re.search(r"lower bound:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    turn_ms = 100 + MEASURED.gap_ms
    assert bound == math.floor(20_000 * turn_ms / 1000 / 100) + 1
    plan = fewest_gpus(Scenario(rate_rps=20_000, gpus=1, duration_s=10), 99)
    assert gpus == plan.gpus >= bound
    assert "predicted goodput" in text
    assert "web nodes" in text
    assert "p50/p95/p99" in text


def test_capacity_command_table_and_refusals() -> None:
    out = io.StringIO()
    call_command("capacity", "--rps", "1000", "--deadline-ms", "500", "--seconds", "5",
                 "--table", stdout=out)  # fmt: skip
    rows = [line for line in out.getvalue().splitlines() if re.match(r"\| [\d,]+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == [f"{rate:,}" for rate in TABLE_RATES]
    # The last column: Redis shards at half of one shard's measured ceiling.
    assert MEASURED_SHARD is not None
    assert [int(row.split("|")[-2]) for row in rows] == [
        redis_shards(rate, MEASURED_SHARD.shard_rps) for rate in TABLE_RATES
    ]
    assert redis_shards(100_000, MEASURED_SHARD.shard_rps) > redis_shards(1_000, 1e9) == 1
    with pytest.raises(CommandError, match="no number of GPUs meets it"):
        call_command("capacity", "--rps", "100", "--deadline-ms", "80", stdout=io.StringIO())
    with pytest.raises(CommandError, match="max-batch"):
        call_command("capacity", "--rps", "100", "--deadline-ms", "500", "--max-batch", "101",
                     stdout=io.StringIO())  # fmt: skip


def test_a_rate_at_exactly_the_full_batch_capacity_needs_one_gpu_more() -> None:
    # 20 GPUs of 100-prompt calls every 100 ms carry 20,000 req/s with no slack at all.
    assert Scenario(rate_rps=20_000, gpus=1, gap_ms=0).lower_bound_gpus == 21
    assert Scenario(rate_rps=19_999, gpus=1, gap_ms=0).lower_bound_gpus == 20
    # A gap between calls is capacity lost: 1 ms on 100 is one GPU in 100.
    assert Scenario(rate_rps=19_900, gpus=1, gap_ms=1).lower_bound_gpus == 21


def test_the_planner_simulates_with_the_measured_costs() -> None:
    measured = MeasuredCosts.load()  # planning/costs.json, written by bench/gap.py
    scenario = Scenario(rate_rps=1_000, gpus=1)
    assert (scenario.path_ms, scenario.dispatch_ms, scenario.gap_ms) == (
        measured.path_ms,
        measured.dispatch_ms,
        measured.gap_ms,
    )
    out = io.StringIO()
    call_command("capacity", "--rps", "1000", "--deadline-ms", "500", "--seconds", "2",
                 stdout=out)  # fmt: skip
    assert measured.source in out.getvalue()
    out = io.StringIO()
    call_command("capacity", "--rps", "1000", "--deadline-ms", "500", "--seconds", "2",
                 "--gap-ms", "7", stdout=out)  # fmt: skip
    assert measured.source not in out.getvalue()  # not the measured costs any more
    assert "7 ms between calls" in out.getvalue()
