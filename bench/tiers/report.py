"""The tiers benchmark's report: a round's table per tier, and the batches the GPU ran
(bench.tiers)."""

from __future__ import annotations

import itertools
import json
import statistics

from batching.aggregator import BatchAggregator
from bench.harness.report import markdown_table
from bench.harness.stats import median_of_rounds


def table(
    rows: dict[str, dict[str, float]], limit_rps: float, one_tier_rps: float | None = None
) -> str:
    header = [
        "tier", "offered req/s", "served req/s", "goodput (of offered)", "p50 ms", "p99 ms",
        "503s", "503 p99 ms", "504s", "other",
    ]  # fmt: skip
    cells = [
        [
            tier, f"{row['offered_rps']:.0f}", f"{row['served_rps']:.0f}",
            f"{row['goodput_pct']:.1f}%", f"{row['p50_ms']:.0f}", f"{row['p99_ms']:.0f}",
            f"{row['rejected']:.0f}", f"{row['rejected_p99_ms']:.0f}", f"{row['timeouts']:.0f}",
            f"{row['other']:.0f}",
        ]
        for tier, row in rows.items()
    ]  # fmt: skip
    lines = [markdown_table(header, cells)]
    total = rows["total"]["served_rps"]
    lines.append(
        f"\ntotal goodput: {total:.0f} req/s = {100 * total / limit_rps:.1f}% of the limit; "
        f"the client's send lag p99 {rows['total']['send_lag_p99_ms']:.1f} ms"
    )
    if one_tier_rps:
        lines.append(
            f"one tier alone, the same load: {one_tier_rps:.0f} req/s = "
            f"{100 * one_tier_rps / limit_rps:.1f}% of the limit; the tiers' total is "
            f"{100 * total / one_tier_rps:.1f}% of it"
        )
    return "\n".join(lines)


def medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {tier: median_of_rounds([r[tier] for r in rounds]) for tier in rounds[0]}


def batches(
    aggregator: BatchAggregator, priorities: dict[str, int], max_batch: int, served_rps: float
) -> str:
    """Per tier, the batches the round ran (the worker's batch log): how many, their mean
    size, and how many of their items were sampled (not dropped at their deadline); the calls
    they took, the places of those calls left empty (a part-full batch, or members past their
    deadline), and the seals that found every member past its deadline (no call); how often
    the GPU took a turn, what full batches would have carried, and the share of that served."""
    records = [json.loads(raw) for raw in aggregator.batch_log.recent()]
    parts = []
    for tier, lane in priorities.items():
        mine = [record for record in records if record.get("lane") == lane]
        if mine:
            size = statistics.mean(record["size"] for record in mine)
            sampled = statistics.mean(record["sampled"] for record in mine)
            called = [record for record in mine if record["sampled"]]
            empty = sum(max_batch - record["sampled"] for record in called)
            parts.append(
                f"{tier}: {len(mine)} batches of {size:.1f} ({sampled:.1f} sampled), "
                f"{len(called)} calls with {empty} places empty, "
                f"{len(mine) - len(called)} seals without a call"
            )
    sealed_at = sorted(record["sealed_at_ms"] for record in records)
    gaps = [later - earlier for earlier, later in itertools.pairwise(sealed_at)]
    if gaps:
        turn_ms = statistics.median(gaps)
        full_rps = max_batch * 1000 / turn_ms
        parts.append(
            f"a turn every {turn_ms:.1f} ms (median): {full_rps:.0f} req/s at full batches, "
            f"{100 * served_rps / full_rps:.1f}% of it served"
        )
    return "batches: " + "; ".join(parts)
