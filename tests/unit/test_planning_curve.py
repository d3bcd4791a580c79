"""The planner on a GPU's cost curve: requests' shapes priced by a cost profile, calls that
last what their rows cost, and the contract's plans unchanged."""

from __future__ import annotations

import io
import random
from dataclasses import replace
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from batching.call_cost import Shape, load_profile
from planning import simulation
from planning.shapes import ShapesError, parse_shapes

H100 = load_profile("h100-graphs-135m", 100)


def capacity(*args: str) -> str:
    out = io.StringIO()
    call_command("capacity", *args, stdout=out)
    return out.getvalue()


def test_shapes_from_ranges_and_from_a_sample(tmp_path: Path) -> None:
    ranges = parse_shapes("20-199:16")
    rng = random.Random(3)
    drawn = [ranges.draw(rng) for _ in range(500)]
    assert {tokens for _, tokens in drawn} == {16}
    assert 20 <= min(p for p, _ in drawn) < max(p for p, _ in drawn) <= 199
    sample = tmp_path / "requests.txt"
    sample.write_text("# prompt max\n30 8\n\n400 64  # a long one\n")
    assert set(parse_shapes(str(sample)).sample) == {(30, 8), (400, 64)}
    sample.write_text("12 \u00b2\n")  # a superscript two is a digit to str.isdigit
    with pytest.raises(ShapesError, match="PROMPT_TOKENS MAX_TOKENS"):
        parse_shapes(str(sample))


@pytest.mark.parametrize(
    "spec", ["0:16", "20-10:16", "x:16", "20", "missing-file.txt", "5-:16", "-5:16", "1-1e9:16"]
)
def test_bad_shapes_are_refused_saying_why(spec: str) -> None:
    with pytest.raises(ShapesError):
        parse_shapes(spec)


def test_a_full_call_costs_the_profile_s_time_for_its_shapes() -> None:
    shapes = parse_shapes("20-199:16")
    assert shapes.mean_call_ms(H100, 100) == pytest.approx(H100.call_ms(Shape(100, 199, 16)))
    assert shapes.mean_call_ms(H100, 1) < shapes.mean_call_ms(H100, 100)


def test_the_contract_plans_as_before() -> None:
    base = simulation.Scenario(rate_rps=2000, gpus=3, duration_s=5)
    contract = replace(base, cost=load_profile("contract", 100))
    assert simulation.simulate(base).latencies_ms == simulation.simulate(contract).latencies_ms


def test_calls_on_a_curve_last_what_their_rows_cost() -> None:
    """Saturated, every call is full and lasts a full call; at a low rate calls are smaller
    and shorter."""
    shapes = parse_shapes("20-199:16")
    busy = simulation.Scenario(rate_rps=600, gpus=1, duration_s=10, cost=H100, shapes=shapes)
    out = simulation.simulate(busy)
    assert out.mean_batch > 95
    assert (
        0.95 * H100.call_ms(Shape(100, 199, 16))
        <= out.mean_call_ms
        <= H100.call_ms(Shape(100, 199, 16))
    )
    quiet = simulation.simulate(replace(busy, rate_rps=20))
    assert quiet.mean_batch < 10
    assert quiet.mean_call_ms < H100.call_ms(Shape(16, 199, 16)) + 1


def test_capacity_on_a_curve_prints_gpus_fill_and_latency_in_calls() -> None:
    text = capacity("--rps", "2000", "--deadline-ms", "500", "--cost", "h100-graphs-135m",
                    "--request-shapes", "20-199:16", "--seconds", "10")  # fmt: skip
    assert "calls on the h100-graphs-135m curve" in text
    assert "in calls:" in text
    contract = capacity("--rps", "2000", "--deadline-ms", "500", "--seconds", "10")
    gpus = {t: int(next(line.split()[2] for line in t.splitlines() if "GPUs needed" in line))
            for t in (text, contract)}  # fmt: skip
    assert gpus[text] > gpus[contract]  # a full call is 205 ms on the curve, 100 by contract


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cost", "h100-graphs-135m"], "--cost needs --request-shapes"),
        (["--request-shapes", "20:16"], "give --cost"),
        (["--cost", "nope", "--request-shapes", "20:16"], "no cost profile"),
        (["--cost", "h100-graphs-135m", "--request-shapes", "20:400"], "past the"),
    ],
)
def test_capacity_refuses_a_curve_it_cannot_price(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        capacity("--rps", "2000", "--deadline-ms", "500", *args)
