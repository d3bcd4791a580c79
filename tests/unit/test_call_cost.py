"""The cost profiles (batching.call_cost): the contract's constant call, the packaged H100
profile against the GPU report it was fitted to, the graphs' fallback to eager, and the
simulated sampler spending what its profile says."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batching.call_cost import CostProfile, Shape, load_profile, packaged_profiles
from batching.generation import Completion, Row, RowSettings
from bench.profile_fit import fit, section_of
from devstack.stack import ROOT
from workers.samplers.simulated import SimulatedSampler

H100 = "h100-graphs-135m"
REPORT = ROOT / "docs" / "gpu-report.md"


def report_times() -> dict[tuple[int, int], float]:
    """The report's graph calls by (rows, new tokens), as its tables print them."""
    raw = fit(section_of(REPORT.read_text(), "### 3."), H100, "")
    return {(int(rows), int(steps)): ms for rows, by in raw["graphs"].items()
            for steps, ms in by.items()}  # fmt: skip


def test_the_contract_costs_the_same_whatever_the_shape() -> None:
    contract = load_profile("contract", 100)
    assert {contract.call_ms(Shape(rows, 500, steps)) for rows in (1, 100)
            for steps in (1, 64)} == {100.0}  # fmt: skip


def test_the_packaged_profile_is_the_report_s_fit() -> None:
    packaged = json.loads((ROOT / "batching" / "cost_profiles" / f"{H100}.json").read_text())
    refit = fit(section_of(REPORT.read_text(), "### 3."), H100, packaged["source"])
    assert {k: v for k, v in refit.items() if k != "source"} == {
        k: v for k, v in packaged.items() if k != "source"
    }
    assert H100 in packaged_profiles()


def test_the_h100_profile_gives_the_report_s_times_within_10_percent() -> None:
    profile = load_profile(H100, 100)
    for (rows, steps), measured in report_times().items():
        predicted = profile.call_ms(Shape(rows, 199, steps))
        assert abs(predicted - measured) <= 0.1 * measured, (rows, steps, predicted, measured)


def test_rows_round_up_to_their_graph_bucket() -> None:
    profile = load_profile(H100, 100)
    assert profile.bucket(9) == profile.bucket(16) == 16
    assert profile.call_ms(Shape(9, 50, 16)) == profile.call_ms(Shape(16, 50, 16))
    assert profile.call_ms(Shape(17, 50, 16)) > profile.call_ms(Shape(16, 50, 16))


def test_a_call_past_the_graphs_positions_falls_back_to_eager() -> None:
    profile = load_profile(H100, 100)
    fits = Shape(10, profile.graph_positions - 16 + 1, 16)
    past = Shape(10, profile.graph_positions - 16 + 2, 16)
    assert profile.on_graphs(fits)
    assert not profile.on_graphs(past)
    assert profile.call_ms(past) > 2 * profile.call_ms(fits)


def test_an_unknown_profile_is_refused_with_the_choices(tmp_path: object) -> None:
    with pytest.raises(ValueError, match=H100):
        load_profile("no-such-gpu", 100)


def test_a_bad_profile_file_is_refused(tmp_path: pytest.TempPathFactory) -> None:
    bad = tmp_path / "bad.json"  # type: ignore[operator]
    bad.write_text('{"name": "x", "graphs": {"1": {"0": 5}}}')
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(str(bad), 100)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(str(bad), 100)


def test_profile_fit_writes_a_profile_a_setting_can_name(tmp_path: pytest.TempPathFactory) -> None:
    out = tmp_path / "mine.json"  # type: ignore[operator]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "profile-fit", "--name", "mine", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "| graphs | 100 |" in done.stderr
    assert load_profile(str(out), 100).call_ms(Shape(1, 50, 16)) == pytest.approx(
        load_profile(H100, 100).call_ms(Shape(1, 50, 16))
    )


def rows_of(count: int, max_tokens: int, stream: bool = False) -> list[Row]:
    settings = RowSettings(max_tokens=max_tokens, temperature=0.0)
    return [Row(f"prompt {i}", settings, stream=stream) for i in range(count)]


