"""Smoke test of the benchmark (python -m bench compare --quick): every design, real processes.

The benchmark's figures come from `make bench-compare`; this only proves its code works end
to end at a scale CI affords: services start, the load generator's answers are checked,
the table, the JSON and the plots are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_quick_benchmark_runs_every_design(tmp_path: Path, redis_url: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "compare", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["rows"]
    designs = {row["design"] for row in rows}
    assert designs == {"ours", "bare view", "per-request", "celery-batches", "timer"}
    assert len(rows) == 2 * len(designs)  # two load levels each
    for row in rows:
        assert row["wrong"] == 0, row  # no answer went to the wrong request
        assert row["sent"] > 0
        assert row["redis_commands"] > 0
    for design in designs:
        # CPU time comes in 10 ms ticks: a level of ten bare requests may read 0; a design's
        # two levels together may not.
        assert sum(row["web_cpu_ms"] for row in rows if row["design"] == design) > 0, design
    for row in rows:
        if row["design"] in ("ours", "bare view"):
            assert row["ok_share"] >= 0.95, row  # light load: (nearly) all answered
        if row["design"] != "bare view":
            assert row["calls"] >= 1, row
            assert 1 <= row["mean_batch"] <= 100, row
            assert 0 < row["gpu_busy"] <= 1.2, row
    ours = [row for row in rows if row["design"] == "ours"]
    assert all("sim_goodput_rps" in row and "sim_p99_ms" in row for row in ours)
    text = (tmp_path / "results.md").read_text()
    assert "| N | load | offered req/s | design |" in text
    assert "ours / timer" in text
    for name in ("goodput.png", "p99.png", "batch_fill.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG"
            assert image.width > 300
