"""The node's capacity search of bench.harness.capacity: the highest rate served in full,
found by halving, on measures whose answer is known."""

from __future__ import annotations

from collections.abc import Callable

from bench.harness.capacity import STEPS, Probe, highest_rate

DEADLINE_MS = 500.0


def node(capacity_rps: float) -> tuple[list[float], Callable[[float], Probe]]:
    """A node that serves every rate up to `capacity_rps` in full and fails past it."""
    asked: list[float] = []

    def measure(rate: float) -> Probe:
        asked.append(rate)
        served = rate <= capacity_rps
        return Probe(rate, served, 300.0 if served else 900.0)

    return asked, measure


def test_the_capacity_is_found_within_a_halving_of_the_range() -> None:
    for capacity in (250.0, 613.0, 999.0):
        asked, measure = node(capacity)
        found, probes = highest_rate(measure, 100.0, 1000.0, DEADLINE_MS)
        assert found <= capacity
        assert capacity - found <= (1000.0 - 100.0) / 2**STEPS
        assert len(probes) == len(asked) == 2 + STEPS


def test_a_node_that_serves_the_top_of_the_range_stops_there() -> None:
    asked, measure = node(5000.0)
    assert highest_rate(measure, 100.0, 1000.0, DEADLINE_MS)[0] == 1000.0
    assert asked == [1000.0]


def test_a_node_that_serves_not_even_the_bottom_has_none() -> None:
    asked, measure = node(50.0)
    assert highest_rate(measure, 100.0, 1000.0, DEADLINE_MS)[0] == 0.0
    assert asked == [1000.0, 100.0]


def test_a_probe_late_at_its_p99_is_not_served_in_full() -> None:
    def late(rate: float) -> Probe:
        return Probe(rate, True, DEADLINE_MS + 1)

    assert highest_rate(late, 100.0, 1000.0, DEADLINE_MS)[0] == 0.0