def timed_call(sampler: SimulatedSampler, rows: list[Row], sink: object = None) -> float:
    started = time.perf_counter()
    sampler.batched_complete(rows, sink=sink)  # type: ignore[arg-type]
    return (time.perf_counter() - started) * 1000


def test_the_simulated_sampler_spends_its_profile_s_time() -> None:
    profile = load_profile(H100, 100)
    sampler = SimulatedSampler(extra_words=40, cost=profile)
    for rows in (1, 100):
        expected = profile.call_ms(Shape(rows, 2, 16))
        took = min(timed_call(sampler, rows_of(rows, 16)) for _ in range(3))
        assert sampler.last_steps == 16
        assert expected <= took <= expected * 1.1, (rows, took, expected)


def test_a_streamed_row_s_tokens_come_a_step_apart() -> None:
    profile = load_profile(H100, 100)
    sampler = SimulatedSampler(extra_words=40, cost=profile)
    times: list[float] = []

    def sink(row: int, text: str, tokens: tuple[int, int] | None = None) -> bool:
        times.append(time.perf_counter())
        return False

    sampler.batched_complete(rows_of(1, 32, stream=True), sink=sink)
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    step_ms = profile.step_ms(Shape(1, 2, 32))
    assert len(times) == 32
    assert abs(gaps[len(gaps) // 2] * 1000 - step_ms) <= 0.1 * step_ms, (gaps, step_ms)


def test_a_call_whose_clients_left_ends_with_its_live_rows() -> None:
    """100 rows, 90 of them streams cut after their first token: the call ends when its 10
    live rows end (16 steps), not at the cut rows' 32."""
    profile = load_profile(H100, 100)
    sampler = SimulatedSampler(extra_words=40, cost=profile)
    live, cut = rows_of(10, 16), rows_of(90, 32, stream=True)

    def sink(row: int, text: str, tokens: tuple[int, int] | None = None) -> bool:
        return True  # every streaming row's client left after its first token

    took = timed_call(sampler, live + cut, sink)
    answers = sampler.batched_complete(live + cut)  # the same call, no client left
    assert all(isinstance(a, Completion) and a.completion_tokens == 32 for a in answers[10:])
    assert sampler.last_steps == 32
    sampler.batched_complete(live + cut, sink=sink)
    assert sampler.last_steps == 16
    ends_live = profile.call_ms(Shape(100, 2, 16, 32))
    # Not the time the cut rows would have taken (the steps above are the exact measure).
    assert ends_live <= took < profile.call_ms(Shape(100, 2, 32)), took


def test_the_contract_call_lasts_its_time_whatever_its_shape() -> None:
    sampler = SimulatedSampler(batch_ms=50, extra_words=40)
    assert 50 <= timed_call(sampler, rows_of(100, 32)) <= 55 + 50
    assert isinstance(CostProfile.contract(50), CostProfile)


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "x", "contract_ms": NaN}',
        '{"name": "x", "contract_ms": -50}',
        '{"name": "x"}',
        '{"name": "x", "eager": {"1": {"16": -5}}}',
        '{"name": "x", "eager": {"1": {"16": 1e300}}}',
        '{"name": "x", "eager": {"1": {"16": Infinity}}}',
        '{"name": "x", "eager": {"1": {"16": "5"}}}',
        '{"name": "x", "eager": {"0": {"16": 5}}}',
        '{"name": "x", "graph_buckets": "164", "graphs": {"1": {"16": 5}}}',
        '{"name": "x", "graph_buckets": [0, 8], "graphs": {"1": {"16": 5}}}',
        '{"name": "x", "graphs": {"1": {"16": 5}}}',
        "[" * 100_000,
    ],
)
def test_a_hostile_profile_is_refused_saying_why(tmp_path: Path, body: str) -> None:
    bad = tmp_path / "hostile.json"
    bad.write_text(body)
    with pytest.raises(ValueError, match="not a profile"):
        load_profile(str(bad), 100)


def test_a_profile_path_that_is_no_file_is_refused(tmp_path: Path) -> None:
    for path in (str(tmp_path), "/dev/zero"):
        with pytest.raises(ValueError, match="no cost profile"):
            load_profile(path, 100)
