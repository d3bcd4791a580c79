"""The GPU's wait between calls, as the backfill and farm benchmarks read it from batch records."""

from __future__ import annotations

from bench.harness.stats import gaps_between_calls_ms


def record(worker: str, started: int | None, sampler_ms: float) -> dict[str, object]:
    return {"worker": worker, "call_started_ms": started, "sampler_ms": sampler_ms}


def test_gaps_are_per_worker_between_consecutive_calls_in_start_order() -> None:
    records = [
        record("a", 1_000, 100.0),
        record("b", 1_010, 100.0),
        record("a", 1_103, 100.0),  # a's previous call ended at 1,100
        record("a", None, 0.0),  # its items all dropped: no call, no gap
        record("b", 1_200, 100.0),  # b idle for 90 ms
        record("a", 1_204, 100.0),
    ]
    assert sorted(gaps_between_calls_ms(reversed(records))) == [1.0, 3.0, 90.0]


def test_a_single_call_has_no_gap() -> None:
    assert gaps_between_calls_ms([record("a", 1_000, 100.0)]) == []
