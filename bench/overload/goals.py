"""The overload benchmark's report: a run's line, the medians' table and the goals checked
on them, against the GPU's limit where the node carries it, else against the node's own
capacity."""

from __future__ import annotations

from bench.harness.report import markdown_table
from bench.harness.stats import median_of_rounds

DEADLINE_MS = 500
# At a load of 90% of the node's capacity or more: the share of it served, the most 504s.
NODE_GOODPUT, NODE_MOST_504 = 0.90, 0.01


COLUMNS = [
    ("offered", "offered req/s", "{:.0f}"),
    ("goodput", "goodput req/s", "{:.0f}"),
    ("of limit", "of the limit", "{:.1%}"),
    ("p50", "p50 ms", "{:.0f}"),
    ("p99", "p99 ms", "{:.0f}"),
    ("p99.9", "p99.9 ms", "{:.0f}"),
    ("max", "max ms", "{:.0f}"),
    ("503", "503", "{:.1%}"),
    ("503 p99", "503 p99 ms", "{:.0f}"),
    ("504", "504", "{:.1%}"),
    ("other", "other", "{:.1%}"),
    ("wrong", "wrong", "{:.0f}"),
    ("web cpu", "web CPU ms/req", "{:.2f}"),
    ("send lag p99", "client lag p99 ms", "{:.0f}"),
    ("client cpu", "client CPU ms/req", "{:.2f}"),
    ("accept queue", "accept queue max", "{:.0f}"),
]


def table(figures: dict[str, dict[int, list[dict[str, float]]]]) -> str:
    rows = [
        [name, *(fmt.format(median_of_rounds(runs)[key]) for key, _, fmt in COLUMNS)]
        for name, by_load in figures.items()
        for runs in by_load.values()
    ]
    return markdown_table(["code", *(title for _, title, _ in COLUMNS)], rows)


def verdict(
    by_load: dict[int, list[dict[str, float]]], limit: float, capacity: float | None
) -> list[str]:
    """The issue's overload goals, on medians: against the GPU's limit where the node carries
    it, else against the node's capacity."""
    rows = {load: median_of_rounds(runs) for load, runs in by_load.items()}
    said = []
    for load, at in sorted(rows.items()):
        if capacity is not None and at["offered"] >= 0.9 * capacity:
            said.append(f"{load}% of the GPU's limit: " + _shown(_node_checks(at, capacity)))
    best_below = max((row["goodput"] for load, row in rows.items() if load < 150), default=0.0)
    if capacity is not None and capacity < 0.95 * limit:
        return said  # the node binds before the GPU: the GPU's goals do not apply
    for load, of_limit, of_best, late_ms in ((150, 0.90, 0.95, 50), (200, 0.85, None, 100)):
        if load not in rows:
            continue
        row = rows[load]
        checks = [
            (f"goodput >= {of_limit:.0%} of the limit", row["of limit"] >= of_limit),
            (f"p99.9 <= deadline + {late_ms} ms", row["p99.9"] <= DEADLINE_MS + late_ms),
            ("0 wrong", row["wrong"] == 0),
        ]
        if of_best is not None and best_below:
            share = row["goodput"] / best_below
            checks.append((f"goodput >= {of_best:.0%} of the best below ({share:.1%})",
                           share >= of_best))  # fmt: skip
        said.append(f"{load}% of the GPU's limit: {_shown(checks)}")
    return said


def _node_checks(row: dict[str, float], capacity: float) -> list[tuple[str, bool]]:
    share = row["goodput"] / min(row["offered"], capacity)
    return [
        (f"goodput >= {NODE_GOODPUT:.0%} of the node's ({share:.1%})", share >= NODE_GOODPUT),
        (f"504 <= {NODE_MOST_504:.0%} ({row['504']:.1%})", row["504"] <= NODE_MOST_504),
        ("0 wrong", row["wrong"] == 0),
    ]


def _shown(checks: list[tuple[str, bool]]) -> str:
    return "; ".join(f"{text}: {'yes' if ok else 'NO'}" for text, ok in checks)


def line(row: dict[str, float]) -> str:
    """A run's figures on one line, as the table's columns."""
    return "  ".join(f"{title} {fmt.format(row[key])}" for key, title, fmt in COLUMNS)
