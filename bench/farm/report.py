"""The farm's table and its verdicts against the bar."""

from __future__ import annotations

import statistics

from batching.outcomes import RequestOutcome
from bench.farm.shape import OK_BAR_PERCENT, WEB_NODES, Shape
from bench.harness import loadgen
from bench.harness.report import markdown_table
from bench.harness.stats import median_of_rounds


def round_row(
    results: loadgen.Results,
    sizes: list[int],
    web_used: float,
    redis_used: list[float],
    broker_used: float,
    shed: dict[str, float],
) -> dict[str, object]:
    """A round's figures from its load's results, batch sizes, CPU seconds used and the
    web processes' own refusals by reason."""
    sent = results.sent
    return {
        "goodput": results.goodput_rps,
        "sent": sent,
        "ok_%": 100 * results.share(RequestOutcome.OK),
        "other": results.count(loadgen.OTHER),
        "other_example": results.examples.get(loadgen.OTHER, ""),
        "503_%": 100 * results.share(RequestOutcome.REJECTED),
        "504_%": 100 * results.share(RequestOutcome.TIMEOUT),
        "in_flight_%": 100 * shed["in_flight"] / sent,
        "late_%": 100 * shed["late"] / sent,
        "p50_ms": results.percentile_ms(50),
        "p99_ms": results.percentile_ms(99),
        "fill": statistics.mean(sizes) if sizes else 0.0,
        "batches": len(sizes),
        "web_ms": web_used / sent * 1000,
        "redis_us": [used / sent * 1e6 for used in redis_used],
        "broker_us": broker_used / sent * 1e6,
    }


def table(figures: dict[str, list[dict[str, object]]], rate_rps: float, shape: Shape) -> str:
    rounds = min(len(runs) for runs in figures.values())
    header = [
        "request path", "goodput req/s", "200 %", "503 %", "of which in flight, late %",
        "504 %", "other (500...)",
        "p50 ms", "p99 ms", "items/batch", "web CPU ms/req", "Redis CPU µs/req, per node",
        "broker µs/req",
    ]  # fmt: skip
    rows = []
    for topology, runs in figures.items():
        row = median_of_rounds(runs)
        per_node = row["redis_us"]
        rows.append([
            topology, f"{row['goodput']:.0f}", f"{row['ok_%']:.2f}", f"{row['503_%']:.2f}",
            f"{row['in_flight_%']:.2f}, {row['late_%']:.2f}",
            f"{row['504_%']:.2f}", f"{max(_count(run, 'other') for run in runs):.0f}",
            f"{row['p50_ms']:.0f}", f"{row['p99_ms']:.0f}", f"{row['fill']:.1f}",
            f"{row['web_ms']:.2f}",
            f"{', '.join(f'{us:.0f}' for us in per_node)} (sum {sum(per_node):.0f})",
            f"{row['broker_us']:.0f}",
        ])  # fmt: skip
    deadline = f"{shape.deadline_ms} ms" if shape.deadline_ms else "default"
    title = (
        f"Farm: {WEB_NODES} web nodes (1 gunicorn process each), {shape.gpus} simulated GPUs "
        f"({shape.calls.describe()}, {deadline} deadlines), {rate_rps:g} req/s offered, "
        f"medians of {rounds} rounds (other: the most of any round)"
    )
    return f"{title}\n\n{markdown_table(header, rows, align='lrrrrrrrrrrlr')}\n"


def _count(run: dict[str, object], name: str) -> float:
    value = run[name]
    assert isinstance(value, int | float), (name, value)
    return value


def verdicts(figures: dict[str, list[dict[str, object]]]) -> list[str]:
    """Per topology, whether every round met the bar: >= OK_BAR_PERCENT answered 200 and no
    other answer (500, connection error, none); with an example of the others."""
    lines = []
    for topology, runs in figures.items():
        worst = min(_count(run, "ok_%") for run in runs)
        other = max(_count(run, "other") for run in runs)
        met = worst >= OK_BAR_PERCENT and other == 0
        line = (
            f"{topology}: {'meets' if met else 'MISSES'} the bar (>= {OK_BAR_PERCENT}% 200, "
            f"no other answer): worst round {worst:.2f}% 200, {other:.0f} other"
        )
        examples = [str(run["other_example"]) for run in runs if run["other_example"]]
        lines.append(line + (f"; e.g. {examples[0]!r}" if examples else ""))
    return lines
