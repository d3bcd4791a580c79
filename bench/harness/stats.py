"""The statistics every benchmark reports: one percentile (nearest-rank), medians of rounds,
and the GPU's wait between calls from the workers' batch records."""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or
    below it; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n q / 100), at least the first
    return ordered[int(min(rank, len(ordered))) - 1]


def median(values: Iterable[float]) -> float:
    """The median; NaN for no values."""
    listed = list(values)
    return statistics.median(listed) if listed else float("nan")


def slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y over x of (x, y) points; NaN for fewer than two x."""
    if len({x for x, _ in points}) < 2:
        return float("nan")
    xs, ys = zip(*points, strict=True)
    return statistics.linear_regression(xs, ys).slope


def _numbers(values: Sequence[object]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def median_of_rounds(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One row from the rounds' rows: each number the median of its rounds, each list of
    numbers the median element by element, anything else the first round's."""
    row: dict[str, Any] = {}
    for name, first in runs[0].items():
        values = [run[name] for run in runs]
        if _numbers(values):
            row[name] = statistics.median(values)
        elif isinstance(first, list) and all(isinstance(v, list) and _numbers(v) for v in values):
            row[name] = [statistics.median(column) for column in zip(*values, strict=True)]
        else:
            row[name] = first
    return row


def gaps_between_calls_ms(records: Iterable[Mapping[str, Any]]) -> list[float]:
    """How long each worker's GPU waited from the end of one call to the start of its next,
    for every pair of consecutive calls in batch records (a record without a call, its items
    all dropped, is none). Records' times are whole ms: a gap may read a little below 0."""
    by_worker: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("call_started_ms") is not None:
            by_worker[record["worker"]].append(record)
    gaps = []
    for calls in by_worker.values():
        calls.sort(key=lambda record: record["call_started_ms"])
        gaps += [after["call_started_ms"] - before["call_started_ms"] - before["sampler_ms"]
                 for before, after in itertools.pairwise(calls)]  # fmt: skip
    return gaps
