"""A node's own capacity: the highest rate it serves in full (every answer a 200, the p99
within the deadline), found by halving a range of rates with short runs of open-loop load.

The GPU's limit bounds it from above; the web tier's CPU, the client's share of the same
cores and any other process on them bound it from below. Django-free and service-free: a
function that measures one rate in, a rate out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Halvings of the range: 6 find the capacity within 1/64 of it.
STEPS = 6


@dataclass(frozen=True)
class Probe:
    """One rate's short run: every request answered 200, and the p99 of their latencies."""

    rate_rps: float
    all_ok: bool
    p99_ms: float


def served_in_full(probe: Probe, deadline_ms: float) -> bool:
    return probe.all_ok and probe.p99_ms <= deadline_ms


def highest_rate(
    measure: Callable[[float], Probe],
    low_rps: float,
    high_rps: float,
    deadline_ms: float,
    steps: int = STEPS,
) -> tuple[float, list[Probe]]:
    """The highest rate between `low_rps` and `high_rps` that `measure` finds served in full
    (`high_rps` itself when it is; 0 when not even `low_rps` is), and every probe run."""
    probes = [measure(high_rps)]
    if served_in_full(probes[-1], deadline_ms):
        return high_rps, probes
    probes.append(measure(low_rps))
    if not served_in_full(probes[-1], deadline_ms):
        return 0.0, probes
    served, failed = low_rps, high_rps
    for _ in range(steps):
        middle = (served + failed) / 2
        probes.append(measure(middle))
        if served_in_full(probes[-1], deadline_ms):
            served = middle
        else:
            failed = middle
    return served, probes
