"""The planner's check: the farm's batch fill and latency, in calls, beside what the capacity
planner's simulation (planning.simulation) predicts for the same rate, GPUs, calls and
deadline. The simulation runs twice: with the fixed costs the planner uses (planning/costs.json)
and with the gap between a worker's calls that the farm's own batch records show."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from typing import Any

from batching.call_cost import CostProfile
from bench.harness.costs import CURVE_TOKENS, PROMPT_TOKENS
from bench.harness.report import markdown_table
from bench.harness.stats import gaps_between_calls_ms
from planning.shapes import parse_shapes
from planning.simulation import Outcome, Scenario, fewest_gpus, simulate

# Seeds of the simulation per prediction: its median.
SEEDS = (1, 2, 3)
# The farm's requests, as bench.harness.costs makes them: short prompts asking the curve's tokens.
FARM_SHAPES = f"{PROMPT_TOKENS}:{CURVE_TOKENS}"


def planned_gpus(profile: CostProfile, rate_rps: float, deadline_ms: float) -> int:
    """The planner's GPUs for the farm's requests at `rate_rps` within `deadline_ms`."""
    base = Scenario(rate_rps=rate_rps, gpus=1, deadline_ms=deadline_ms, cost=profile,
                    shapes=parse_shapes(FARM_SHAPES))  # fmt: skip
    return fewest_gpus(base).gpus


def turn_gap_ms(records: list[dict[str, Any]]) -> float:
    """The median time a worker's GPU waits between the end of one call and the start of its
    next, from batch records: under load, the seal, the hand-over of the answers and the next
    task's dispatch."""
    gaps = gaps_between_calls_ms(records)
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def predicted(scenario: Scenario) -> dict[str, float]:
    """The simulation's fill (items a call) and p50/p99 of every answer, medians over SEEDS."""
    runs: list[Outcome] = [simulate(replace(scenario, seed=seed)) for seed in SEEDS]
    return {
        "fill": statistics.median(run.sampled / run.calls if run.calls else 0.0 for run in runs),
        "p50_ms": statistics.median(run.answer_percentile_ms(50) for run in runs),
        "p99_ms": statistics.median(run.answer_percentile_ms(99) for run in runs),
    }


def scenario_of(
    rate_rps: float, gpus: int, call_ms: float, deadline_ms: float, seconds: float,
    profile: CostProfile,
) -> Scenario:  # fmt: skip
    """The farm's run as the planner sees it: on a curve, calls priced by `profile` for the
    farm's requests; else every call `call_ms`."""
    on_curve = not profile.is_contract
    return Scenario(
        rate_rps=rate_rps, gpus=gpus, batch_ms=call_ms, deadline_ms=deadline_ms,
        duration_s=seconds, cost=profile if on_curve else None,
        shapes=parse_shapes(FARM_SHAPES) if on_curve else None,
    )  # fmt: skip


def check_table(farm: dict[str, float], scenario: Scenario, gap_ms: float, call_ms: float) -> str:
    """The farm's figures (medians over rounds: fill, p50_ms, p99_ms) beside the planner's,
    latencies in calls of `call_ms` (a full call), with the planner's difference in %."""
    planned = predicted(scenario)
    with_gap = predicted(replace(scenario, gap_ms=gap_ms))
    rows = []
    for label, figures in (("farm", farm), ("planner", planned),
                           (f"planner, gap {gap_ms:.0f} ms", with_gap)):  # fmt: skip
        cells = [label, f"{figures['fill']:.1f}"]
        for name in ("p50_ms", "p99_ms"):
            cells.append(f"{figures[name]:.0f} ({figures[name] / call_ms:.2f})")
        if figures is farm:
            cells.append("")
        else:
            names = ("fill", "p50_ms", "p99_ms")
            worst = max(abs(figures[name] / farm[name] - 1) if farm[name] else math.inf
                        for name in names)  # fmt: skip
            cells.append(f"{100 * worst:.1f}%")
        rows.append(cells)
    header = ["", "items/call", "p50 ms (calls)", "p99 ms (calls)", "furthest from the farm"]
    return (
        f"The planner's check (a full call {call_ms:.0f} ms; the planner's gap between calls "
        f"{scenario.gap_ms:g} ms, the farm's {gap_ms:.1f} ms)\n\n"
        + markdown_table(header, rows, align="lrrrr")
    )


def records_of(raw: list[bytes]) -> list[dict[str, Any]]:
    """Interactive batch records (not backfill-only turns) from the batch log."""
    return [record for record in map(json.loads, raw) if record.get("size")]
