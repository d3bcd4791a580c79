"""The backfill benchmark's figures: the GPU's wait between calls, and the table of medians.

Each load has two windows a round, without a job (ALONE) and with one (JOB), and with `--aa` a
third without a job (AGAIN): the A/A pair, how far two windows of the same kind read apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from bench.harness.report import markdown_table
from bench.harness.stats import gaps_between_calls_ms, median
from telemetry.batch_log import BatchLog

FILLED = ("interactive", "backfill", "empty")
ALONE, JOB, AGAIN = "alone", "job", "alone again"
Runs = dict[tuple[float, str], list[dict[str, float]]]  # (load, kind) -> each round's figures


def between_calls_ms(records: BatchLog, since_ms: int, until_ms: int) -> float:
    """How long a GPU waited between two of its calls started in the window, on average
    (from one call's end to the next one's start: the seal and the rows, or an idle GPU);
    from the workers' batch records. A mean: the records' times are whole milliseconds, and
    the mean of their differences is exact but for its two ends."""
    in_window = [record for record in map(json.loads, records.recent())
                 if since_ms <= (record.get("call_started_ms") or -1) <= until_ms]  # fmt: skip
    gaps = gaps_between_calls_ms(in_window)
    return sum(gaps) / len(gaps) if gaps else float("nan")


def table(runs: Runs, loads: list[float], aa: bool) -> str:
    """Per load, the medians over the rounds: goodput, p50 and p99 without and with the job
    (and the A/A window's p99), the job's lines a second, its calls' places, and the wait
    between calls."""

    def of(load: float, kind: str, name: str) -> float:
        values = [run[name] for run in runs.get((load, kind), []) if name in run]
        return median(values) if values else float("nan")

    def share(load: float, name: str) -> str:
        total = sum(of(load, JOB, filled) for filled in FILLED)
        return f"{100 * of(load, JOB, name) / total:.0f}%" if total else "-"

    number: Callable[[float], str] = lambda value: "-" if value != value else f"{value:,.1f}"  # noqa: E731
    rows: list[list[Any]] = []
    for load in loads:
        again = [number(of(load, AGAIN, "p99"))] if aa else []
        rows.append([
            f"{load:.0%}", number(of(load, ALONE, "goodput")), number(of(load, JOB, "goodput")),
            number(of(load, ALONE, "p50")), number(of(load, JOB, "p50")),
            number(of(load, ALONE, "p99")), number(of(load, JOB, "p99")), *again,
            number(of(load, JOB, "job_rps")), *(share(load, name) for name in FILLED),
            number(of(load, ALONE, "between_calls_ms")), number(of(load, JOB, "between_calls_ms")),
        ])  # fmt: skip
    header = ["load", "goodput/s", "with job", "p50 ms", "with job", "p99 ms", "with job",
              *(["A/A: p99 again"] if aa else []), "job lines/s", "places: requests", "job",
              "empty", "between calls ms", "with job"]  # fmt: skip
    return markdown_table(header, rows)
